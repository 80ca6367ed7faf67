"""Checkpoints: exact resume after SIGKILL, SIGINT saves and exits 0, crash-safe writes,
and a checkpoint from a different model is refused before training."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from safetensors.torch import load_file

from rotapipe.train import latest_checkpoint, load_checkpoint
from train_util import env, flags, popen, run_here, text_jsonl

N = 6


def _wait_for(path, proc, timeout=60.0):
    end = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > end:
            out = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"{path} never appeared (rc={proc.returncode}):\n{out}")
        time.sleep(0.01)


def _masters(out):
    return load_file(str(latest_checkpoint(out / "checkpoints") / "masters.safetensors"))


@pytest.mark.parametrize("mode", ["sync", "stale"])
def test_resume_after_sigkill_is_bit_identical(tmp_path, mode):
    """``stale``: pipelined calls; the checkpoint drains them (and makes the weights
    current), so the resumed run continues as the uninterrupted one did."""
    data = text_jsonl(tmp_path / "d.jsonl", 400)
    common = dict(data=str(data), steps=2 * N, save_interval=N, eval_interval=4, lr=5e-3,
                  optimizer_mode=mode)
    straight = run_here(flags(out_dir=str(tmp_path / "a"), **common))   # the reference
    assert straight.returncode == 0, straight.stdout + straight.stderr
    # Train again in a process of its own, SIGKILL at a random moment after the step-N
    # checkpoint is complete; resume here.
    proc = popen(flags(out_dir=str(tmp_path / "b"), **common))
    _wait_for(tmp_path / "b" / "checkpoints" / f"step-{N:08d}", proc)
    metrics = [json.loads(l) for l in (tmp_path / "a" / "metrics.jsonl").read_text()
               .splitlines()]
    second_half = metrics[-1]["elapsed_s"] - next(m["elapsed_s"] for m in metrics
                                                  if m["step"] == N)
    time.sleep(random.uniform(0, 0.8 * second_half))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resumed = run_here(flags(out_dir=str(tmp_path / "b"), resume=True, **common))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    a, b = _masters(tmp_path / "a"), _masters(tmp_path / "b")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # The exported models match too, and the metrics file has each step once.
    fa = load_file(str(tmp_path / "a" / "final" / "model.safetensors"))
    fb = load_file(str(tmp_path / "b" / "final" / "model.safetensors"))
    assert all(torch.equal(fa[k], fb[k]) for k in fa)
    steps = [json.loads(l)["step"] for l in (tmp_path / "b" / "metrics.jsonl").read_text()
             .splitlines()]
    assert steps == list(range(0, 2 * N + 1))


def test_sigint_finishes_the_step_saves_and_exits_0(tmp_path):
    data = text_jsonl(tmp_path / "d.jsonl", 400)
    proc = popen(flags(data=str(data), out_dir=str(tmp_path / "o"), steps=10_000,
                       save_interval=2, eval_interval=0))
    _wait_for(tmp_path / "o" / "checkpoints" / f"step-{2:08d}", proc)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    last = latest_checkpoint(tmp_path / "o" / "checkpoints")
    step = load_checkpoint(last)[2]["step"]
    assert f"stopped at step {step}" in out and "--resume" in out
    lines = (tmp_path / "o" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["step"] == step       # the step in flight was finished


WRITER = textwrap.dedent("""
    import pathlib, sys, torch
    from rotapipe.train.checkpoint import save_checkpoint
    d = pathlib.Path(sys.argv[1])
    for step in range(1, 10_000):
        g = torch.Generator().manual_seed(step)
        masters = {"w": torch.randn(512, 1024, generator=g)}
        state = {"step": step, "opt": {"m": torch.full((256, 1024), float(step))}}
        save_checkpoint(d, step, masters=masters, state=state, meta={"step": step}, keep=2)
        print(step, flush=True)
