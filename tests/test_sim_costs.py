"""Hardware profiles and the per-layer cost model from Hugging Face configs (arithmetic,
checked against transformers models built on the meta device: no weights)."""

import json
import pathlib
import re

import pytest
import torch

import rotapipe
from rotapipe import even_plan, roundpipe_schedule
from rotapipe import ConfigError
from rotapipe.plan import (bound_plan, DEVICES, Hardware, LayerCost, ModelCosts, hardware, load_config,
                           model_costs, model_work)
from rotapipe.plan.configs import (FAMILIES, KNOWN_MODELS, PEFT_FOLDED_EXPERTS, _experts,
                                   folded_expert_stacks, tied_head)

transformers = pytest.importorskip("transformers")
import hf_models  # noqa: E402 - needs transformers


def test_named_hardware_profiles():
    hw = hardware("rtx4090x8")
    assert (hw.count, hw.device.memory_gib, hw.device.tflops, hw.device.p2p) == (8, 24.0, 165.2,
                                                                                 False)
    assert hw.device.tflops_fp16_accumulate == pytest.approx(330.3)
    assert hw.device.pcie_gbps == 25.0 and hw.name == "rtx4090x8"
    assert hardware("rtx4090x8", fp16_accumulate=True).flops == pytest.approx(2 * hw.flops,
                                                                              rel=1e-3)
    assert hardware("a100x8").device is DEVICES["a100-80gb"]
    assert hardware("A800x4").device.tflops == 312.0 and hardware("h100-pcie").count == 1
    with pytest.raises(ConfigError, match="unknown hardware 'tpu-v9x8'.*rtx4090x8"):
        hardware("tpu-v9x8")
    with pytest.raises(ConfigError, match="efficiency"):
        Hardware(DEVICES["rtx4090"], 8, efficiency=1.5)


@pytest.mark.parametrize("name", KNOWN_MODELS)
def test_layer_parameters_match_transformers_on_meta(name):
    cfg = load_config(name)
    hf = transformers.AutoConfig.for_model(**cfg)
    hf.num_hidden_layers = 2                    # same layers, fewer of them
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    work = model_work(hf, seq=4096)             # a config object works too
    assert len(work) == 2 + 2
    assert work[0].params == model.model.embed_tokens.weight.numel()
    for w, layer in zip(work[1:-1], model.model.layers):
        assert w.params == sum(p.numel() for p in layer.parameters())
    assert work[-1].params == model.lm_head.weight.numel() + model.model.norm.weight.numel()



def _layer_params(wrapped) -> list[int]:
    """Each layer's parameters as the runtime cuts the model, a shared tensor once."""
    seen, out = set(), []
    for layer in wrapped.layers:
        fresh = [p for p in layer.parameters() if id(p) not in seen]
        seen.update(map(id, fresh))
        out.append(sum(p.numel() for p in fresh))
    return out


NOT_COUNTED = ("jetmoe", "falcon_h1", "gemma4", "xlstm")
"""Families the adapter trains (``hf_models.FAMILIES``) whose blocks the cost model
does not count (JetMoE's mixture of attention heads, Falcon-H1's state-space mixers
beside attention, Gemma 4's per-layer variants, xLSTM's mLSTM blocks): priced as
Llama-style blocks, and ``rotapipe plan`` says so."""


def test_families_the_cost_model_does_not_count_are_named_so():
    for family in NOT_COUNTED:
        model_type = hf_models.FAMILIES[family]().config.model_type
        assert model_type not in FAMILIES, family


