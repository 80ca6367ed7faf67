"""Hugging Face families through the generic adapter: loss and every gradient equal the
model's own ``model(input_ids, attention_mask, labels).loss`` and its backward, element
by element (rtol 1e-5, atol 1e-6), with padding in the batch, on 2 and 3 emulated
workers and 1 and 4 microbatches. The LM-head loss runs in chunks of 5 tokens.

The MoE families have the load-balancing loss on (DeepSeek-V3 has none in
``transformers``); with several microbatches it is the whole batch's, exactly
(``test_hf_moe.py`` covers the rest of MoE). ``FEATURES`` (in ``hf_models.py``) says
which family carries which feature; ``test_features_are_on`` checks each is really on.
"""

from __future__ import annotations

import functools

import pytest
import torch

import rotapipe
import rotapipe.adapters
from hf_models import (COMMON, FAMILIES, FEATURES, assert_grads_equal, batch, clone,
                       hf_backward, pipe_backward, tiny, transformers)

RUNS = [(2, 1), (2, 4), (3, 1), (3, 4)]


@functools.lru_cache(maxsize=None)
def reference(family: str):
    model = tiny(family)
    ref = clone(model)
    loss = hf_backward(ref, *batch())
    return model, ref, loss


@pytest.mark.parametrize("family", FAMILIES)
def test_loss_and_grads_equal_hf(family):
    model, ref, want = reference(family)
    for workers, microbatches in RUNS:
        m = clone(model)
        got = pipe_backward(m, *batch(), workers, microbatches)
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6), (workers, microbatches)
        assert_grads_equal(m, ref)


def _resized(family: str, n: int, **kw):
    model = tiny(family)
    model.resize_token_embeddings(n, mean_resizing=False, **kw)
    return model


def _prepared(family: str, prepare):
    model = tiny(family)
    prepare(model)
    return model


SETTINGS = {
    # What users do to a model before training it; each must keep HF's loss and grads.
    "resized_tied_pad_to_64": lambda: _resized("qwen3", 100, pad_to_multiple_of=64),
    "resized_untied": lambda: _resized("llama", 110),
    "train_mode": lambda: _prepared("qwen2", lambda m: m.train()),
    "use_cache_on": lambda: _prepared("qwen3", lambda m: setattr(m.config, "use_cache",
                                                                 True)),
    "gradient_checkpointing": lambda: _prepared(
        "llama", lambda m: (m.gradient_checkpointing_enable(), m.train())),
    "sdpa": lambda: _prepared("qwen3", lambda m: m.set_attn_implementation("sdpa")),
}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_user_settings_keep_hf_loss_and_grads(setting):
    """resize_token_embeddings, train mode (dropout 0), use_cache, gradient
    checkpointing set before wrapping, SDPA: loss and every gradient equal the model's
    own (the resized vocabulary's new ids are in the batch)."""
    model = SETTINGS[setting]()
    ids, mask, labels = batch()
    if model.config.vocab_size > ids.max() + 1:
        ids[:, 3] = model.config.vocab_size - 1
        labels = ids.masked_fill(mask == 0, -100)
    ref, m = clone(model), clone(model)
    want = hf_backward(ref, ids, mask, labels)
    got = pipe_backward(m, ids, mask, labels, 2, 2)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert_grads_equal(m, ref)


def test_the_matrix_covers_the_features():
    assert len(FAMILIES) >= 20
    for feature, (families, _) in FEATURES.items():
        assert families and set(families) <= set(FAMILIES), feature


@pytest.mark.parametrize("feature", FEATURES)
def test_features_are_on(feature):
    families, on = FEATURES[feature]
    for family in families:
        model = reference(family)[0]
        assert on(model, rotapipe.adapters.wrap_hf(model)), (feature, family)


def test_layer_grain_and_wider_tail():
    """Recompute one layer at a time, and a fused tail holding decoder layers too."""
    model, ref, want = reference("gemma2")
    for extra in (dict(grain="layer"), dict(tail_layers=2)):
        m = clone(model)
        got = pipe_backward(m, *batch(), 3, 4, **extra)
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6), extra
        assert_grads_equal(m, ref)


def test_unchunked_head_gives_the_same_gradients():
    model, ref, want = reference("llama")
    m = clone(model)
    got = pipe_backward(m, *batch(), 2, 4, loss_chunk_tokens=None)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert_grads_equal(m, ref)