""")


def test_sigkill_during_checkpoint_writes_leaves_a_complete_checkpoint(tmp_path):
    """SIGKILL a process that does nothing but write checkpoints (so the kill lands in
    a write), 4 times at random moments; the latest complete checkpoint always loads and
    holds the data of its step. benchmarks/checkpoint_crash.py does this 20 times on
    real training runs and resumes each."""
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    d = tmp_path / "ck"
    rnd = random.Random(0)
    for trial in range(4):
        proc = subprocess.Popen([sys.executable, str(script), str(d)], env=env(),
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline()              # at least one save done (or resumed)
        time.sleep(rnd.uniform(0.0, 0.4))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        last = latest_checkpoint(d)
        masters, state, meta = load_checkpoint(last)
        step = meta["step"]
        assert state["step"] == step and last.name == f"step-{step:08d}"
        g = torch.Generator().manual_seed(step)
        assert torch.equal(masters["w"], torch.randn(512, 1024, generator=g))
        assert torch.equal(state["opt"]["m"], torch.full((256, 1024), float(step)))


def test_checkpoint_from_a_different_model_is_refused(tmp_path, capsys):
    """In this process (``rotapipe.cli.main``: the exit code and stderr a shell sees;
    the commands above run as processes)."""
    from rotapipe.cli import main
    data = text_jsonl(tmp_path / "d.jsonl", 200)
    out = str(tmp_path / "o")
    assert main(["train", *flags(data=str(data), out_dir=out, steps=2, eval_interval=0)]) == 0
    capsys.readouterr()
    rc = main(["train", *flags(data=str(data), out_dir=out, steps=4, dim=48, resume=True)])
    err = capsys.readouterr().err.strip()
    assert rc == 2                   # a setting is wrong: usage
    assert len(err.splitlines()) == 1 and "dim=32" in err and "--dim 32" in err, err
    # Fresh run into a directory that holds checkpoints: refused, with the fix.
    rc = main(["train", *flags(data=str(data), out_dir=out, steps=2)])
    assert rc == 2 and "--resume" in capsys.readouterr().err


def test_resumed_summary_counts_this_runs_tokens(tmp_path):
    """The closing line of a resumed run divides the tokens *it* trained on by its own
    training time (not every token since step 0)."""
    from rotapipe.train import TrainConfig, train
    from train_util import TINY
    data = text_jsonl(tmp_path / "d.jsonl", 120)
    common = dict(**TINY, data=str(data), out_dir=str(tmp_path / "o"), eval_interval=2)
    train(TrainConfig(**common, steps=4), echo=lambda s: None)
    lines = []
    result = train(TrainConfig(**common, steps=6, resume=True), echo=lines.append)
    per_step = TINY["batch"] * TINY["seq"]
    assert result.tokens == 6 * per_step                        # the run's total
    summary = next(line for line in lines if line.startswith("held-out loss"))
    assert f" {2 * per_step} tokens, " in summary and "over steps 0..6" in summary, summary


def test_a_stop_after_resuming_names_the_checkpoint_it_resumed_from(tmp_path, monkeypatch):
    """Until a resumed run saves, the checkpoint to go back to is the one it resumed
    from (it said "None"); a fresh run with none says so."""
    import rotapipe
    from rotapipe.train import TrainConfig, loop, train
    from train_util import TINY, deadline
    data = text_jsonl(tmp_path / "d.jsonl", 100)
    common = {**TINY, "data": str(data), "eval_interval": 0, "export": False}
    with deadline(120):
        train(TrainConfig(**common, out_dir=str(tmp_path / "o"), steps=2))
    real = loop._Job.train_step

    def poisoned(job):                 # a step that leaves a weight NaN
        record = real(job)
        job.pipe.flush()
        with torch.no_grad():
            next(iter(job.pipe.parameters())).view(-1)[0] = float("nan")
        return record
    monkeypatch.setattr(loop._Job, "train_step", poisoned)
    resumed = tmp_path / "o" / "checkpoints" / "step-00000002"
    with deadline(120), pytest.raises(rotapipe.NonFiniteError) as info:
        train(TrainConfig(**common, out_dir=str(tmp_path / "o"), steps=4, save_interval=1,
                          resume=True))
    assert "not finite at step 3 " in str(info.value)
    assert f"no checkpoint written; the last one is {resumed}. Lower --lr or check the " \
           "data, and resume from it" in str(info.value)
    with deadline(120), pytest.raises(rotapipe.NonFiniteError,
                                      match=r"not finite at step 1 .*there is no checkpoint to "
                                            r"go back to\. Lower --lr or check the data, and "
                                            r"start again"):
        train(TrainConfig(**common, out_dir=str(tmp_path / "fresh"), steps=2,
                          save_interval=1))


def test_a_resume_trains_with_its_own_lr_weight_decay_and_betas(tmp_path):
    """Loading the optimizer's and the scheduler's state brought back the checkpoint's
    lr, weight decay and betas while the run printed the new ones; the new ones apply,
    at the schedule's position, and an unchanged resume keeps its learning rate."""
    from rotapipe.train import TrainConfig, train
    from rotapipe.train.loop import lr_factor
    from train_util import TINY, deadline
    data = text_jsonl(tmp_path / "d.jsonl", 100)
    common = {**TINY, "data": str(data), "eval_interval": 0, "export": False,
              "save_interval": 2, "out_dir": str(tmp_path / "o")}
    with deadline(120):
        train(TrainConfig(**common, steps=2))
    saved = torch.load(latest_checkpoint(tmp_path / "o" / "checkpoints") / "state.pt",
                       weights_only=False)
    cfg = TrainConfig(**{**common, "lr": 0.05}, steps=4, resume=True, weight_decay=0.3,
                      beta2=0.5)
    with deadline(120):
        train(cfg, echo=lambda s: None)
    state = torch.load(latest_checkpoint(tmp_path / "o" / "checkpoints") / "state.pt",
                       weights_only=False)
    group = state["optimizer"]["param_groups"][0]
    assert state["scheduler"]["base_lrs"] == [0.05] and group["initial_lr"] == 0.05
    assert group["weight_decay"] == 0.3 and tuple(group["betas"]) == (cfg.beta1, 0.5)
    assert group["lr"] == pytest.approx(0.05 * lr_factor(cfg)(4), rel=1e-12)
    old = saved["optimizer"]["param_groups"][0]
    assert old["initial_lr"] == TINY["lr"] and old["weight_decay"] != 0.3