@pytest.mark.parametrize("family", sorted(set(hf_models.FAMILIES) - set(NOT_COUNTED)))
def test_every_family_is_counted_as_transformers_builds_it(family):
    """Every Hugging Face family the adapter trains: each layer's parameter count from
    the config alone equals the model's own (embedding, every block, head with its
    final norm; a tied head holds no weight of its own), and a dense block's FLOPs are
    2 per weight and bias its projections and MLP multiply a token by, plus attention."""
    torch.manual_seed(0)
    model = hf_models.FAMILIES[family]()
    real = _layer_params(rotapipe.adapters.wrap_hf(model))
    work = model_work(model.config, seq=1)
    assert tied_head(model.config) == (
        model.get_output_embeddings().weight is model.get_input_embeddings().weight)
    shared = work[0].params if tied_head(model.config) else 0
    assert [w.params for w in work[:-1]] + [work[-1].params - shared] == real
    cfg = model.config
    if getattr(cfg, "kv_lora_rank", None) or any(
            getattr(cfg, k, None) for k in ("num_experts", "num_local_experts")):
        return                          # MoE and latent attention: test_gpt_oss, below
    block = rotapipe.adapters.wrap_hf(model).layers[1]
    multiplied = sum(p.numel() for n, p in block.named_parameters()
                     if not any(s in n for s in ("norm", "ln_", "sinks")))
    heads = cfg.num_attention_heads
    width = heads * (getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    # seq=1: a token attends to itself, QK^T and AV are 2 x width FLOPs each.
    assert work[1].forward_flops == 2 * multiplied + 4 * width



DENSE = sorted(f for f in hf_models.FAMILIES
               if f not in ("qwen3moe", "qwen2moe", "gpt_oss", "deepseek_v3", "qwen3_next",
                            *NOT_COUNTED))


@pytest.mark.parametrize("family", DENSE)
def test_lora_params_equal_peft_all_linear_on_every_dense_family(family):
    """The planner's LoRA adapters per layer (rotapipe.plan.lora_params, from the config)
    equal what PEFT's target_modules="all-linear" (rotapipe train --lora's default)
    puts on the model, layer by layer: fused projections, two-matrix MLPs, biases
    and norms left alone. (MoE models: PEFT 0.21 adapts the routed experts and the
    router and, on Qwen3-MoE and DeepSeek-V3, not the dense MLPs or shared experts;
    the planner does the opposite: docs/planning.md.)"""
    peft = pytest.importorskip("peft")
    from rotapipe.plan import lora_params
    torch.manual_seed(0)
    model = hf_models.FAMILIES[family]()
    config = model.config.to_dict()
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules="all-linear",
                                                       lora_dropout=0.0))
    real = [sum(p.numel() for p in layer.parameters() if p.requires_grad)
            for layer in rotapipe.adapters.wrap_hf(model).layers]
    assert list(lora_params(config, 4)) == real


MOE = [f for f in FAMILIES
       if _experts(transformers.AutoConfig.for_model(f, num_hidden_layers=4).to_dict())]


def test_peft_folds_the_experts_of_the_families_the_planner_names():
    """Which MoE families' fused expert stacks PEFT's all-linear adapts (and
    ``rotapipe plan --lora`` warns about): every MoE family of FAMILIES, its default
    config with 4 blocks on the meta device, against PEFT's own wrappers; the targets
    ``rotapipe train``'s note suggests adapt no stack (nor the router)."""
    peft = pytest.importorskip("peft")
    from peft.tuners.lora.layer import ParamWrapper
    from rotapipe.train.model import folded_expert_note
    assert len(MOE) >= 15
    for family in MOE:
        cfg = transformers.AutoConfig.for_model(family, num_hidden_layers=4)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(cfg)
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=4, target_modules="all-linear", lora_dropout=0.0), low_cpu_mem_usage=True)
        stacks = sum(isinstance(m, ParamWrapper) and m.get_param().dim() == 3
                     for m in model.modules())
        assert folded_expert_stacks(cfg) == stacks, family
        assert (family in PEFT_FOLDED_EXPERTS) == (stacks > 0), family
        if stacks:      # rotapipe train's note names targets that leave the experts frozen
            targets = folded_expert_note(model).split("--lora-targets ")[1].split(" ")[0]
            with torch.device("meta"):
                model = transformers.AutoModelForCausalLM.from_config(cfg)
            model = peft.get_peft_model(model, peft.LoraConfig(
                r=4, target_modules=targets.split(","), lora_dropout=0.0),
                low_cpu_mem_usage=True)
            assert not any(isinstance(m, ParamWrapper) for m in model.modules()), family


