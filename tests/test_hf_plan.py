"""The runtime's plan of a wrapped Hugging Face model comes from the config's FLOP
model (rotapipe.plan.model_work), not from parameter counts: the embedding costs a row
lookup, the LM head its vocabulary projection, and blocks include attention."""

import pytest

import rotapipe
import rotapipe.adapters
from rotapipe.planner import pipeline as pipe_plan
from rotapipe.config import RecomputeGrain
from rotapipe.model import layer_work
from rotapipe.plan import model_work
from rotapipe.planner.autoplan import PlannerConfig, choose_plan

transformers = pytest.importorskip("transformers")

SEQ = 512   # max_position_embeddings below the planner's nominal 2048: attention at 512


def _qwen3():
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=2048, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=SEQ, tie_word_embeddings=True, attn_implementation="eager"))


def _plan(costs, workers=2, microbatches=2):
    return choose_plan(lambda m: costs, PlannerConfig(
        workers, 2**62, (microbatches,), grains=(RecomputeGrain.STAGE,),
        exhaustive=pipe_plan.RUNTIME_EXHAUSTIVE, tail_layers=1)).plan


def test_planner_prices_a_wrapped_qwen3_by_its_flop_model():
    wrapped = rotapipe.adapters.wrap_hf(_qwen3())
    works = model_work(wrapped.config, SEQ)
    assert [layer_work(l) for l in wrapped.layers] == list(works)
    config = rotapipe.PipeConfig(workers=2, microbatches=2, backend="emulated")
    with wrapped.pipe(config) as pipe:
        costs = pipe._planner.base
        plan = pipe.plan
    fwd = [l.forward_ms for l in costs.layers]
    h, vocab = 32, 2048
    # Embedding: a row read and written per token (bf16), priced by bandwidth.
    assert fwd[0] == pytest.approx(pipe_plan.NOMINAL_FLOPS_PER_BYTE * 2 * h * 2 * 1e-9)
    # LM head: the vocabulary projection, 2 FLOPs per weight per token.
    assert fwd[-1] == pytest.approx(2 * h * vocab * 1e-9)
    assert fwd[0] < 0.2 * fwd[-1]
    # Blocks: projections and MLP (2 FLOPs per weight) plus causal attention at SEQ.
    block = wrapped.layers[1]
    weights = sum(p.numel() for p in block.parameters() if p.dim() == 2)
    attention = 2 * 2 * (4 * 8) * (SEQ + 1) / 2
    assert fwd[1] == pytest.approx((2 * weights + attention) * 1e-9)
    assert costs.layers[1].backward_ms > 2 * fwd[1]     # flash attention recomputes
    # The plan is the planner's on these costs, and not the parameter-count plan, which
    # prices the (tied) embedding like the head.
    sizes = [sum(p.numel() for p in l.parameters()) for l in wrapped.layers]
    by_params = pipe_plan.parameter_costs(sizes, [l.weight_bytes for l in costs.layers])
    assert by_params.layers[0].forward_ms == pytest.approx(by_params.layers[-1].forward_ms,
                                                           rel=0.01)
    assert plan == _plan(costs)
    assert plan != _plan(by_params)


def test_a_lora_model_is_priced_as_lora():
    """A PEFT LoRA model: only the adapters train, so the planner's costs are
    ``model_work`` with those adapters (a frozen weight's backward computes only its
    input gradient; the adapters add their own FLOPs), as ``rotapipe plan --lora``
    prices it; unfreezing a base weight prices the model as full fine-tuning."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_qwen3(), peft.LoraConfig(
        r=4, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0))
    wrapped = rotapipe.adapters.wrap_hf(model)
    adapters = [sum(p.numel() for n, p in l.named_parameters() if "lora_" in n)
                for l in wrapped.layers]
    assert adapters[0] == adapters[-1] == 0 and all(a > 0 for a in adapters[1:-1])
    lora = model_work(wrapped.config, SEQ, adapters=adapters)
    assert [layer_work(l) for l in wrapped.layers] == list(lora)
    full = model_work(wrapped.config, SEQ)
    # The frozen head computes no weight gradient: half its full-fine-tuning backward.
    assert lora[-1].backward_flops == pytest.approx(full[-1].backward_flops / 2)
    assert lora[1].backward_flops < full[1].backward_flops
    model.base_model.model.lm_head.weight.requires_grad_(True)
    again = rotapipe.adapters.wrap_hf(model)
    assert [layer_work(l) for l in again.layers] == list(full)