def test_a_lora_resume_on_other_base_weights_is_refused(tmp_path, caplog):
    """A LoRA checkpoint holds the adapter alone; the frozen base comes from the model
    directory. Other weights under the same ``--model`` (files replaced, a hub cache on
    a new revision) resumed silently onto another model (held-out loss 3.531 for the
    uninterrupted run's 3.477 here); now refused, naming the file. Without LoRA every
    weight is in the checkpoint: a warning."""
    pytest.importorskip("peft")
    from rotapipe.errors import ConfigError
    from rotapipe.train import TrainConfig, train
    from train_util import chat_tokenizer, sft_jsonl, tiny_model_dir
    model = tiny_model_dir(tmp_path / "m", chat_tokenizer(), seed=0)
    common = dict(seq=48, batch=4, microbatches=2, workers=2, backend="emulated",
                  progress=False, model=str(model), data=str(sft_jsonl(tmp_path / "s.jsonl",
                                                                       60)),
                  holdout=0, lr=1e-2, warmup=1, export=False)
    for lora in (True, False):
        train(TrainConfig(**common, lora=lora, lora_rank=4, steps=1,
                          out_dir=str(tmp_path / f"o{lora}")), echo=lambda s: None)
    tiny_model_dir(model, chat_tokenizer(), seed=1)          # the base changes under them
    with pytest.raises(ConfigError, match=r"model files differ .*changed: "
                                          r"model\.safetensors.*LoRA adapter alone"):
        train(TrainConfig(**common, lora=True, lora_rank=4, steps=2, resume=True,
                          out_dir=str(tmp_path / "oTrue")), echo=lambda s: None)
    with caplog.at_level("WARNING", logger="rotapipe.train"):
        done = train(TrainConfig(**common, lora_rank=4, steps=2, resume=True,
                                 out_dir=str(tmp_path / "oFalse")), echo=lambda s: None)
    assert done.step == 2 and "model files differ" in caplog.text


def test_checkpoint_helpers_take_a_str_path(tmp_path):
    """The documented helpers took only a pathlib.Path: a str (as the docs' own
    ``ckpt_dir = "/shared/ckpt"`` would pass) was a bare AttributeError."""
    from rotapipe.train.checkpoint import (list_checkpoints, load_shards, save_checkpoint,
                                           save_shard)
    root = str(tmp_path / "ckpt")
    masters = {"w": torch.arange(6.0).reshape(2, 3)}
    path = save_checkpoint(root, 3, masters=masters, state={}, meta={"step": 3})
    assert list_checkpoints(root) == [path] and latest_checkpoint(root) == path
    got, _, meta = load_checkpoint(str(path))
    assert torch.equal(got["w"], masters["w"]) and meta["step"] == 3
    save_shard(str(tmp_path / "shards"), {"rank": 0, "world": 1, "pieces": {}})
    assert [s["rank"] for s in load_shards(str(tmp_path / "shards"))] == [0]