VARIANTS = [(family, {}) for family in FAMILIES] + [
    ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 8}),
    ("falcon", {"multi_query": False, "parallel_attn": False, "bias": True}),
    ("stablelm", {"use_parallel_residual": False, "qk_layernorm": True,
                  "use_qkv_bias": True}),
    ("cohere", {"use_qk_norm": True}), ("phi", {"qk_layernorm": True}),
    ("llama", {"mlp_bias": True, "attention_bias": True}),
    ("starcoder2", {"use_bias": False}), ("gpt_neox", {"attention_bias": False}),
    ("qwen2_moe", {"qkv_bias": False, "mlp_only_layers": [0, 2], "decoder_sparse_step": 2}),
    ("deepseek_v3", {"q_lora_rank": None, "attention_bias": True, "num_hidden_layers": 5}),
    ("gemma3_text", {"tie_word_embeddings": False}),
    ("ernie4_5_moe", {"use_bias": True}),
    ("ernie4_5_moe", {"moe_layer_interval": 2, "moe_layer_start_index": 2}),
    ("ernie4_5", {"use_bias": True}),
    ("llama4_text", {"interleave_moe_layer_step": 2}), ("llama4_text", {"moe_layers": [0, 3]}),
    ("glm4_moe", {"use_qk_norm": True, "first_k_dense_replace": 2}),
    ("seed_oss", {"attention_out_bias": True, "attention_bias": False}),
    ("phimoe", {"lm_head_bias": True}), ("granitemoeshared", {"shared_intermediate_size": 64}),
]


@pytest.mark.parametrize("family,change", VARIANTS,
                         ids=[f"{f}-{'-'.join(c) or 'default'}" for f, c in VARIANTS])
def test_full_size_configs_and_their_switches_count_exactly(family, change):
    """The family's own default config (full size: DeepSeek-V3's 256 experts and latent
    attention, Falcon-7B's multi-query attention, ...) with 4 blocks and the switches
    that change a block's parameters, built on the meta device: the block counts and
    the whole model's count (tied or not, by the family's default) are exact."""
    cfg = transformers.AutoConfig.for_model(family, **{
        "num_hidden_layers": 4, "n_layer": 4, "n_layers": 4, **change})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    work = model_work(cfg, seq=2048)
    blocks: dict[int, int] = {}
    for name, p in model.named_parameters():
        found = re.search(r"\.(?:layers|h|blocks)\.(\d+)\.", name)
        if found:
            blocks[int(found.group(1))] = blocks.get(int(found.group(1)), 0) + p.numel()
    assert [w.params for w in work[1:-1]] == [blocks[i] for i in sorted(blocks)]
    shared = work[0].params if tied_head(cfg) else 0
    assert sum(w.params for w in work) - shared == sum(p.numel() for p in model.parameters())


def test_tied_head_defaults_follow_transformers():
    """A config.json without ``tie_word_embeddings`` is tied as its family's
    ``transformers`` config is by default."""
    for family in FAMILIES:
        default = transformers.AutoConfig.for_model(family).tie_word_embeddings
        assert tied_head({"model_type": family}) == default, family
    assert not tied_head({"model_type": "some_new_family"})

def test_model_sizes_and_active_flops():
    total = {n: sum(w.params for w in model_work(n, 2048)) for n in KNOWN_MODELS}
    assert total["qwen3-32b"] == pytest.approx(32.76e9, rel=1e-3)
    assert total["llama-3.1-8b"] == pytest.approx(8.03e9, rel=1e-3)
    assert total["qwen3-235b-a22b"] == pytest.approx(235.1e9, rel=1e-3)
    # matmul FLOPs per token are 2 x the active parameters (MoE: 8 of 128 experts)
    moe = model_work("qwen3-235b-a22b", seq=1)
    assert sum(w.forward_flops for w in moe) / 2 == pytest.approx(21.6e9, rel=0.01)
    dense = model_work("qwen3-32b", seq=1)
    assert sum(w.backward_flops for w in dense) == pytest.approx(
        2 * sum(w.forward_flops for w in dense), rel=1e-3)
    # attention grows with the sequence: causal, (seq + 1) / 2 positions on average
    long, short = model_work("qwen3-32b", 8192)[1], model_work("qwen3-32b", 2048)[1]
    assert long.forward_flops - short.forward_flops == pytest.approx(
        4 * 64 * 128 * (8192 - 2048) / 2)


