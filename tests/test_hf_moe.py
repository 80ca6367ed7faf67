"""MoE (Qwen3-MoE): routing recorded in forward and replayed in recompute, and the
load-balancing loss.

Hugging Face's auxiliary loss is ``E * sum_e (T_e / R) * (P_e / R)`` with T, P and R
summed over *all* layers and over the rows of the whole batch. The adapter carries the
three sums with the hidden states; the pipeline's ``tail_context`` gathers the counts
T and R of every microbatch before the fused tail runs, and each microbatch's tail adds
``E * sum_e (T_e / R) * (P_e / R)`` with its own P (which carries the gradient), so the
sum over microbatches is Hugging Face's whole-batch loss, checked element by element.
"""

from __future__ import annotations

import logging

import pytest
import torch

import rotapipe
import rotapipe.adapters
from rotapipe.adapters import moe
from hf_models import (COMMON, assert_grads_equal, batch, clone, hf_backward,
                       pipe_backward, tiny, transformers)


@pytest.mark.parametrize("workers, microbatches, grain",
                         [(2, 4, "stage"), (3, 4, "layer"), (3, 2, "stage")])
def test_aux_loss_over_several_microbatches_equals_the_whole_batch(workers, microbatches,
                                                                    grain):
    model = tiny("qwen3moe")
    assert model.config.output_router_logits
    ref = clone(model)
    want = hf_backward(ref, *batch())
    m = clone(model)
    got = pipe_backward(m, *batch(), workers, microbatches, grain=grain)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert_grads_equal(m, ref)


def test_moe_blocks_in_the_tail_are_refused_for_the_whole_batch_aux_loss():
    model = tiny("qwen3moe")
    with pytest.raises(rotapipe.WorkerError, match="use tail_layers=1"):
        pipe_backward(model, *batch(), 2, 4, tail_layers=2)


def test_without_aux_loss_several_microbatches_equal_the_whole_batch():
    model = tiny("qwen3moe")
    model.config.output_router_logits = False
    ref = clone(model)
    want = hf_backward(ref, *batch())
    m = clone(model)
    got = pipe_backward(m, *batch(), 2, 4)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert_grads_equal(m, ref)


def test_routers_found_from_model_metadata():
    wrapped = rotapipe.adapters.wrap_hf(tiny("qwen3moe"))
    assert wrapped.parts["routers"] == ["mlp.gate"]
    routed = [len(layer.routers) for layer in wrapped.layers[1:-1]]
    assert routed == [1, 0, 1]      # layer 1 is in mlp_only_layers
    assert wrapped.loss_fn.moe == moe.MoESpec(num_experts=4, top_k=2, coef=0.5)


def _experts_input(block, log, layer=0):
    """Run ``block`` through a RouterTap; return the expert indices the experts got."""
    seen = []
    hook = block.mlp.experts.register_forward_pre_hook(
        lambda mod, args: seen.append(args[1].clone()))
    h = torch.randn(2, 5, COMMON["hidden_size"], generator=torch.Generator().manual_seed(3))
    cos = torch.ones(1, 5, 8)
    try:
        with moe.RouterTap(block, (("mlp.gate", 0),), log, layer) as tap:
            block(h, attention_mask=None, position_embeddings=(cos, cos * 0))
    finally:
        hook.remove()
    return seen[0], tap.logits[0]


def test_recompute_replays_the_forward_routing():
    block = tiny("qwen3moe").model.layers[0]
    log = moe.RoutingLog()
    first, _ = _experts_input(block, log)
    assert len(log) == 1
    with torch.no_grad():       # a recompute whose router would now choose otherwise
        block.mlp.gate.weight.copy_(torch.randn_like(block.mlp.gate.weight) * 10)
    replayed, logits = _experts_input(block, log)
    fresh, _ = _experts_input(block, moe.RoutingLog())
    assert torch.equal(replayed, first)
    assert not torch.equal(fresh, first)
    assert logits.shape == (10, 4)
    assert "forward" not in vars(block.mlp.gate)    # the instance patch is undone


