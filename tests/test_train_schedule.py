"""The end of a training run's schedule and its evaluation: the learning rate reaches
``lr * min_lr_ratio`` at the last step, the held-out loss, computed in row chunks,
equals plain PyTorch's, and a sample prompt that fills the context is refused before
training."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rotapipe.train import TrainConfig
from rotapipe.train.loop import lr_factor
from train_util import TINY, deadline, text_jsonl

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("steps,warmup", [(24, 2), (5, 0), (8, 1), (3, 3), (1, 0)])
def test_lr_reaches_its_floor_at_the_last_step(steps, warmup):
    """The cosine ran until step ``steps`` (one past the last optimizer step, as
    transformers' schedule does): the last step trained at 0.1046 of the lr at 24
    steps, not the documented ``min_lr_ratio`` 0.1. The warmup's last step is the
    peak, the last step is the floor, and the factor never rises after the peak."""
    f = lr_factor(TrainConfig(**{**TINY, "steps": steps, "warmup": warmup}).effective())
    factors = [f(k) for k in range(steps)]
    peak = max(warmup - 1, 0)
    assert factors[peak] == 1.0
    if steps - 1 > peak:
        assert factors[-1] == pytest.approx(0.1, abs=1e-12)
    assert all(a >= b for a, b in zip(factors[peak:], factors[peak + 1:]))
    assert factors[:warmup] == [(k + 1) / warmup for k in range(warmup)]


def test_a_run_trains_its_last_step_at_the_floor(tmp_path):
    """The metrics' last ``lr`` is ``lr * min_lr_ratio`` (it was 1.5% above it)."""
    import json
    from rotapipe.train import train
    data = text_jsonl(tmp_path / "d.jsonl", 40)
    cfg = TrainConfig(**{**TINY, "data": str(data), "out_dir": str(tmp_path / "o"),
                         "steps": 6, "eval_interval": 0, "export": False,
                         "min_lr_ratio": 0.25})
    with deadline(120):
        train(cfg, echo=lambda s: None)
    rows = [json.loads(x) for x in (tmp_path / "o" / "metrics.jsonl").read_text().split("\n")
            if x]
    assert rows[-1]["step"] == 6
    assert rows[-1]["lr"] == pytest.approx(TINY["lr"] * 0.25, rel=1e-12)


def _model(vocab: int, seed: int = 0):
    torch.manual_seed(seed)
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=64, tie_word_embeddings=False)).float()


def test_evaluation_runs_in_row_chunks_and_equals_plain_pytorch(monkeypatch):
    """``evaluate`` built every held-out logit in one call, then an fp32 copy and a
    log-softmax of all of them (4x the logits: 18 GiB for Qwen3 at 64 sequences of 128
    tokens). It now runs the rows in chunks of at most ``EVAL_LOGITS`` logits: with a
    budget of 2 rows, every pipeline call sees at most 2 rows, and the loss equals
    plain PyTorch's mean cross-entropy over the counted tokens (padded rows, ignored
    labels)."""
    import rotapipe
    from rotapipe.adapters import wrap_hf
    from rotapipe.train import job
    vocab, seq, n = 40, 12, 7
    model = _model(vocab)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (n, seq), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100                                 # prompts
    labels[5, 8:] = -100                                 # a padded row
    mask = torch.ones_like(ids)
    mask[5, 8:] = 0
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    want = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                           ignore_index=-100)
    monkeypatch.setattr(job, "EVAL_LOGITS", 2 * seq * vocab, raising=False)
    wrapped = wrap_hf(model)
    seen = []
    with wrapped.pipe(rotapipe.PipeConfig(workers=2, microbatches=2,
                                          backend="emulated")) as pipe:
        real = type(pipe).__call__

        def counting(self, inputs):
            seen.append(inputs["input_ids"].shape[0])
            return real(self, inputs)
        monkeypatch.setattr(type(pipe), "__call__", counting)
        got = job.evaluate(pipe, wrapped, job.Batch(ids, labels, attention_mask=mask))
    assert seen == [2, 2, 2, 1]
    assert got == pytest.approx(want.item(), rel=1e-5, abs=1e-6)


def test_a_sample_prompt_filling_the_context_is_refused_before_training(tmp_path):
    """``check_prompts`` existed but was not called: a sample prompt as long as the
    model's context (``seq`` = 32 positions from scratch) trained the whole run, then
    failed at the end's sample. Now the run is refused before its first step."""
    from train_util import run_here, flags
    data = text_jsonl(tmp_path / "d.jsonl", 40)
    out = tmp_path / "o"
    prompt = " ".join(["the cat sat"] * 20)
    with deadline(120):
        r = run_here(flags(data=str(data), out_dir=str(out), steps=3, sample_tokens=4,
                           sample_prompt=prompt, eval_interval=0, export=False))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "model's context holds 32 (max_position_embeddings)" in r.stderr, r.stderr
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()