def test_model_costs_on_hardware():
    hw = hardware("rtx4090x8")
    c = model_costs("qwen3-32b", hw, seq=2048, microbatch_size=2)
    assert c.tokens == 4096 and len(c.layers) == 66
    block = c.layers[1]
    flops = model_work("qwen3-32b", 2048)[1].forward_flops * 4096
    assert block.forward_ms == pytest.approx(flops / hw.flops * 1e3)
    assert block.recompute_ms == block.forward_ms
    assert block.weight_bytes == 2 * 487598336
    assert block.upload_ms == pytest.approx(block.weight_bytes / 25e9 * 1e3)
    assert block.output_bytes == 4096 * 5120 * 2
    assert block.hop_ms == pytest.approx(block.output_bytes / 25e9 * 1e3)
    assert c.layers[-1].name == "head" and c.layers[-1].forward_ms > block.forward_ms


def test_configs_load_from_names_paths_folders_and_dicts(tmp_path):
    shipped = pathlib.Path(rotapipe.__file__).parent / "data" / "configs" / "qwen3-32b.json"
    cfg = json.loads(shipped.read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["intermediate_size"], cfg["vocab_size"],
            cfg["head_dim"], cfg["tie_word_embeddings"]) == (5120, 64, 64, 8, 25600, 151936,
                                                             128, False)
    (tmp_path / "config.json").write_text(shipped.read_text())
    for source in ("qwen3-32b", "Qwen3-32B", shipped, str(shipped), tmp_path, cfg):
        assert load_config(source) == cfg
    with pytest.raises(ConfigError, match="no model config at"):
        load_config(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="has no 'hidden_size'"):
        model_work({"model_type": "mystery"}, 128)


def test_explicit_and_uniform_costs():
    c = ModelCosts.explicit(3, 2.0, 4.0, head_forward_ms=5.0, head_backward_ms=9.0,
                            hop_ms=0.5, tokens=10)
    assert [l.name for l in c.layers] == ["block0", "block1", "block2", "head"]
    assert c.layers[0].recompute_ms == 2.0 and c.layers[-1].backward_ms == 9.0
    assert c.boundary_hop_ms(0) == 0.0 and c.boundary_hop_ms(2) == 0.5
    assert c.sum("forward_ms", 0, 4) == 11.0
    with pytest.raises(ConfigError, match=r"forward_ms=-1.0: use a finite number >= 0"):
        LayerCost("x", -1.0, 1.0, 1.0)
    with pytest.raises(ConfigError, match="at least one layer"):
        ModelCosts((), 1)


_TINY = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "intermediate_size": 128, "vocab_size": 100}


def test_lora_prices_a_frozen_weights_backward_as_its_input_gradient_only():
    """Closed forms on a tiny Llama (h 64, q 64, kv 32, MLP 128, vocab 100, seq 8):
    per token a block's weights cost 2 x (64*64 + 2*64*32 + 64*64 + 3*64*128) = 73,728
    FLOPs forward; full fine-tuning doubles that in the backward (input and weight
    gradients), LoRA keeps one (input gradient only); the attention core (4 * 64 *
    4.5 = 1,152 forward, 2.5x backward) is the same in both. An adapter of p
    parameters adds 2p forward and 4p backward. The head's backward is 2 x 64 x 100
    (input gradient) instead of 4 x; the embedding costs nothing in either."""
    from rotapipe.plan.hostmem import lora_params
    adapters = lora_params(_TINY, 4)
    block = 4 * (128 + 96 + 96 + 128 + 3 * 192)      # rank x (in + out) of q k v o gate up down
    assert adapters == (0, block, block, 0)
    full, lora = model_work(_TINY, 8), model_work(_TINY, 8, adapters=adapters)
    proj, core = 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128), 4 * 64 * 4.5
    assert proj == 73_728
    for f, l, p in zip(full[1:-1], lora[1:-1], adapters[1:-1]):
        assert f.forward_flops == proj + core and f.backward_flops == 2 * proj + 2.5 * core
        assert l.forward_flops == proj + core + 2 * p
        assert l.backward_flops == proj + 2.5 * core + 4 * p
        assert (l.params, l.saved_bytes, l.output_bytes) == (f.params, f.saved_bytes,
                                                              f.output_bytes)
    assert (full[-1].backward_flops, lora[-1].backward_flops) == (4 * 6400, 2 * 6400)
    assert lora[-1].forward_flops == full[-1].forward_flops == 2 * 6400
    assert lora[0].forward_flops == lora[0].backward_flops == 0
    with pytest.raises(ConfigError, match="adapters has 3 entries; the model has 4 layers"):
        model_work(_TINY, 8, adapters=(0, 1, 0))


