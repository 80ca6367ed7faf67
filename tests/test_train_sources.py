"""What ``rotapipe train`` reads from a data directory, and what it says about settings
that do nothing (a warmup longer than the run, a sample prompt with no tokens to
sample, the settings a resume keeps from its checkpoint)."""

from __future__ import annotations

import logging

import pytest

from rotapipe.errors import ConfigError
from rotapipe.train import TrainConfig, train
from rotapipe.train.records import source_files
from train_util import TINY, deadline, text_jsonl


def test_a_readme_beside_jsonl_shards_is_not_trained_on(tmp_path, caplog):
    """A dataset folder (JSONL shards and the README.md of its card) was read whole:
    the README trained as text. ``datasets.load_dataset`` reads the directory's most
    common format only; so does ``source_files``, naming what it leaves out. A folder
    of code keeps its .py files and leaves a lone package.json out."""
    d = tmp_path / "ds"
    d.mkdir()
    for name in ("train-0.jsonl", "train-1.jsonl"):
        text_jsonl(d / name, 5)
    (d / "README.md").write_text("# My dataset\n\nLicense: MIT\n")
    with caplog.at_level(logging.WARNING, "rotapipe.train"):
        got = source_files(str(d))
    assert [f.name for f in got] == ["train-0.jsonl", "train-1.jsonl"]
    assert "reading its 2 record files, not" in caplog.text and "README.md" in caplog.text
    code = tmp_path / "code"
    code.mkdir()
    for name in ("a.py", "b.py"):
        (code / name).write_text("def f():\n    return 1\n")
    (code / "package.json").write_text('{"name": "x"}')
    assert [f.name for f in source_files(str(code))] == ["a.py", "b.py"]


def test_batch_not_a_multiple_of_microbatches_names_the_fix():
    """``batch=4 is not a multiple of microbatches=8`` said why, not what to pass."""
    with pytest.raises(ConfigError, match="use --microbatches 4, or --batch 8$"):
        TrainConfig(batch=4, microbatches=8)
    with pytest.raises(ConfigError, match="use --microbatches 3 or 6, or --batch 8$"):
        TrainConfig(batch=6, microbatches=4)


def test_settings_that_do_nothing_are_named(tmp_path, caplog):
    """``--warmup 50 --steps 3`` trained at 1/50..3/50 of the lr and never decayed,
    and ``--sample-tokens 0 --sample-prompt x`` sampled nothing, both silently."""
    data = text_jsonl(tmp_path / "d.jsonl", 40)
    cfg = TrainConfig(**{**TINY, "data": str(data), "out_dir": str(tmp_path / "o"),
                         "steps": 3, "warmup": 50, "eval_interval": 0, "export": False,
                         "sample_prompt": "the cat", "sample_tokens": 0})
    with caplog.at_level(logging.WARNING, "rotapipe.train"), deadline(120):
        train(cfg, echo=lambda s: None)
    assert "warmup=50 is longer than the run (3 steps)" in caplog.text, caplog.text
    assert "sample_prompt='the cat' with sample_tokens=0: no sample" in caplog.text


def test_a_resume_names_the_steps_it_keeps(tmp_path):
    """A resumed run without ``--steps`` trains the checkpoint's length; its summary
    listed ``steps`` among the "from-scratch defaults" (400 is that default; the run
    had 4)."""
    data = text_jsonl(tmp_path / "d.jsonl", 40)
    common = {**TINY, "data": str(data), "out_dir": str(tmp_path / "o"),
              "eval_interval": 0, "export": False}
    with deadline(120):
        train(TrainConfig(**common, steps=4), echo=lambda s: None)
    lines = []
    with deadline(120):
        train(TrainConfig(**common, resume=True), echo=lines.append)
    settings = next(x for x in lines if x.startswith("settings:"))
    assert "4 steps" in settings and "defaults: weight decay;" in settings, settings
    assert settings.endswith("; the checkpoint's: steps"), settings