def test_bf16_compute_tracks_hf_bf16():
    """bf16 compute (fp32 masters) against the HF model cast to bf16: close, not equal
    (masks and rotary tables must be built in bf16 for this to hold)."""
    model = tiny("qwen3")
    ref = clone(model).to(torch.bfloat16)
    want = hf_backward(ref, *batch())
    m = clone(model)
    got = pipe_backward(m, *batch(), 2, 1,
                        precision=rotapipe.PrecisionConfig("bf16"))
    assert got == pytest.approx(want, rel=2e-2)
    g = dict(m.named_parameters())
    for name, p in ref.named_parameters():
        cos = torch.nn.functional.cosine_similarity(g[name].grad.flatten().float(),
                                                    p.grad.flatten().float(), dim=0)
        assert cos > 0.99, (name, cos)


def test_wrapped_model_keeps_hf_surface():
    model = tiny("qwen3")
    wrapped = rotapipe.adapters.wrap_hf(model)
    assert wrapped.config is model.config
    assert wrapped.generation_config is model.generation_config
    assert len(wrapped.layers) == model.config.num_hidden_layers + 2
    assert wrapped.parts == {"embed": "model.embed_tokens", "layers": "model.layers",
                             "norm": "model.norm", "head": "lm_head", "routers": []}
    # Tied embeddings: the same Parameter in layer 0 and the head (one master).
    assert wrapped.layers[0].embed.weight is wrapped.layers[-1].lm_head.weight


BATCH_ROPES = {
    "dynamic": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **{**COMMON, "max_position_embeddings": 16}, head_dim=8, attn_implementation="eager",
        rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0))),
    "longrope": lambda: transformers.Phi3ForCausalLM(transformers.Phi3Config(
        **COMMON, attn_implementation="eager", original_max_position_embeddings=16,
        rope_parameters=dict(
            rope_type="longrope", rope_theta=10000.0, short_factor=[1.0, 1.1, 1.2, 1.3],
            long_factor=[2.0, 3.0, 4.0, 5.0], original_max_position_embeddings=16))),
}


@pytest.mark.parametrize("rope", sorted(BATCH_ROPES))
@pytest.mark.parametrize("workers, microbatches", [(2, 2), (3, 4)])
def test_rope_scaled_by_the_whole_batch(rope, workers, microbatches):
    """Dynamic and long RoPE choose their frequencies from the largest position id of
    the batch the model's forward is given. With explicit position ids whose largest
    value differs between microbatches (the first rows short of the original context,
    the last beyond it), each microbatch's rotary tables are the whole batch's."""
    torch.manual_seed(0)
    model = BATCH_ROPES[rope]()
    ids, _, labels = batch(n=8, t=12)
    pos = torch.arange(12).repeat(8, 1)
    pos[4:] += 19                               # largest 11 in rows 0-3, 30 in rows 4-7
    ref = clone(model)
    out = ref(input_ids=ids, position_ids=pos, labels=labels)
    out.loss.backward()
    m = clone(BATCH_ROPES[rope]())              # a fresh rotary state, as ref's was
    m.load_state_dict(model.state_dict())
    wrapped = rotapipe.adapters.wrap_hf(m, loss_chunk_tokens=5)
    with wrapped.pipe(rotapipe.PipeConfig(workers=workers, microbatches=microbatches,
                                          backend="emulated")) as pipe:
        got = pipe.forward_backward(wrapped.inputs(ids, None, pos), labels)
    assert got == pytest.approx(out.loss.item(), rel=1e-5, abs=1e-6)
    assert_grads_equal(m, ref)


def test_packed_sequences_keep_their_documents_apart():
    """Position ids restarting inside a row, no attention mask: the documents stay apart
    as in ``model(..., use_cache=False)`` (transformers detects packing only when it
    builds no cache; its default ``use_cache=True`` call attends across them)."""
    model = tiny("llama")
    ids, _, labels = batch(n=4, t=12)
    pos = torch.cat([torch.arange(5), torch.arange(7)]).repeat(4, 1)   # 2 documents a row
    ref = clone(model)
    want = ref(input_ids=ids, position_ids=pos, labels=labels, use_cache=False)
    want.loss.backward()
    with torch.no_grad():
        across = clone(model)(input_ids=ids, position_ids=pos, labels=labels).loss.item()
    assert abs(across - want.loss.item()) > 1e-3        # the two references differ
    m = clone(model)
    wrapped = rotapipe.adapters.wrap_hf(m, loss_chunk_tokens=5)
    with wrapped.pipe(rotapipe.PipeConfig(workers=2, microbatches=2,
                                          backend="emulated")) as pipe:
        got = pipe.forward_backward(wrapped.inputs(ids, None, pos), labels)
    assert got == pytest.approx(want.loss.item(), rel=1e-5, abs=1e-6)
    assert_grads_equal(m, ref)


# -- dropout the model's forward applies to the embeddings ------------------------------
def _dropout_family(cls: str, config: str, **kw):
    return lambda: getattr(transformers, cls)(getattr(transformers, config)(**kw))


