"""What ends a training run and what it says about its data: ``steps`` and ``epochs``
together (the schedule, the last evaluation, exact resume), empty records skipped and
counted, data too small for the batch refused before the model is built."""

from __future__ import annotations

import json
import signal

import pytest
import torch
from safetensors.torch import load_file

from rotapipe.train import TrainConfig, latest_checkpoint, train
from rotapipe.train.loop import lr_factor
from train_util import TINY, deadline, run_here, flags, text_jsonl


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_epochs_before_steps_end_the_run_with_its_schedule_and_evaluation(tmp_path):
    """``--steps 50 --epochs 1`` on data of about 24 steps an epoch ended at the epoch
    with no last evaluation, its cosine schedule (50 steps long) barely decayed (lr
    4.9e-3 of 1e-2 at step 29). Now the run is as long as the first limit: the schedule
    decays over those steps, the last evaluation is at the last step, and a note says
    which limit ends the run."""
    data = text_jsonl(tmp_path / "d.jsonl", 60)
    lines = []
    cfg = TrainConfig(**{**TINY, "data": str(data), "out_dir": str(tmp_path / "o"),
                         "steps": 50, "epochs": 1, "eval_interval": 25, "export": False})
    with deadline(120):
        result = train(cfg, echo=lines.append)
    n = result.step
    assert 5 < n < 50
    rows = _metrics(tmp_path / "o")
    assert rows[-1]["step"] == n and "eval_loss" in rows[-1], rows[-1]
    # The schedule's length is the run's: the last step's lr is the cosine's end.
    factor = lr_factor(TrainConfig(**{**TINY, "steps": n}).effective())
    assert rows[-1]["lr"] == pytest.approx(TINY["lr"] * factor(n - 1), rel=1e-9)
    assert rows[-1]["lr"] < 0.15 * TINY["lr"]
    settings = next(line for line in lines if line.startswith("settings:"))
    assert f"{n} steps (1 epoch)" in settings, settings
    assert any(line.startswith(f"note: epochs=1 ends the run at step {n}, before steps=50 "
                               "(1 pass over the training split") for line in lines), lines
    summary = next(line for line in lines if line.startswith("held-out loss"))
    assert f"over steps 0..{n};" in summary and "not evaluated" not in summary, summary


def test_epochs_before_steps_resume_exactly(tmp_path, monkeypatch):
    """A run with both limits stopped by Ctrl-C and resumed ends at the weights of the
    uninterrupted run: the resumed run counts the same epoch length."""
    from rotapipe.train import loop
    data = text_jsonl(tmp_path / "d.jsonl", 60)
    common = {**TINY, "data": str(data), "steps": 50, "epochs": 1, "eval_interval": 5,
              "export": False, "save_interval": 0}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with deadline(120):
            straight = train(TrainConfig(**common, out_dir=str(tmp_path / "a")),
                             echo=lambda s: None)
        real = loop._Job.train_step

        def ctrl_c_at_step_4(job):
            record = real(job)
            if record["step"] == 4:
                signal.raise_signal(signal.SIGINT)      # as Ctrl-C: finish, save, return
            return record
        monkeypatch.setattr(loop._Job, "train_step", ctrl_c_at_step_4)
        with deadline(120):
            stopped = train(TrainConfig(**common, out_dir=str(tmp_path / "b")),
                            echo=lambda s: None)
        monkeypatch.setattr(loop._Job, "train_step", real)
        assert stopped.interrupted and stopped.step == 4
        with deadline(120):
            resumed = train(TrainConfig(**common, out_dir=str(tmp_path / "b"), resume=True),
                            echo=lambda s: None)
    finally:
        torch.set_num_threads(threads)
    assert resumed.step == straight.step < 50
    a, b = (load_file(str(latest_checkpoint(tmp_path / d / "checkpoints")
                          / "masters.safetensors")) for d in "ab")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [r["step"] for r in _metrics(tmp_path / "b")] == \
        [r["step"] for r in _metrics(tmp_path / "a")]


def test_empty_records_are_counted_where_skipped_sequences_are(tmp_path):
    """Records with a blank text trained on their begin and end tokens alone, silently;
    now skipped, and the run's closing lines say how many and where the first is."""
    data = text_jsonl(tmp_path / "d.jsonl", 120)
    lines = data.read_text().splitlines()
    for k in (3, 10, 50):
        lines[k] = json.dumps({"text": ""})
    data.write_text("\n".join(lines) + "\n")
    said = []
    with deadline(120):
        train(TrainConfig(**{**TINY, "data": str(data), "out_dir": str(tmp_path / "o"),
                             "steps": 2, "eval_interval": 0, "export": False}),
              echo=said.append)
    assert f"skipped 3 empty records of the data (the first at {data}:4): a blank 'text' " \
           "or response has nothing to learn but the end-of-text token" in said, said