def test_lora_costs_download_only_the_adapters_gradients():
    """model_costs with adapters: times are the LoRA FLOPs at the hardware's rate, the
    weights upload as before, and each layer's weight-gradient download (``grad_ms``,
    ``dw_ms``) moves 2 bytes per adapter parameter; the simulator's DW chunks add up
    to it. Qwen3-235B-A22B LoRA rank 16 on an RTX 4090: a block's backward over 16
    microbatches falls from 322 ms (full) to 176 ms, its gradient download from 199 ms
    to 0.04 ms."""
    from rotapipe.plan import Plan
    from rotapipe.plan.hostmem import lora_params
    from rotapipe.schedule import Action, ActionKind as K
    from rotapipe.sim.timing import ActionTimes
    hw = hardware("rtx4090x8")
    adapters = lora_params("qwen3-235b-a22b", 16)
    full = model_costs("qwen3-235b-a22b", hw, seq=2048)
    lora = model_costs("qwen3-235b-a22b", hw, seq=2048, adapters=adapters)
    work = model_work("qwen3-235b-a22b", 2048, adapters=adapters)
    for f, l, w, p in zip(full.layers, lora.layers, work, adapters):
        assert l.backward_ms == pytest.approx(w.backward_flops * 2048 / hw.flops * 1e3)
        assert l.forward_ms == l.recompute_ms == pytest.approx(
            w.forward_flops * 2048 / hw.flops * 1e3)
        assert (l.upload_ms, l.weight_bytes) == (f.upload_ms, f.weight_bytes)
        assert l.grad_ms == l.dw_ms == pytest.approx(2 * p / hw.link_bytes_per_s * 1e3)
        assert f.grad_ms is None and f.dw_ms == f.upload_ms
    block, fblock = lora.layers[1], full.layers[1]
    assert 16 * fblock.backward_ms == pytest.approx(322.4, abs=0.1)
    assert 16 * block.backward_ms == pytest.approx(175.8, abs=0.1)
    assert fblock.upload_ms == pytest.approx(199.0, abs=0.1)
    assert block.dw_ms == pytest.approx(0.043, abs=0.001)
    assert lora.layers[0].dw_ms == lora.layers[-1].dw_ms == 0.0   # frozen: no adapters
    n = len(lora.layers)
    plan = Plan.from_text(f"F0[0:{n - 1}] T[{n - 1}:{n}] B0[0:{n - 1}]")
    for costs in (full, lora):
        times = ActionTimes(plan, costs)
        down = times(Action(K.DOWNLOAD_WGRAD, 0, "B0"))
        up = times(Action(K.UPLOAD_WEIGHTS, 0, "B0"))
        assert len(down) == len(up) > n         # chunked as the weights
        assert sum(down) == pytest.approx(sum(l.dw_ms for l in costs.layers[:-1]))
        assert sum(up) == pytest.approx(sum(l.upload_ms for l in costs.layers[:-1]))


