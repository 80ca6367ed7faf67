"""The ``rotapipe`` command line and the runnable example: they train, and loss falls."""

import pathlib
import re
import runpy
import subprocess
import sys

import pytest

from rotapipe.cli import main
from train_util import flags, text_jsonl

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_train_command_loss_falls(capsys, tmp_path):
    data = text_jsonl(tmp_path / "d.jsonl", 300)
    rc = main(["train", *flags(data=str(data), out_dir=str(tmp_path / "o"), steps=30,
                               eval_interval=10, sample_tokens=5)])
    out = capsys.readouterr().out
    assert rc == 0, out
    first, last = map(float, re.search(r"held-out loss ([\d.]+) -> ([\d.]+)", out).groups())
    assert last < 0.8 * first, out
    assert "2 emulated CPU workers" in out and "tokens/s" in out and "sample" in out


def test_train_command_layer_grain_bf16(capsys, tmp_path):
    data = text_jsonl(tmp_path / "d.jsonl", 200)
    rc = main(["train", *flags(data=str(data), out_dir=str(tmp_path / "o"), steps=6,
                               eval_interval=3, workers=3, grain="layer", dtype="bf16")])
    out = capsys.readouterr().out
    assert rc == 0, out
    first, last = map(float, re.search(r"held-out loss ([\d.]+) -> ([\d.]+)", out).groups())
    assert last < first, out


def test_train_command_bad_input_is_one_line_error(capsys):
    rc = main(["train", "--steps", "1", "--batch", "2", "--microbatches", "4",
               "--backend", "emulated"])
    err = capsys.readouterr().err
    assert rc == 2                     # a setting is wrong: usage
    assert "microbatches" in err and "Traceback" not in err


def test_unknown_command_exits_2():
    with pytest.raises(SystemExit) as exc:
        main(["no-such-command"])
    assert exc.value.code == 2


def test_python_dash_m_entry_point():
    out = subprocess.run([sys.executable, "-m", "rotapipe", "train", "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert "--microbatches" in out


def test_example_script_trains(capsys, monkeypatch):
    script = ROOT / "examples" / "train_tiny_transformer.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--steps", "10"])
    runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr().out
    losses = [float(v) for v in re.findall(r"loss ([\d.]+)", out)]
    assert len(losses) >= 2 and losses[-1] < losses[0], out