_GPTJ_STYLE = dict(vocab_size=COMMON["vocab_size"], n_embd=32, n_layer=3, n_head=4,
                   rotary_dim=4, n_positions=64, n_inner=48, resid_pdrop=0.0,
                   attn_pdrop=0.0, embd_pdrop=0.3, bos_token_id=1, eos_token_id=2,
                   pad_token_id=0, attn_implementation="eager")

EMBEDDING_DROPOUT = {
    # family: builder with the dropout its forward applies to the embeddings at 0.3
    # (PhiModel: embed_dropout; GPTNeoXModel: emb_dropout, the blocks' hidden_dropout
    # too; CodeGen, GPT-J: drop; Starcoder2: functional dropout, embedding_dropout).
    "phi": _dropout_family("PhiForCausalLM", "PhiConfig", **COMMON, embd_pdrop=0.3,
                           resid_pdrop=0.0, attention_dropout=0.0,
                           attn_implementation="eager"),
    "gpt_neox": _dropout_family("GPTNeoXForCausalLM", "GPTNeoXConfig", **COMMON,
                                hidden_dropout=0.3, attention_dropout=0.0,
                                attn_implementation="eager"),
    "codegen": _dropout_family("CodeGenForCausalLM", "CodeGenConfig", **_GPTJ_STYLE),
    "gptj": _dropout_family("GPTJForCausalLM", "GPTJConfig", **_GPTJ_STYLE),
    "starcoder2": _dropout_family("Starcoder2ForCausalLM", "Starcoder2Config", **COMMON,
                                  embedding_dropout=0.3, residual_dropout=0.0,
                                  attention_dropout=0.0, attn_implementation="eager"),
}


def _seeded_hf_backward(model, ids, mask, labels, microbatches: int, call: int) -> float:
    """The model's own forward and backward in its current mode, each microbatch with
    the random streams rotapipe gives its layers (``rotapipe.layer_seed(0, call, m,
    l)``): layer 0's before the forward (the embedding and the dropout applied to it),
    block ``l - 1``'s before that block. Microbatch losses weighted by their counted
    tokens, as the pipeline does."""
    blocks = next(m for m in model.modules()
                  if isinstance(m, torch.nn.ModuleList) and len(m) == 3)
    seed = {}

    def reseed(layer):
        def hook(module, args):
            torch.manual_seed(rotapipe.layer_seed(0, call, seed["m"], layer))
        return hook
    handles = [b.register_forward_pre_hook(reseed(i + 1)) for i, b in enumerate(blocks)]
    counted = (labels[:, 1:] != -100).sum().item()
    total = 0.0
    try:
        for m, (x, a, y) in enumerate(zip(ids.tensor_split(microbatches),
                                          mask.tensor_split(microbatches),
                                          labels.tensor_split(microbatches))):
            seed["m"] = m
            torch.manual_seed(rotapipe.layer_seed(0, call, m, 0))
            loss = model(input_ids=x, attention_mask=a, labels=y).loss
            loss = loss * (y[:, 1:] != -100).sum().item() / counted
            loss.backward()
            total += loss.item()
    finally:
        for h in handles:
            h.remove()
    return total