def test_pipeline_records_in_forward_and_replays_in_recompute(monkeypatch):
    counts = {"record": 0, "replay": 0}
    record, replay = moe.RoutingLog.record, moe.RoutingLog.replay

    def counting_record(self, key, idx):
        counts["record"] += 1
        return record(self, key, idx)

    def counting_replay(self, key, device):
        out = replay(self, key, device)
        counts["replay"] += out is not None
        return out

    monkeypatch.setattr(moe.RoutingLog, "record", counting_record)
    monkeypatch.setattr(moe.RoutingLog, "replay", counting_replay)
    pipe_backward(tiny("qwen3moe"), *batch(), 2, 4)
    # 2 sparse layers x 4 microbatches: recorded by the forward stages, replayed by the
    # recompute of the backward stages.
    assert counts == {"record": 2 * 4, "replay": 2 * 4}
    counts.update(record=0, replay=0)
    # Layer grain, one backward stage over layers 0-3: the pass without autograd runs
    # layers 0-2 (one sparse block), the backward re-runs all four (two).
    pipe_backward(tiny("qwen3moe"), *batch(), 2, 4, grain="layer", backward_stages=1)
    assert counts == {"record": 2 * 4, "replay": (1 + 2) * 4}


def test_aux_formula_is_checked_against_the_model():
    model = tiny("qwen3moe")
    spec = moe.MoESpec(num_experts=4, top_k=2, coef=0.5)
    moe.check_aux_formula(model, spec)     # Qwen3-MoE: Switch formula
    mod = transformers.models.qwen3_moe.modeling_qwen3_moe
    orig = mod.load_balancing_loss_func
    try:
        mod.load_balancing_loss_func = lambda *a, **k: orig(*a, **k) * 2
        with pytest.raises(rotapipe.adapters.AdapterError, match="moe_aux_loss=False"):
            rotapipe.adapters.wrap_hf(model)
    finally:
        mod.load_balancing_loss_func = orig


@pytest.mark.parametrize("mode", ["overlap", "stale"])
@pytest.mark.parametrize("workers, microbatches", [(2, 2), (3, 4)])
def test_pipelined_calls_with_the_aux_loss_equal_hf_steps(mode, workers, microbatches):
    """Four pipelined ``train_step`` calls with the whole-batch aux loss: each call's
    tail waits for every microbatch *of that call* (before, call 1's tail waited for
    call 0's activations and read its own before they were written). Losses and weights
    equal Hugging Face's own steps (``stale``: each gradient taken on the weights one
    step back), and what ran is the simulator's schedule with the tail barrier."""
    model = tiny("qwen3moe")
    ref, m = clone(model), clone(model)
    data = [batch(seed=s) for s in range(1, 5)]
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)

    def apply(grads):
        for n, p in ref.named_parameters():
            p.grad = grads[n]
        opt.step()

    shadow, want, pending = clone(model), [], None
    for ids, mask, labels in data:
        shadow.zero_grad(set_to_none=True)
        want.append(hf_backward(shadow, ids, mask, labels))
        grads = {n: p.grad for n, p in shadow.named_parameters()}
        if mode == "stale":
            pending, grads = grads, pending
        if grads is not None:
            apply(grads)
        shadow.load_state_dict(ref.state_dict())
    if pending is not None:
        apply(pending)                   # state_dict() applies the last stale step
    wrapped = rotapipe.adapters.wrap_hf(m, loss_chunk_tokens=5)
    cfg = rotapipe.PipeConfig(workers=workers, microbatches=microbatches,
                              backend="emulated", optimizer_mode=mode)
    with wrapped.pipe(cfg, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1,
                                                               momentum=0.9)) as pipe:
        got = [pipe.train_step(wrapped.inputs(ids, mask), labels)
               for ids, mask, labels in data]
        pipe.flush()
        ran = pipe.last_timeline(calls=len(data)).schedule
        sim = rotapipe.schedule.roundpipe_stale_schedule(
            pipe.plan, workers, microbatches, calls=len(data),
            staleness=1 if mode == "stale" else 0, ties=pipe._ties, side_inputs=True,
            rows_first=pipe._rows_first, tail_barrier=True)
    assert ran.to_text() == sim.to_text()
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    w = dict(ref.named_parameters())
    for name, p in m.named_parameters():
        torch.testing.assert_close(p, w[name], rtol=1e-5, atol=1e-6, msg=name)


def _glm4v_moe():
    """GLM-4.5V shape: a vision-language wrapper whose routers are declared on its inner
    text model only (``Glm4vMoeTextModel._can_record_outputs``), load-balancing loss on."""
    text = dict(COMMON, moe_intermediate_size=16, n_routed_experts=4, n_shared_experts=1,
                first_k_dense_replace=1, output_router_logits=True, router_aux_loss_coef=0.5,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "partial_rotary_factor": 0.5, "mrope_section": [1, 1, 0]},
                num_experts_per_tok=2)
    vision = dict(depth=1, hidden_size=16, num_heads=2, patch_size=2, spatial_merge_size=1,
                  temporal_patch_size=1, out_hidden_size=32, intermediate_size=32,
                  image_size=8)
    config = transformers.Glm4vMoeConfig(text_config=text, vision_config=vision,
                                         image_token_id=90, video_token_id=91,
                                         image_start_token_id=92, image_end_token_id=93,
                                         video_start_token_id=94, video_end_token_id=95)
    for c in (config, config.text_config, config.vision_config):
        c._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.Glm4vMoeForConditionalGeneration(config)