def test_an_empty_training_split_fails_before_the_model_is_built(tmp_path, monkeypatch):
    """A training split with no record (every one held out) is a usage error before
    the tokenizer and the model, naming the cause. (6 records and a batch of 16 were
    refused too, when each row packed its own hash-chosen share: the rows now draw
    from one shared order, and such data trains.)"""
    from rotapipe.train import loop

    def no_model(*args, **kwargs):
        raise AssertionError("the model was built")
    monkeypatch.setattr(loop, "build_model", no_model)
    monkeypatch.setattr(loop, "build_tokenizer", no_model)
    data = text_jsonl(tmp_path / "d.jsonl", 6)
    p = run_here(flags(data=str(data), out_dir=str(tmp_path / "o"), batch=16,
                       microbatches=4, holdout=0.999))
    assert p.returncode == 2, p.stdout + p.stderr
    err = p.stderr.strip()
    assert err == ("rotapipe train: error: the training split is empty: each of the 6 "
                   "records of the data is held out (holdout=0.999) or empty: lower --holdout "
                   "(--holdout 0 trains on every record), or add data"), err


def test_held_out_records_that_are_never_evaluated_are_named(tmp_path, monkeypatch):
    """``holdout`` keeps records out of training for evaluation; with ``eval_data`` (which
    is evaluated instead) or ``eval_interval=0`` they were dropped silently: the run's
    summary now says so, and how to train on them."""
    from rotapipe.train import loop

    class Summarised(Exception):
        pass

    def stop(job):                   # the summary is written: no need to train
        raise Summarised
    monkeypatch.setattr(loop, "_loop", stop)
    data = text_jsonl(tmp_path / "d.jsonl", 60)
    said = {}
    for name, settings in {"never": dict(eval_interval=0),
                           "eval_data": dict(eval_data=str(data), eval_interval=1),
                           "used": dict(eval_interval=1)}.items():
        lines = []
        with deadline(120), pytest.raises(Summarised):
            train(TrainConfig(**{**TINY, "data": str(data), "out_dir": str(tmp_path / name),
                                 "tokenizer_bytes": 3000, **settings}), echo=lines.append)
        said[name] = [line for line in lines if line.startswith("note: holdout=")]
    assert said["never"] == ["note: holdout=0.15 keeps that share of the records of data out "
                             "of training, and eval_interval=0 never evaluates: they are not "
                             "used at all (--holdout 0 trains on them)"]
    assert "eval_data is evaluated instead of them" in said["eval_data"][0]
    assert said["used"] == []


def test_a_resume_with_more_epochs_trains_them(tmp_path):
    """A run that ended after its one epoch, resumed with ``epochs=2``, kept the saved
    run's counted length: it said "7 steps (2 epochs)" and trained no step (the first
    run had ended at step 7). Now the length is counted for the epochs asked for, as a
    new run's."""
    from rotapipe.train.data import TextFields
    from rotapipe.train.setup import epoch_steps
    data = text_jsonl(tmp_path / "d.jsonl", 24)
    common = {**TINY, "data": str(data), "out_dir": str(tmp_path / "o"), "epochs": 1,
              "eval_interval": 0, "export": False, "tokenizer_bytes": 3000}
    with deadline(120):
        first = train(TrainConfig(**common), echo=lambda s: None)
    said = []
    with deadline(120):
        more = train(TrainConfig(**{**common, "epochs": 2, "resume": True}),
                     echo=said.append)
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(
        latest_checkpoint(tmp_path / "o" / "checkpoints") / "tokenizer")
    two = epoch_steps(TrainConfig(**{**common, "epochs": 2}), [data], tok, TextFields())
    assert first.step < two and more.start_step == first.step and more.step == two
    assert any(f"{two} steps (2 epochs)" in line for line in said), said


def test_a_resume_without_steps_continues_the_saved_length(tmp_path, monkeypatch):
    """``--steps 8`` from scratch, stopped at step 3 and resumed without ``--steps``
    (as the stop line says: "continue with --resume"), trained on to the default 400
    steps on a 400-step cosine. Now it ends at step 8 on the saved run's schedule."""
    from rotapipe.train import loop
    data = text_jsonl(tmp_path / "d.jsonl", 60)
    common = {**TINY, "data": str(data), "out_dir": str(tmp_path / "o"), "export": False,
              "eval_interval": 0, "save_interval": 0, "tokenizer_bytes": 3000}
    real = loop._Job.train_step

    def ctrl_c_at_step_3(job):
        record = real(job)
        if record["step"] == 3:
            signal.raise_signal(signal.SIGINT)          # as Ctrl-C: finish, save, return
        return record
    monkeypatch.setattr(loop._Job, "train_step", ctrl_c_at_step_3)
    with deadline(120):
        assert train(TrainConfig(**common, steps=8), echo=lambda s: None).step == 3
    monkeypatch.setattr(loop._Job, "train_step", real)
    with deadline(120):
        done = train(TrainConfig(**common, resume=True), echo=lambda s: None)
    assert done.step == 8
    rows = _metrics(tmp_path / "o")
    factor = lr_factor(TrainConfig(**{**TINY, "steps": 8}).effective())
    assert [r["lr"] for r in rows] == pytest.approx([TINY["lr"] * factor(k) for k in range(8)],
                                                    rel=1e-12)