@pytest.mark.parametrize("family", sorted(EMBEDDING_DROPOUT))
def test_embedding_dropout_is_the_models_own(family):
    """Wrapped in eval mode (as ``from_pretrained`` leaves a model): ``pipe.eval()``
    gives the model's eval-mode loss and gradients; after ``pipe.train()`` the dropout
    its forward applies to the embeddings is on, and the loss and every gradient equal
    the model's own train-mode forward run with rotapipe's per-layer seeds."""
    torch.manual_seed(0)
    model = EMBEDDING_DROPOUT[family]().eval()
    ids, mask, labels = batch()
    ref = clone(model)
    want_eval = hf_backward(ref, ids, mask, labels)
    ref_train = clone(model).train()
    want_train = _seeded_hf_backward(ref_train, ids, mask, labels, 2, call=1)
    assert abs(want_train - want_eval) > 1e-4          # the dropout changes the loss
    m = clone(model)
    wrapped = rotapipe.adapters.wrap_hf(m, loss_chunk_tokens=5)
    with wrapped.pipe(rotapipe.PipeConfig(workers=2, microbatches=2,
                                          backend="emulated")) as pipe:
        pipe.eval()
        got = pipe.forward_backward(wrapped.inputs(ids, mask), labels)
        assert got == pytest.approx(want_eval, rel=1e-5, abs=1e-6)
        assert_grads_equal(m, ref)
        pipe.zero_grad()
        pipe.train()
        got = pipe.forward_backward(wrapped.inputs(ids, mask), labels)
    assert got == pytest.approx(want_train, rel=1e-5, abs=1e-6)
    assert_grads_equal(m, ref_train)


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_with_dropout_is_turned_off_and_trains_exactly(reentrant):
    """``model.gradient_checkpointing_enable()`` (PEFT's ``prepare_model_for_kbit_training``
    calls it) with attention dropout on: the block's own checkpoint recomputed it from
    the process's random generator, not the stream its forward drew from, so every
    gradient was another mask's (the loss was right). wrap_hf turns it off: the
    pipeline recomputes each block itself."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**COMMON, "attention_dropout": 0.3,
                                            "attn_implementation": "eager"})).train()
    ids, mask, labels = batch()
    ref = clone(model)
    want = _seeded_hf_backward(ref, ids, mask, labels, 2, call=0)
    m = clone(model)
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    m.train()
    wrapped = rotapipe.adapters.wrap_hf(m)
    assert not m.is_activation_checkpointing
    with wrapped.pipe(rotapipe.PipeConfig(workers=2, microbatches=2,
                                          backend="emulated")) as pipe:
        got = pipe.forward_backward(wrapped.inputs(ids, mask), labels)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert_grads_equal(m, ref)


@pytest.mark.parametrize("family", ["phi", "starcoder2"])
def test_embedding_dropout_in_train_mode_wraps_and_trains_exactly(family):
    """A model wrapped in train mode with embedding dropout on is taken (the wrap-time
    checks run it in eval mode) and trains like its own seeded forward; computing the
    side inputs (the model's forward with stub blocks, dropout an identity there) draws
    nothing from the caller's random stream. Phi's dropout is its own module,
    Starcoder2's a functional call."""
    torch.manual_seed(0)
    model = EMBEDDING_DROPOUT[family]().train()
    ids, mask, labels = batch()
    ref = clone(model)
    want = _seeded_hf_backward(ref, ids, mask, labels, 4, call=0)
    m = clone(model)
    wrapped = rotapipe.adapters.wrap_hf(m, loss_chunk_tokens=5)
    dropout = wrapped.layers[0].dropout
    if family == "phi":
        assert dropout is m.model.embed_dropout
    else:
        assert isinstance(dropout, torch.nn.Dropout) and dropout.p == 0.3
        assert dropout.training
    torch.manual_seed(5)
    stream = torch.rand(3)
    torch.manual_seed(5)
    with wrapped.pipe(rotapipe.PipeConfig(workers=3, microbatches=4,
                                          backend="emulated")) as pipe:
        got = pipe.forward_backward(wrapped.inputs(ids, mask), labels)
        assert torch.equal(torch.rand(3), stream)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert_grads_equal(m, ref)


# -- multimodal wrappers, trained on text ----------------------------------------------
def _qwen2_vl():
    text = dict(COMMON, tie_word_embeddings=False, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]})
    vision = dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, patch_size=2,
                  spatial_merge_size=1, temporal_patch_size=1, in_channels=3,
                  out_hidden_size=32, intermediate_size=32, mlp_ratio=2)
    config = transformers.Qwen2VLConfig(text_config=text, vision_config=vision,
                                        image_token_id=90, video_token_id=91,
                                        vision_start_token_id=92)
    return config, "Qwen2VLForConditionalGeneration"


def _gemma3():
    # No final_logit_softcapping: Gemma3ForConditionalGeneration's forward does not
    # apply it (Gemma3ForCausalLM's does); the tail check refuses such a config.
    text = dict(COMMON, head_dim=8, sliding_window=4)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, image_size=8, patch_size=4)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision,
                                       mm_tokens_per_image=1, image_token_index=90,
                                       boi_token_index=91, eoi_token_index=92)
    return config, "Gemma3ForConditionalGeneration"


MULTIMODAL = {"qwen2_vl": _qwen2_vl, "gemma3": _gemma3}


@pytest.mark.parametrize("family", sorted(MULTIMODAL))
def test_multimodal_wrapper_trains_its_language_model_on_text(family):
    """A vision-language model given token ids only: its language model is found under
    the wrapper (``model.language_model``), ``verify="full"`` reads the text config,
    and the loss and every gradient equal the model's own text-only forward (the
    vision tower does not run and gets no gradient)."""
    config, cls = MULTIMODAL[family]()
    for c in (config, config.text_config, config.vision_config):
        c._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, cls)(config)
    wrapped = rotapipe.adapters.wrap_hf(clone(model), verify="full")
    assert wrapped.parts["layers"] == "model.language_model.layers"
    ref, m = clone(model), clone(model)
    want = hf_backward(ref, *batch())
    got = pipe_backward(m, *batch(), 2, 2)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert_grads_equal(m, ref)