def _llama4():
    """Llama 4 (text): routers declared on ``Llama4TextModel``, experts as batched
    matmuls (no experts implementation to choose), no load-balancing loss."""
    torch.manual_seed(0)
    return transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(
        **COMMON, head_dim=8, num_local_experts=4, num_experts_per_tok=1,
        intermediate_size_mlp=48, moe_layers=[0, 2], no_rope_layers=[1, 1, 1],
        attn_implementation="eager"))


def test_routers_declared_by_the_inner_text_model_train_with_the_aux_loss():
    """GLM-4.5V declares its routers on the text model under the wrapper. They used to
    be missed: with the load-balancing loss on, wrap_hf refused the model ("forward
    failed when run with stub decoder layers"), and without it routing was never
    replayed. Now the loss (with the aux term) and every gradient equal its own."""
    model = _glm4v_moe()
    wrapped = rotapipe.adapters.wrap_hf(clone(model))
    assert wrapped.parts["routers"] == ["mlp.gate"]
    assert wrapped.loss_fn.moe == moe.MoESpec(num_experts=4, top_k=2, coef=0.5)
    ref, m = clone(model), clone(model)
    want = hf_backward(ref, *batch())
    got = pipe_backward(m, *batch(), 2, 2)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert_grads_equal(m, ref)


def test_llama4_routers_replay_and_an_aux_loss_it_lacks_is_refused(monkeypatch, caplog):
    """Llama 4's routers (declared on its inner model) are found and replayed in
    recompute; ``moe_aux_loss=True`` is refused (transformers has no load-balancing loss
    for it), where it used to be ignored silently; and its batched-matmul experts draw
    no "eager experts" warning (``set_experts_implementation`` refuses the family)."""
    model = _llama4()
    with caplog.at_level(logging.WARNING, logger="rotapipe.adapters.moe"):
        wrapped = rotapipe.adapters.wrap_hf(clone(model))
    assert "eager" not in caplog.text
    assert [len(layer.routers) for layer in wrapped.layers[1:-1]] == [1, 0, 1]
    with pytest.raises(rotapipe.adapters.AdapterError, match="no load_balancing_loss_func"):
        rotapipe.adapters.wrap_hf(clone(model), moe_aux_loss=True)
    replayed = []
    replay = moe.RoutingLog.replay

    def counting_replay(self, key, device):
        out = replay(self, key, device)
        replayed.append(out is not None)
        return out
    monkeypatch.setattr(moe.RoutingLog, "replay", counting_replay)
    ref, m = clone(model), clone(model)
    want = hf_backward(ref, *batch())
    got = pipe_backward(m, *batch(), 2, 2)
    assert sum(replayed) == 2 * 2          # 2 sparse layers x 2 microbatches
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert_grads_equal(m, ref)


def test_accumulated_calls_weigh_each_calls_aux_loss_by_its_tokens():
    """Two ``forward_backward`` calls before a step: each call's load-balancing loss is
    over its own batch (as the model's forward on that batch), and each call's whole
    loss counts by its share of the counted tokens, like the cross-entropy. Plain
    PyTorch: the model's loss on each batch, times its token share, backpropagated."""
    model = tiny("qwen3moe")
    ids, mask, labels = batch(8, 7, seed=3)
    parts = [(ids[:4], mask[:4], labels[:4]), (ids[4:], mask[4:], labels[4:])]
    counted = [int((y[:, 1:] != -100).sum()) for _, _, y in parts]
    ref = clone(model)
    want = []
    for (x, a, y), n in zip(parts, counted):
        loss = ref(input_ids=x, attention_mask=a, labels=y).loss
        (loss * n / sum(counted)).backward()
        want.append(loss.item())
    m = clone(model)
    wrapped = rotapipe.adapters.wrap_hf(m, loss_chunk_tokens=5)
    with wrapped.pipe(rotapipe.PipeConfig(workers=2, microbatches=2,
                                          backend="emulated")) as pipe:
        got = [pipe.forward_backward(wrapped.inputs(x, a), y) for x, a, y in parts]
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert_grads_equal(m, ref)
