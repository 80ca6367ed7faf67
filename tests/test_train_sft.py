"""JSONL prompt/response fine-tuning: the loss on response tokens falls; the final model
exports in Hugging Face format (full and LoRA) and reloads with plain transformers."""

from __future__ import annotations

import pathlib

import pytest
import torch

from rotapipe.train import TrainConfig, train
from train_util import TINY, sft_jsonl

transformers = pytest.importorskip("transformers")


def test_sft_response_loss_falls_and_model_exports(tmp_path):
    data = sft_jsonl(tmp_path / "sft.jsonl", 400)
    cfg = TrainConfig(**{**TINY, "seq": 64, "batch": 8, "eval_sequences": 8, "lr": 1e-2,
                         "sample_tokens": 8}, data=str(data), out_dir=str(tmp_path / "o"),
                      steps=60, eval_interval=20, sample_prompt="reverse:")
    lines = []
    result = train(cfg, echo=lines.append)
    # Held-out loss counts response tokens only (prompts are -100).
    assert result.eval_last < 0.7 * result.eval_first, lines
    assert result.sample and result.sample.startswith("reverse:")
    final = tmp_path / "o" / "final"
    model = transformers.AutoModelForCausalLM.from_pretrained(final)
    tok = transformers.AutoTokenizer.from_pretrained(final)
    ids = torch.tensor([tok.encode("reverse: cat dog =>")])
    assert model(ids).logits.shape[-1] == len(tok)


def test_lora_exports_an_adapter(tmp_path):
    peft = pytest.importorskip("peft")
    # A base model directory to fine-tune: a tiny Qwen3 + tokenizer saved by a first run.
    data = sft_jsonl(tmp_path / "sft.jsonl", 200)
    base = TrainConfig(**TINY, data=str(data), out_dir=str(tmp_path / "base"), steps=2,
                       eval_interval=0)
    train(base, echo=lambda s: None)
    cfg = TrainConfig(**{**TINY, "lr": 5e-3}, model=str(tmp_path / "base" / "final"),
                      data=str(data), out_dir=str(tmp_path / "lora"), steps=4,
                      eval_interval=2, lora=True, lora_rank=4)
    result = train(cfg, echo=lambda s: None)
    adapter = tmp_path / "lora" / "final"
    assert (adapter / "adapter_config.json").is_file()
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base" / "final")
    loaded = peft.PeftModel.from_pretrained(model, adapter)
    assert result.step == 4 and any("lora_" in n for n, _ in loaded.named_parameters())


def _losses(out: pathlib.Path) -> list[tuple[float, float]]:
    import json
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["loss"], r["grad_norm"]) for r in rows if "loss" in r and "grad_norm" in r]


def test_optimizer_modes_in_the_training_job(tmp_path):
    from train_util import text_jsonl
    data = text_jsonl(tmp_path / "t.jsonl", 120)
    runs = {}
    for mode in ("sync", "overlap", "stale"):
        cfg = TrainConfig(**TINY, data=str(data), out_dir=str(tmp_path / mode), steps=6,
                          eval_interval=0, optimizer_mode=mode, save_interval=3)
        train(cfg, echo=lambda s: None)
        runs[mode] = _losses(tmp_path / mode)
        assert len(runs[mode]) == 6
    # overlap is exact: the same losses and (clipped) gradient norms as sync.
    assert runs["overlap"] == runs["sync"]
    # stale: the first two calls run on the initial weights (the first step is applied
    # during the second call), then it trails sync.
    assert runs["stale"][0][0] == runs["sync"][0][0]
    assert runs["stale"][1][0] != runs["sync"][1][0]
    assert runs["stale"][2][0] != runs["sync"][2][0]
