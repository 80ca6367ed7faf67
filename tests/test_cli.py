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


def test_version_and_help_do_not_import_torch():
    # --version, the top-level help, train's help (every TrainConfig flag) and a flag
    # error (exit 2) are answered without loading torch or transformers.
    code = ("import sys; from rotapipe.cli import main\n"
            "for argv, code in ((['--version'], 0), (['--help'], 0), (['train', '--help'], 0),"
            " (['train', '--steps', 'x'], 2)):\n"
            "    try: main(argv)\n"
            "    except SystemExit as e: assert e.code == code, (argv, e.code)\n"
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**__import__("os").environ,
                                          "PYTHONPATH": str(ROOT / "src")})
    assert out.stdout.startswith("rotapipe 0.1.0")
    assert out.stdout.strip().endswith("False False"), out.stdout


def test_train_help_is_plain_text_with_choices(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "``" not in out
    for flag, choices in (("--dtype", "{fp32,bf16,fp16}"), ("--backend", "{auto,cuda,emulated}"),
                          ("--optimizer", "{adamw,sgd}"), ("--grain", "{stage,layer}"),
                          ("--packing", "{documents,concat,pad}"),
                          ("--optimizer-mode", "{sync,overlap,stale}")):
        assert f"{flag} {choices}" in out, flag
    assert "--eval-data" in out and "--resume-from-adapter DIR" in out


def test_dtype_typo_suggests_the_flags_own_value(capsys):
    assert main(["train", "--dtype", "bf17"]) == 2
    assert "did you mean 'bf16'?" in capsys.readouterr().err


def test_missing_hf_extras_give_the_install_hint(capsys, monkeypatch, tmp_path):
    # transformers cannot be imported: the one-line error says what to install.
    monkeypatch.setitem(sys.modules, "transformers", None)
    data = text_jsonl(tmp_path / "d.jsonl", 50)
    rc = main(["train", *flags(data=str(data), out_dir=str(tmp_path / "o"), steps=1)])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err
    assert "transformers is not installed: pip install 'rotapipe[hf]'" in err, err


def test_recipes_load_and_plan_takes_model_like_train(capsys):
    from rotapipe.cli import recipe_path
    from rotapipe.train import load_config
    full, lora = (load_config(recipe_path(n)) for n in ("full", "lora"))
    assert not full.lora and lora.lora and lora.lr == 2e-4 and full.epochs == 1
    small = ["--lora", "--global-batch", "4", "--microbatches", "4"]   # a quick plan
    assert main(["plan", "--model", "qwen3-1.7b", *small]) == 0
    by_flag = capsys.readouterr().out
    assert main(["plan", "qwen3-1.7b", *small]) == 0
    assert capsys.readouterr().out == by_flag and "LoRA" in by_flag
    assert main(["plan", "qwen3-1.7b", "--model", "qwen3-1.7b"]) == 2
