"""Hardware profiles and the per-layer cost model from Hugging Face configs (arithmetic,
checked against transformers models built on the meta device: no weights)."""

import json
import pathlib

import pytest
import torch

import rotapipe
from rotapipe import ConfigError
from rotapipe.plan import (DEVICES, Hardware, LayerCost, ModelCosts, hardware, load_config,
                           model_costs, model_work)
from rotapipe.plan.costs import KNOWN_MODELS

transformers = pytest.importorskip("transformers")


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
    with pytest.raises(ConfigError, match="forward_ms must be >= 0"):
        LayerCost("x", -1.0, 1.0, 1.0)
    with pytest.raises(ConfigError, match="at least one layer"):
        ModelCosts((), 1)
