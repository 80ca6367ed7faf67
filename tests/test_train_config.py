"""TrainConfig from files and flags; every setup error is one line, before training."""

from __future__ import annotations

import dataclasses
import re

import pytest

from rotapipe.cli import main
from rotapipe.errors import ConfigError
from rotapipe.train import TrainConfig, load_config
from rotapipe.train.settings import field_docs
from train_util import flags, text_jsonl

transformers = pytest.importorskip("transformers")


def test_every_field_has_a_docstring_and_a_flag(capsys):
    from dataclasses import fields
    docs = field_docs()
    assert all(docs.get(f.name) for f in fields(TrainConfig))
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert all("--" + f.name.replace("_", "-") in out for f in fields(TrainConfig))


def test_file_then_flags(tmp_path):
    (tmp_path / "a.toml").write_text('lr = 0.01\nsteps = 7\ndata = "x.jsonl"\n')
    cfg = load_config(tmp_path / "a.toml", {"steps": 9})
    assert (cfg.lr, cfg.steps, cfg.data) == (0.01, 9, "x.jsonl")
    (tmp_path / "a.yaml").write_text("train:\n  lr: 0.02\n  warmup: 1\n")
    pytest.importorskip("yaml")
    assert load_config(tmp_path / "a.yaml").lr == 0.02


def test_unknown_field_suggests_the_closest_name(tmp_path):
    (tmp_path / "a.toml").write_text("eval_intervall = 5\n")
    with pytest.raises(ConfigError, match=r"unknown config field 'eval_intervall' in .*a.toml"
                                          r": did you mean 'eval_interval'\?"):
        load_config(tmp_path / "a.toml")
    with pytest.raises(ConfigError, match="did you mean 'microbatches'"):
        TrainConfig().replace(micro_batches=2)
    with pytest.raises(ConfigError, match="batch=6 is not a multiple of microbatches=4"):
        TrainConfig(batch=6)


def _one_line_error(capsys, argv, code=2) -> str:
    rc = main(["train", *argv])
    err = capsys.readouterr().err.strip()
    assert rc == code and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_cli_errors_are_one_line_before_training(tmp_path, capsys):
    data = text_jsonl(tmp_path / "d.jsonl", 50)
    out = str(tmp_path / "o")
    (tmp_path / "c.toml").write_text("lrr = 1\n")
    assert "did you mean 'lr'" in _one_line_error(capsys, ["--config", str(tmp_path / "c.toml")])
    assert "does not exist" in _one_line_error(capsys, ["--config", str(tmp_path / "no.toml")])
    err = _one_line_error(capsys, flags(data=str(tmp_path / "missing.txt"), out_dir=out))
    assert "missing.txt" in err and "does not exist" in err
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{oops\n')
    err = _one_line_error(capsys, flags(data=str(tmp_path / "bad.jsonl"), out_dir=out),
                          code=1)                  # the data is wrong, not a setting
    assert "bad.jsonl:2" in err
    err = _one_line_error(capsys, flags(data=str(data), out_dir=out, model=str(tmp_path / "m")))
    assert "model directory" in err
    assert not (tmp_path / "o").exists()           # nothing was written


def test_sequence_longer_than_the_model_supports(tmp_path, capsys):
    config = transformers.Qwen3Config(vocab_size=300, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=16)
    transformers.Qwen3ForCausalLM(config).save_pretrained(tmp_path / "m")
    data = text_jsonl(tmp_path / "d.jsonl", 50)
    capsys.readouterr()                            # save_pretrained's progress output
    err = _one_line_error(capsys, flags(data=str(data), out_dir=str(tmp_path / "o"),
                                        model=str(tmp_path / "m"), seq=32))
    assert "seq=32" in err and "max_position_embeddings=16" in err and "--seq 16" in err


def test_docs_settings_table_lists_every_field_with_its_default():
    import pathlib
    import re
    from dataclasses import fields
    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "training.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", text, flags=re.M))
    cfg = TrainConfig()
    for f in fields(TrainConfig):
        value = getattr(cfg, f.name)
        assert rows.get(f.name) == repr(getattr(value, "value", value)), f.name


def test_int_settings_have_an_upper_bound_naming_the_field():
    """Huge values failed deep in torch ("Overflow when unpacking long long")."""
    from dataclasses import fields
    from rotapipe.train.config import INT_LIMIT, LARGEST
    ints = [f.name for f in fields(TrainConfig) if f.name in LARGEST or f.name in
            ("steps", "seed", "warmup", "keep", "log_every", "eval_interval")]
    for name in ints:
        largest = LARGEST.get(name, INT_LIMIT)
        with pytest.raises(ConfigError, match=rf"^{name}={largest + 1}: use an int in "
                                              rf"\[[01], {largest:,}\]$"):
            TrainConfig(**{name: largest + 1})
    assert TrainConfig(seed=INT_LIMIT, steps=INT_LIMIT, seq=LARGEST["seq"]).seed == INT_LIMIT


def test_a_config_file_is_one_flat_table_or_one_train_table(tmp_path):
    (tmp_path / "a.toml").write_text("[train]\nlr = 1e-3\n[other]\nx = 1\n")
    with pytest.raises(ConfigError, match=r"a\.toml has a 'train' table and also 'other': "
                                          r"write the settings as name = value at the top "
                                          r"level .*or all of them in one 'train' table"):
        load_config(tmp_path / "a.toml")
    (tmp_path / "b.toml").write_text("lr = 1e-3\n[optim]\nbeta1 = 0.9\n")
    with pytest.raises(ConfigError, match=r"b\.toml: 'optim' is a table, not a setting"):
        load_config(tmp_path / "b.toml")
    (tmp_path / "c.toml").write_text("[train]\nlr = 1e-3\n")
    assert load_config(tmp_path / "c.toml").lr == 1e-3


