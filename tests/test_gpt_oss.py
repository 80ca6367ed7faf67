"""GPT-OSS-20B end to end: its shipped config prices per layer (MoE blocks, attention
sinks, sliding windows) for ``rotapipe plan`` and ``simulate``; the adapter trains a tiny
GPT-OSS exactly (``test_hf_families.py``); and MoE recompute issues no host sync per
expert (counted on the emulated backend)."""

from __future__ import annotations

import json
import logging
import threading

import pytest
import torch

from rotapipe.adapters import layers as adapter_layers
from rotapipe.adapters import wrap_hf
from rotapipe.cli import main
from rotapipe.plan import load_config, model_work
from rotapipe.plan.costs import KNOWN_MODELS
from rotapipe.runtime.syncs import HostSyncCounter
from hf_models import batch, pipe_backward, tiny, transformers


def test_config_ships_and_counts_20b_parameters():
    assert "gpt-oss-20b" in KNOWN_MODELS
    cfg = load_config("gpt-oss-20b")
    assert cfg["model_type"] == "gpt_oss" and cfg["num_local_experts"] == 32
    work = model_work(cfg, 2048)
    assert len(work) == 24 + 2
    with torch.device("meta"):
        model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**cfg))
    assert sum(w.params for w in work) == sum(p.numel() for p in model.parameters())
    assert sum(w.params for w in work) == pytest.approx(20.91e9, rel=1e-3)
    # Active parameters (4 of 32 experts, embedding not counted): 2 FLOPs each per token.
    assert sum(w.forward_flops for w in model_work(cfg, 1)) / 2 == pytest.approx(3.6e9,
                                                                                  rel=0.02)


def test_sinks_and_sliding_windows_are_priced():
    cfg = load_config("gpt-oss-20b")
    sliding, full = model_work(cfg, 8192)[1:3]
    assert sliding.params == full.params                       # sinks: 64 per block
    q = 64 * 64
    attended_full, attended_window = (8192 + 1) / 2, (128 * 129 / 2 + (8192 - 128) * 128) / 8192
    assert full.forward_flops - sliding.forward_flops == pytest.approx(
        4 * q * (attended_full - attended_window))
    # At 128 tokens the window covers the sequence: the two layer kinds cost the same.
    a, b = model_work(cfg, 128)[1:3]
    assert a.forward_flops == b.forward_flops


def test_plan_and_simulate_answer(capsys):
    assert main(["plan", "gpt-oss-20b", "--microbatches", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] and out["tokens_per_s"] > 0
    # The paper's longest GPT-OSS-20B sequence on 8x 4090: one sequence of 39,936 tokens.
    main(["plan", "gpt-oss-20b", "--hardware", "rtx4090x8", "--seq", "39936",
          "--global-batch", "1"])
    assert "39936 tokens" in capsys.readouterr().out
    assert main(["simulate", "--model", "gpt-oss-20b", "--schedules", "roundpipe-exact",
                 "--microbatches", "8"]) == 0
    assert "gpt-oss-20b on rtx4090x8" in capsys.readouterr().out


def _syncs_per_layer(family: str, experts: str, monkeypatch) -> dict:
    """Host syncs of each decoder layer, per run kind (forward without autograd, and
    recompute with it), counted inside the emulated workers' threads."""
    seen: dict[tuple[bool, int], set] = {}
    lock = threading.Lock()
    forward = adapter_layers.DecoderLayer.forward

    def counted(self, x, **side):
        with HostSyncCounter() as counter:      # modes are per thread: count in the worker
            out = forward(self, x, **side)
        with lock:
            seen.setdefault((torch.is_grad_enabled(), self.index), set()).add(counter.total)
        return out
    monkeypatch.setattr(adapter_layers.DecoderLayer, "forward", counted)
    model = tiny(family)
    model.set_experts_implementation(experts)
    pipe_backward(model, *batch(), 2, 4)
    return seen


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3moe", "qwen2moe", "deepseek_v3"])
def test_moe_recompute_does_not_sync_per_expert(family, monkeypatch):
    seen = _syncs_per_layer(family, "grouped_mm", monkeypatch)
    recompute = {layer: n for (grad, layer), n in seen.items() if grad}
    assert sorted(recompute) == [0, 1, 2]                  # every block was recomputed
    assert all(n == {0} for n in seen.values()), seen       # forward and recompute: none


def test_eager_experts_sync_per_expert_and_are_flagged(monkeypatch, caplog):
    """The counter sees what the eager experts loop costs (so the zero above is real)."""
    seen = _syncs_per_layer("gpt_oss", "eager", monkeypatch)
    # 4 experts, all hit: a nonzero for the hit list, then per expert a nonzero and
    # the tensor-valued indexing and comparisons of the loop.
    assert all(min(n) >= 1 + 4 * 2 for n in seen.values()), seen
    model = tiny("gpt_oss")
    model.set_experts_implementation("eager")
    with caplog.at_level(logging.WARNING, logger="rotapipe.adapters.moe"):
        wrap_hf(model)
    assert "set_experts_implementation('grouped_mm')" in caplog.text
