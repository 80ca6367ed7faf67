"""The fast examples run end to end and hold their own claims (each asserts what it
prints: equal losses, unchanged weights, fewer bytes), in this process: a subprocess
would spend more time importing torch than the example spends training."""

import runpy
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("name, argv, says", [
    ("reliability.py", [], "weights unchanged: True"),
    ("embedding_rows.py", [], "by rows"),
    ("optimizer_modes.py", [], "bit for bit: True"),
    ("baselines_runtime.py", ["--steps", "2"], "mobius loss"),
])
def test_example_runs(name, argv, says, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [name, *argv])
    runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    assert says in capsys.readouterr().out