def test_a_yaml_exponent_is_a_number_and_a_quoted_number_is_named(tmp_path):
    """PyYAML reads ``lr: 1e-4`` (YAML 1.1: no dot) as the string '1e-4': the run was
    refused with "config field 'lr' = '1e-4' should be of type float". Now a number, as
    in TOML and JSON; a quoted number anywhere is named as a string with the fix."""
    pytest.importorskip("yaml")
    (tmp_path / "a.yaml").write_text("lr: 1e-4\nmin_lr_ratio: 5E-2\nsample_prompt: '1e5'\n")
    cfg = load_config(tmp_path / "a.yaml")
    assert (cfg.lr, cfg.min_lr_ratio, cfg.sample_prompt) == (1e-4, 0.05, "1e5")
    (tmp_path / "b.yaml").write_text("train:\n  weight_decay: 1e-2\n")
    assert load_config(tmp_path / "b.yaml").weight_decay == 0.01
    import yaml
    assert yaml.safe_load("lr: 1e-4") == {"lr": "1e-4"}      # PyYAML itself unchanged
    (tmp_path / "c.toml").write_text('steps = "10"\n')
    with pytest.raises(ConfigError, match=r"config field 'steps' = '10' is a string, not an "
                                          r"int: write it without quotes \(steps = 10\)"):
        load_config(tmp_path / "c.toml")


@pytest.mark.parametrize("argv, ours", [
    (["--max-steps", "3"], "--steps"), (["--eval_interval", "5"], "--eval-interval"),
    (["--learning_rate=1e-4"], "--lr"), (["--no-exportt"], "--no-export"),
    (["--per-device-train-batch-size", "4"], "--batch (sequences per optimizer step"),
])
def test_an_unknown_flag_is_named_with_ours(capsys, argv, ours):
    """argparse said "rotapipe: error: unrecognized arguments: --max-steps 3", naming no
    flag that works, for transformers' names and underscores alike."""
    with pytest.raises(SystemExit) as exc:
        main(["train", "--steps", "2", *argv])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exc.value.code == 2
    assert err.startswith(f"rotapipe train: error: unknown flag {argv[0].split('=')[0]}: "
                          f"did you mean {ours}"), err


@pytest.mark.parametrize("line, message", [
    ("recipe = 'lora'", "'recipe' in {f} is a flag of rotapipe train (--recipe), not a "
                        "config field: pass --recipe NAME with --config FILE"),
    ("max_steps = 5", "unknown config field 'max_steps' in {f}: did you mean 'steps'?"),
    ("learning_rate = 1e-4", "unknown config field 'learning_rate' in {f}: did you mean 'lr'?"),
    ("gradient_accumulation_steps = 4", "did you mean 'microbatches' (--batch, the sequences "
                                        "of a step, is split into that many pieces)?"),
])
def test_a_config_file_with_other_tools_names_is_answered_with_ours(tmp_path, line, message):
    """``recipe = 'lora'`` in a file was "did you mean 'trace'?", and transformers' names
    got a guess by spelling (``learning_rate``: none at all)."""
    f = tmp_path / "run.toml"
    f.write_text(line + "\n")
    with pytest.raises(ConfigError) as exc:
        load_config(f)
    assert message.format(f=f) in str(exc.value), str(exc.value)


def test_a_resume_refusal_gives_the_flag_that_resumes():
    """A boolean setting is fixed with --x / --no-x, an unset one by leaving it out."""
    from rotapipe.train.resume import check_resume_config
    cfg = TrainConfig(lora=True, data="d.jsonl")
    cases = [({**dataclasses.asdict(cfg), "lora": False}, "pass --no-lora to resume it"),
             ({**dataclasses.asdict(cfg), "data": None}, "leave out --data to resume it"),
             ({**dataclasses.asdict(cfg), "seq": 64}, "pass --seq 64 to resume it")]
    for saved, fix in cases:
        with pytest.raises(ConfigError, match=re.escape(fix)):
            check_resume_config("ckpt", saved, cfg)
    check_resume_config("ckpt", dataclasses.asdict(cfg), cfg)


def test_lora_needs_a_pretrained_model():
    """A config with LoRA and no model can be built (the host-RAM check prices --lora as
    a fix for any run), but a run of it is refused where it starts."""
    for kw in ({"lora": True}, {"qlora": True}):
        cfg = TrainConfig(**kw)
        with pytest.raises(ConfigError, match="needs model: .*pretrained base weights"):
            cfg.effective()
    assert TrainConfig(model="m", lora=True).effective().lora


@pytest.mark.parametrize("saved, given, same", [
    (["q_proj", "v_proj"], "v_proj,q_proj", True),
    (["q_proj", "v_proj"], "q_proj", False),
    (["q_proj", "v_proj"], "all-linear", False),
    (["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.up_proj"], "all-linear", True),
    (["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.up_proj"], "up_proj,q_proj",
     True),
    ("all-linear", "all-linear", True),
])
def test_resumed_adapter_targets_compare_as_layer_names(tmp_path, saved, given, same):
    """PEFT writes all-linear out as every wrapped layer's full name and keeps names
    given as they are; the flag matches either form."""
    import json
    from rotapipe.train.settings import check_lora_flags
    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"r": 8, "lora_alpha": 16, "target_modules": saved}))
    cfg = TrainConfig(model="m", resume_from_adapter=str(tmp_path), lora_targets=given)
    if same:
        check_lora_flags(cfg, {"lora_targets": given, "lora_rank": 8, "lora_alpha": 16.0})
    else:
        with pytest.raises(ConfigError, match=f"--lora-targets {given} conflicts"):
            check_lora_flags(cfg, {"lora_targets": given})