def test_lora_memory_model_sizes_gradients_as_the_adapters():
    """With LoRA costs a stage's weight gradients on the device are the adapters' (2
    bytes per adapter parameter), not the frozen weights': the simulator's peak of a
    LoRA plan is lower than the same plan priced as full fine-tuning by about a stage's
    weights' gradients (115 vs 157 GB on this two-worker plan), and ``ModelCosts.frozen``
    names every layer (each holds a frozen base)."""
    from rotapipe.plan import Plan
    from rotapipe.plan.hostmem import lora_params
    from rotapipe.schedule import roundpipe_schedule
    from rotapipe.sim import simulate
    from rotapipe.sim.timing import memory_sizes
    hw = hardware("rtx4090x8")
    adapters = lora_params("qwen3-32b", 16)
    full = model_costs("qwen3-32b", hw, seq=2048)
    lora = model_costs("qwen3-32b", hw, seq=2048, adapters=adapters)
    sizes = memory_sizes(lora)
    assert memory_sizes(full).grads is None and full.frozen == ()
    assert sizes.grads == tuple(2 * p for p in adapters)
    assert lora.frozen == tuple(range(len(lora.layers)))
    n = len(lora.layers)
    plan = Plan.from_text(f"F0[0:8] F1[8:{n - 1}] T[{n - 1}:{n}] B0[0:4] B1[4:{n - 1}]")
    s = roundpipe_schedule(plan, 2, 2)
    peak = {"full": simulate(s, full).report.peak_bytes,
            "lora": simulate(s, lora).report.peak_bytes}
    assert sizes.stage_grads(plan.backward[1]) == sum(2 * p for p in adapters[4:n - 1])
    assert peak["lora"] < 0.8 * peak["full"]


def test_linear_attention_layers_cost_the_same_at_any_length():
    """Qwen3.5's Gated DeltaNet layers: the core per token does not grow with the
    sequence, the full-attention layers' does; both count their parameters exactly
    (test_full_size_configs_and_their_switches_count_exactly)."""
    cfg = transformers.AutoConfig.for_model("qwen3_5_text", num_hidden_layers=4).to_dict()
    assert cfg["layer_types"][:4] == ["linear_attention"] * 3 + ["full_attention"]
    short, long = model_work(cfg, 2048), model_work(cfg, 8192)
    assert long[1].forward_flops == short[1].forward_flops
    assert long[4].forward_flops > short[4].forward_flops
    # the linear core is a small share of the layer's projections at this width
    proj = 2 * short[1].params
    assert 0 < short[1].forward_flops - proj < 0.2 * proj


@pytest.mark.parametrize("make,match", [
    (lambda: LayerCost("b", float("nan"), 1.0, 1.0), "forward_ms=nan"),
    (lambda: LayerCost("b", 1.0, float("inf"), 1.0), "backward_ms=inf"),
    (lambda: LayerCost("b", 1.0, 1.0, 1.0, grad_ms=float("nan")), "grad_ms=nan"),
    (lambda: ModelCosts.explicit(2.5, 1.0, 2.0, head_forward_ms=1.0, head_backward_ms=1.0),
     "blocks=2.5"),
    (lambda: ModelCosts.uniform(10**7, 1.0, 2.0), "layers=10000000"),
    (lambda: model_costs("qwen3-1.7b", hardware("rtx4090x8"), seq=100.5), "seq=100.5"),
    (lambda: model_costs("qwen3-1.7b", hardware("rtx4090x8"), seq=10**12), "seq="),
    (lambda: hardware("rtx4090x1000000000"), "1,000,000,000 devices"),
    (lambda: hardware("rtx4090x8", bogus=1), "bogus=...): a Hardware has no such field"),
    (lambda: Hardware(hardware("rtx4090").device, 2.5), "Hardware.count=2.5"),
    (lambda: bound_plan(ModelCosts.uniform(6, 1.0, 2.0), 2.5, devices=2), "chunks=2.5"),
    (lambda: even_plan(6.0, 2, 2), "num_layers=6.0"),
    (lambda: roundpipe_schedule(even_plan(6, 2, 2), 2.0, 4), "workers=2.0"),
    (lambda: roundpipe_schedule(even_plan(6, 2, 2), 2, 10**6), "microbatches=1000000"),
])
def test_cost_model_and_schedule_inputs_are_checked(make, match):
    """NaN times were accepted (every step NaN), float counts were TypeErrors deep in the
    planner, and absurd sizes ran for minutes: each is a clear error naming the value."""
    with pytest.raises(rotapipe.RotapipeError, match=re.escape(match)):
        make()
