"""Bad input to ``rotapipe train``, ``plan`` and ``simulate``: an exit code, one line
that names the problem, no traceback, nothing written, in bounded time; a clean run
afterwards gives the reference result. Issue 15, items 2 and 3.

Cases run in-process (``rotapipe.cli.main``) except two that check the real process.
Exit codes (docs/training.md, "Exit codes"): 2 a flag or setting is wrong, 1 the run
failed, 3 ``plan``: does not fit.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys
import time

import pytest

from rotapipe.cli import main
from train_util import env, flags, text_jsonl, deadline

EXPLICIT = ["--layers", "16", "--fwd-ms", "1", "--bwd-ms", "2", "--head-fwd-ms", "3",
            "--head-bwd-ms", "6", "--schedules", "1f1b,roundpipe"]


@pytest.fixture(autouse=True)
def bounded():
    """Every case ends within 60 s: a hang fails the test instead of the run."""
    with deadline(60.0):
        yield


def cli(capsys, *argv) -> tuple[int, str, str]:
    """``(exit code, stdout, stderr)`` of ``rotapipe *argv`` in this process."""
    capsys.readouterr()
    try:
        code = main(list(argv))
    except SystemExit as exc:                    # argparse: usage errors and --help
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def fails(capsys, code, argv, *fragments, limit_s: float = 10.0) -> str:
    """``rotapipe *argv`` exits ``code`` within ``limit_s`` with an error line holding
    every fragment, and no traceback."""
    t = time.perf_counter()
    rc, out, err = cli(capsys, *argv)
    elapsed = time.perf_counter() - t
    assert rc == code, (rc, out, err)
    assert "Traceback" not in err and "Traceback" not in out, err
    errors = [l for l in err.splitlines() if l.startswith(f"rotapipe {argv[0]}: error:")]
    assert len(errors) == 1, err
    for f in fragments:
        assert f in errors[0], f"{f!r} not in {errors[0]!r}"
    assert elapsed < limit_s, f"took {elapsed:.1f} s"
    return errors[0]


# -- simulate ----------------------------------------------------------------------------------

@pytest.mark.parametrize("change, fragments", [
    (["--microbatches", "0"], ["--microbatches", "0: use an integer in [1, 4,096]"]),
    (["--microbatches", "99999999999999999999999"], ["--microbatches", "use an integer in [1, 4,096]"]),
    (["--microbatches", "four"], ["--microbatches", "'four' is not an integer"]),
    (["--fwd-ms", "nan"], ["--fwd-ms", "nan: use a finite number of ms in [1e-06, 1e+06]"]),
    (["--bwd-ms", "inf"], ["--bwd-ms", "inf: use a finite number of ms in [1e-06, 1e+06]"]),
    (["--head-fwd-ms", "0"], ["--head-fwd-ms", "[1e-06, 1e+06]"]),
    (["--devices", "0"], ["--devices", "0: use an integer in [1, 1,024]"]),
    (["--devices", "-3"], ["--devices", "-3"]),
    (["--global-batch", "0"], ["--global-batch", "0: use an integer in [1, 1,048,576]"]),
    (["--global-batch", "24"], ["--global-batch 24 is not a multiple of --microbatches 16"]),
    (["--hop-ms", "nan"], ["--hop-ms", "nan: use a finite number of ms in [0, 1e+06]"]),
    (["--upload-ms", "-1"], ["--upload-ms", "[0, 1e+06]"]),
    (["--recompute-ms", "inf"], ["--recompute-ms", "inf"]),
    (["--layers", "0"], ["--layers", "0: use an integer in [1, 1,024]"]),
    (["--seq", "0"], ["--seq", "0"]),
    (["--virtual-stages", "0"], ["--virtual-stages", "0"]),
    (["--calls", "1"], ["--calls", "1: use an integer in [2, 64]"]),
    (["--memory-gib", "nan"], ["--memory-gib", "nan"]),
    (["--schedules", "zigzag"], ["unknown schedule 'zigzag'"]),
    (["--schedules", ","], ["--schedules ',' names no schedule", "gpipe, 1f1b", "or all"]),
    (["--lora-rank", "4"], ["--lora-rank needs --model"]),
    (["--memory-gib", "1e-12"], ["--memory-gib", "1e-12: use a finite number of GiB in "
                                                  "[0.001, 100000]"]),
    # Absurd magnitudes printed numbers of hundreds of digits (exit 0), or an
    # unexpected OverflowError (--memory-gib 1e300, exit 1).
    (["--fwd-ms", "1e300"], ["argument --fwd-ms: 1e300: use a finite number of ms in "
                             "[1e-06, 1e+06]"]),
    (["--bwd-ms", "1e-300"], ["argument --bwd-ms: 1e-300", "[1e-06, 1e+06]"]),
    (["--head-bwd-ms", "-2"], ["argument --head-bwd-ms: -2", "[1e-06, 1e+06]"]),
    (["--hop-ms", "1e300"], ["argument --hop-ms: 1e300", "[0, 1e+06]"]),
    (["--upload-ms", "inf"], ["argument --upload-ms: inf", "[0, 1e+06]"]),
    (["--recompute-ms", "1e9"], ["argument --recompute-ms: 1e9", "[0, 1e+06]"]),
    (["--memory-gib", "1e300"], ["argument --memory-gib: 1e300: use a finite number of GiB "
                                 "in [0.001, 100000]"]),
    (["--layers", "100000"], ["argument --layers: 100000: use an integer in [1, 1,024]"]),
    # An empty --out drew nothing and said nothing (exit 0).
    (["--out", ""], ["--out is empty: pass the folder"]),
])
def test_simulate_bad_flag(capsys, change, fragments):
    fails(capsys, 2, ["simulate", *EXPLICIT, *change], *fragments)


def test_simulate_needs_times_or_a_model(capsys):
    fails(capsys, 2, ["simulate", "--layers", "4"], "missing --fwd-ms, --bwd-ms")


@pytest.mark.parametrize("value", ["0", "1.5", "nan", "1e-300", "0.001", "-1"])
def test_simulate_efficiency_out_of_range(capsys, value):
    fails(capsys, 2, ["simulate", "--model", "qwen3-1.7b", "--efficiency", value],
          "--efficiency", f"{value}: use a finite number in [0.01, 1]")


@pytest.mark.parametrize("change, fragments", [
    (["--lora", "--lora-rank", "1048576"], ["argument --lora-rank: 1048576: use an integer "
                                            "in [1, 65,536]"]),
    (["--memory-gib", "-1"], ["argument --memory-gib: -1", "[0.001, 100000]"]),
])
def test_simulate_model_flag_out_of_range(capsys, change, fragments):
    fails(capsys, 2, ["simulate", "--model", "qwen3-1.7b", *change], *fragments)


def test_simulate_out_naming_a_file_fails_before_simulating(capsys, tmp_path):
    f = tmp_path / "report.png"
    f.write_text("keep me")
    fails(capsys, 2, ["simulate", *EXPLICIT, "--out", str(f)], str(f), "is a file")
    fails(capsys, 2, ["simulate", *EXPLICIT, "--out", str(f / "sub")],
          "cannot be made", str(f))
    assert f.read_text() == "keep me"


def test_simulate_out_where_no_folder_can_be_made_fails_before_simulating(capsys):
    """/proc refuses even root a folder: refused with the flags (exit 2), not after the
    table was printed (exit 1, "No such file or directory")."""
    import os
    if not pathlib.Path("/proc/self").is_dir() or not os.access("/proc", os.W_OK):
        pytest.skip("needs /proc with write permission (root): else the permission "
                    "check refuses it first")
    rc, out, err = cli(capsys, "simulate", *EXPLICIT, "--out", "/proc/rotapipe/sim")
    assert rc == 2 and out == "", (rc, out, err)
    assert "--out '/proc/rotapipe/sim' cannot be written (making a folder in '/proc' " \
           "fails" in err and "Traceback" not in err, err


@pytest.mark.parametrize("command, typo, name", [
    ("plan", "qwen3-1.7", "qwen3-1.7b"),
    ("plan", "llama3-8b", "llama-3.1-8b"),
    ("simulate", "qwen-32b", "qwen3-32b"),
])
def test_model_name_typo_suggests_the_known_name(capsys, command, typo, name):
    argv = [command, typo] if command == "plan" else [command, "--model", typo]
    fails(capsys, 2, argv, f"no model config at {typo!r}: did you mean {name!r}?",
          "Give a config.json path or one of qwen3-1.7b")


def test_simulate_after_bad_input_matches_the_reference(capsys):
    rc, reference, _ = cli(capsys, "simulate", *EXPLICIT)
    assert rc == 0 and "roundpipe" in reference
    fails(capsys, 2, ["simulate", *EXPLICIT, "--devices", "0"], "--devices")
    rc, again, _ = cli(capsys, "simulate", *EXPLICIT)
    assert rc == 0 and again == reference
    # --devices 8 is what the default simulates; 0 no longer silently means 8
    rc, eight, _ = cli(capsys, "simulate", *EXPLICIT, "--devices", "8")
    assert eight == reference


# -- plan ------------------------------------------------------------------------------------

def _config(tmp_path, **changes) -> str:
    from rotapipe.plan.costs import load_config
    cfg = {**load_config("qwen3-1.7b"), **changes}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize("content, fragments", [
    ("[1, 2]", ["holds a JSON list, not an object"]),
    ('"qwen3"', ["holds a JSON str, not an object"]),
    ("{oops", ["is not valid JSON"]),
])
def test_plan_config_not_an_object(capsys, tmp_path, content, fragments):
    path = tmp_path / "config.json"
    path.write_text(content)
    fails(capsys, 2, ["plan", str(path)], str(path), *fragments)


@pytest.mark.parametrize("changes, fragments", [
    ({"num_attention_heads": 0}, ["num_attention_heads=0: use a positive int"]),
    ({"num_attention_heads": "16"}, ["num_attention_heads='16'"]),
    ({"hidden_size": -1}, ["hidden_size=-1"]),
    ({"num_hidden_layers": 0}, ["num_hidden_layers=0"]),
    ({"num_key_value_heads": 5}, ["num_attention_heads=16 is not a multiple of "
                                  "num_key_value_heads=5"]),
    ({"num_experts": 4, "num_experts_per_tok": 8},
     ["num_experts_per_tok=8 is more than num_experts=4"]),
    ({"num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 0},
     ["decoder_sparse_step=0: use an int >= 1"]),
    ({"num_experts": -1}, ["num_experts=-1: use an int >= 0"]),
    # DeepSeek-V3's names: routed experts, MoE layer frequency, latent attention ranks.
    ({"n_routed_experts": -4}, ["n_routed_experts=-4: use an int >= 0"]),
    ({"n_routed_experts": 4, "num_experts_per_tok": 6},
     ["num_experts_per_tok=6 is more than n_routed_experts=4"]),
    ({"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_layer_freq": 0},
     ["moe_layer_freq=0: use an int >= 1"]),
    ({"kv_lora_rank": 0}, ["kv_lora_rank=0: use a positive int"]),
    ({"model_type": "falcon", "ffn_hidden_size": "4h"}, ["ffn_hidden_size='4h'"]),
])
def test_plan_config_bad_sizes(capsys, tmp_path, changes, fragments):
    fails(capsys, 2, ["plan", _config(tmp_path, **changes)], *fragments)


@pytest.mark.parametrize("changes, fragments", [
    # Each was read wrong or not at all, and the plan printed "fits" (exit 0).
    ({"max_position_embeddings": -5}, ["max_position_embeddings=-5: use a positive int"]),
    ({"max_position_embeddings": "4k"}, ["max_position_embeddings='4k': use a positive int "
                                         "(got str)"]),
    ({"tie_word_embeddings": "no"}, ["tie_word_embeddings='no': use true or false (a JSON "
                                     "boolean; got str)"]),
    ({"tie_word_embeddings": 0}, ["tie_word_embeddings=0: use true or false"]),
    ({"attention_bias": "false"}, ["attention_bias='false': use true or false"]),
    ({"sliding_window": -1, "layer_types": ["sliding_attention"] * 28},
     ["sliding_window=-1: use an int >= 0"]),
    ({"layer_types": "full_attention"}, ["layer_types='full_attention': use a list of "
                                         "strings"]),
    ({"model_type": 3}, ["model_type=3: use the family's name as a string"]),
    ({"text_config": "qwen3"}, ["text_config='qwen3': use an object"]),
    ({"text_config": {"max_position_embeddings": "4k"}}, ["max_position_embeddings='4k'"]),
    ({"hidden_size": 2048.0}, ["hidden_size=2048.0: use a positive int (got float)"]),
    # Absurd sizes: a verdict in exabytes before.
    ({"hidden_size": 10**12}, ["hidden_size=1000000000000: use an int in [1, 1,048,576]"]),
    ({"num_hidden_layers": 5000}, ["num_hidden_layers=5000: use an int in [1, 1,024]"]),
    ({"vocab_size": 2**30}, ["vocab_size=1073741824: use an int in [1, 4,194,304]"]),
])
def test_plan_config_bad_field_names_the_file(capsys, tmp_path, changes, fragments):
    path = _config(tmp_path, **changes)
    fails(capsys, 2, ["plan", path], f"{path}: ", *fragments)


def test_plan_config_without_the_sizes_names_the_file(capsys, tmp_path):
    """An empty config.json said "model config (model_type=None) has no 'hidden_size'",
    naming no file."""
    path = tmp_path / "config.json"
    path.write_text("{}")
    fails(capsys, 2, ["plan", str(tmp_path)], f"{path}: no 'hidden_size', "
          "'num_hidden_layers', 'num_attention_heads', 'vocab_size' (model_type=None)")


def test_plan_config_null_settings_are_unset(capsys, tmp_path):
    """``null`` is "not set", as transformers reads it: a null head_dim is hidden_size /
    heads (LlamaConfig fills it in so), a null sliding_window no window; and the flags
    and sizes of the shipped configs pass."""
    rc, reference, _ = cli(capsys, "plan", "qwen3-1.7b", "--json")
    rc2, out, err = cli(capsys, "plan", _config(tmp_path, head_dim=None, sliding_window=None,
                                                tie_word_embeddings=True), "--json")
    assert rc == rc2 == 0 and err == ""
    assert json.loads(out)["step_ms"] == json.loads(reference)["step_ms"]


def test_plan_config_of_random_bytes(capsys, tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(bytes(range(256)) * 4)
    fails(capsys, 2, ["plan", str(path)], str(path), "not a JSON text file")


@pytest.mark.parametrize("change, fragments", [
    (["--host-ram", "nan"], ["--host-ram", "nan: use a finite number of GB in [1, 1e+06]"]),
    (["--host-ram", "0"], ["--host-ram", "0: use a finite number of GB in [1, 1e+06]"]),
    (["--efficiency", "0"], ["--efficiency", "[0.01, 1]"]),
    (["--memory-fraction", "nan"], ["--memory-fraction", "nan"]),
    (["--memory-fraction", "1.5"], ["--memory-fraction", "[0.01, 1]"]),
    (["--copy-chunk-mb", "inf"], ["--copy-chunk-mb", "inf"]),
    (["--microbatches", "0"], ["--microbatches", "0: use an integer in [1, 4,096]"]),
    (["--seq", "1e23"], ["--seq", "'1e23' is not an integer"]),
    (["--seq", str(10**23)], ["--seq", "use an integer in [1, 1,048,576]"]),
    (["--seq", "-1"], ["--seq", "-1"]),
    (["--global-batch", "0"], ["--global-batch", "0"]),
    (["--lora", "--lora-rank", "0"], ["--lora-rank", "0"]),
    (["--pin", "pinned"], ["--pin", "invalid choice"]),
    (["--hardware", "tpu"], ["unknown hardware 'tpu'"]),
    (["--hardware", "rtx4090x0"], ["hardware 'rtx4090x0' has 0 devices: use DEVICExN with N in "
                                   "[1, 1,024]"]),
    # An empty name was an unexpected AttributeError (exit 1); a billion devices ran for
    # minutes; 1e300 GB of host RAM an unexpected OverflowError.
    (["--hardware", ""], ["--hardware is empty: use DEVICExN"]),
    (["--hardware", "a100x1000000000"], ["hardware 'a100x1000000000' has 1,000,000,000 "
                                         "devices: use DEVICExN with N in [1, 1,024]"]),
    (["--host-ram", "1e300"], ["--host-ram", "1e300: use a finite number of GB in [1, 1e+06]"]),
    # Absurd rates and sizes: the plan printed numbers of hundreds of digits, or a rate
    # of 1e-300 "fits" (exit 0); a host RAM under a byte read as none (the default 512
    # GB); a memory fraction of 1e-300 an internal "memory_bytes (0) ... must be >= 1".
    (["--optimizer-rate", "1e-300"], ["argument --optimizer-rate: 1e-300: use a finite "
                                      "number of parameters per second in [1e+06, 1e+15]"]),
    (["--optimizer-rate", "inf"], ["argument --optimizer-rate: inf", "[1e+06, 1e+15]"]),
    (["--optimizer-rate=-5e9"], ["argument --optimizer-rate: -5e9", "[1e+06, 1e+15]"]),
    (["--nodes", "2", "--network-gbps", "1e-300"],
     ["argument --network-gbps: 1e-300: use a finite number of Gb/s in [0.01, 100000]"]),
    (["--nodes", "2", "--network-gbps", "1e300"], ["argument --network-gbps: 1e300"]),
    (["--nodes", "2", "--network-gbps", "nan"], ["argument --network-gbps: nan"]),
    (["--nodes", "2", "--inflight-mb", "1e-300"],
     ["argument --inflight-mb: 1e-300: use a finite number of MiB in [0.01, 1e+06]"]),
    (["--nodes", "1048576"], ["argument --nodes: 1048576: use an integer in [1, 65,536]"]),
    (["--host-ram", "1e-300"], ["argument --host-ram: 1e-300", "[1, 1e+06]"]),
    (["--efficiency", "1e-300"], ["argument --efficiency: 1e-300: use a finite number in "
                                  "[0.01, 1]"]),
    (["--memory-fraction", "1e-300"], ["argument --memory-fraction: 1e-300", "[0.01, 1]"]),
    (["--pin", "off", "--copy-chunk-mb", "1e-300"],
     ["argument --copy-chunk-mb: 1e-300: use a finite number of MiB in [0.01, 65536]"]),
    (["--copy-chunk-mb", "-1"], ["argument --copy-chunk-mb: -1"]),
    (["--prefetch", "1048576"], ["argument --prefetch: 1048576: use an integer in [1, 1,024]"]),
    (["--lora", "--lora-rank", "1048576"], ["argument --lora-rank: 1048576: use an integer "
                                            "in [1, 65,536]"]),
    (["--lora-rank", "4"], ["--lora-rank 4 prices LoRA adapters, but the run is full "
                            "fine-tuning: add --lora (or --qlora)"]),
])
def test_plan_bad_flag(capsys, change, fragments):
    fails(capsys, 2, ["plan", "qwen3-1.7b", *change], *fragments)


def test_plan_takes_the_ends_of_each_range(capsys):
    """The bounds are far from any real machine: both ends plan (and print plain
    numbers), as the default does."""
    for ends in (["--optimizer-rate", "1e6", "--efficiency", "0.01", "--memory-fraction",
                  "0.01", "--host-ram", "1", "--pin", "off", "--copy-chunk-mb", "0.01"],
                 ["--optimizer-rate", "1e15", "--efficiency", "1", "--memory-fraction", "1",
                  "--host-ram", "1e6", "--pin", "off", "--copy-chunk-mb", "65536"],
                 ["--nodes", "2", "--network-gbps", "0.01", "--inflight-mb", "0.01"],
                 ["--nodes", "2", "--network-gbps", "1e5", "--inflight-mb", "1e6"]):
        rc, out, err = cli(capsys, "plan", "qwen3-1.7b", *ends)
        assert rc in (0, 3) and err == "", (ends, err)
        assert max(map(len, out.split())) < 80, ends          # no 300-digit numbers


def test_plan_exit_codes_fit_and_no_fit(capsys):
    rc, out, err = cli(capsys, "plan", "qwen3-1.7b", "--microbatches", "16")
    assert rc == 0 and "verdict: fits" in out and err == ""
    rc, out, err = cli(capsys, "plan", "qwen3-32b", "--hardware", "rtx4090x8", "--seq",
                       "131072", "--global-batch", "1")
    assert rc == 3 and "does NOT fit" in out and "Traceback" not in err


# -- train: settings (all fail before any setup: nothing is written) -------------------------

@pytest.fixture
def data(tmp_path) -> pathlib.Path:
    return text_jsonl(tmp_path / "d.jsonl", 200)


@pytest.mark.parametrize("setting, fragments", [
    ({"lr": "nan"}, ["lr=nan: use a finite number > 0"]),
    ({"lr": "inf"}, ["lr=inf"]),
    ({"holdout": "inf"}, ["holdout=inf", "fraction in [0, 1)"]),
    ({"beta2": "nan"}, ["beta2=nan"]),
    ({"grad_clip": "inf"}, ["grad_clip=inf"]),
    ({"time_limit": "nan"}, ["time_limit=nan"]),
    ({"dist_timeout": "inf"}, ["dist_timeout=inf"]),
    ({"weight_decay": "-1"}, ["weight_decay=-1.0", ">= 0"]),
    ({"dtype": "int8"}, ["dtype='int8'", "'fp32', 'bf16' or 'fp16'"]),
    ({"backend": "tpu"}, ["backend='tpu'"]),
    ({"optimizer": "adam"}, ["optimizer='adam'"]),
    ({"heads": "3"}, ["dim=32 is not a multiple of heads=3"]),
    ({"kv_heads": "3", "heads": "4"}, ["heads=4 is not a multiple of kv_heads=3"]),
    ({"batch": "5"}, ["batch=5 is not a multiple of microbatches=2"]),
    # Past int64 these reached torch as "unexpected" overflows (exit 1).
    ({"seed": str(10**23)}, [f"seed={10**23}: use an int in [0, 9,223,372,036,854,775,807]"]),
    ({"seq": str(10**23)}, [f"seq={10**23}: use an int in [1, 1,048,576]"]),
    ({"steps": str(2**63)}, [f"steps={2**63}: use an int in [1, 9,223,372,036,854,775,807]"]),
    ({"epochs": str(10**7)}, ["epochs=10000000: use an int in [1, 1,048,576]"]),
])
def test_train_bad_setting(capsys, tmp_path, data, setting, fragments):
    out = tmp_path / "o"
    argv = ["train", *flags(data=str(data), out_dir=str(out))]
    for k, v in setting.items():
        argv += ["--" + k.replace("_", "-"), v]
    fails(capsys, 2, argv, *fragments, limit_s=5)
    assert not out.exists()


@pytest.mark.parametrize("extra, given", [
    (["--lora-rank", "16"], "--lora-rank 16"),
    (["--lora-alpha", "32", "--lora-targets", "q_proj"], "--lora-alpha 32.0 --lora-targets q_proj"),
])
def test_train_lora_flags_without_lora(capsys, tmp_path, data, extra, given):
    """As plan's --lora-rank: without --lora the run trained every weight and ignored
    the flag (exit 0)."""
    out = tmp_path / "o"
    fails(capsys, 2, ["train", *flags(data=str(data), out_dir=str(out)), *extra],
          f"{given} sets LoRA adapters, but the run trains every weight: add --lora (or "
          "--qlora), or drop", limit_s=5)
    assert not out.exists()


@pytest.mark.parametrize("flag", ["--lora", "--qlora"])
def test_train_lora_without_a_model_is_refused(capsys, tmp_path, data, flag):
    """LoRA from scratch trained adapters on a random base and exported the adapter
    alone (exit 0): useless without that base."""
    out = tmp_path / "o"
    fails(capsys, 2, ["train", *flags(data=str(data), out_dir=str(out)), flag],
          f"{flag[2:]} needs model: ", "LoRA trains adapters on pretrained base weights "
          "(--model PATH)", f"pass --model DIR (or ORG/NAME), or drop {flag}", limit_s=5)
    assert not out.exists()


LAYERS = [f"model.layers.{i}.{m}" for i in range(2) for m in (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
"""What PEFT writes as target_modules for all-linear on a 2-layer Qwen3."""


@pytest.mark.parametrize("extra, refused", [
    (["--lora-rank", "16"], "--lora-rank 16 conflicts with the adapter resumed from {a} "
                            "(lora_rank=4 in its adapter_config.json)"),
    (["--lora-alpha", "32"], "--lora-alpha 32.0 conflicts with the adapter resumed from {a} "
                             "(lora_alpha=8.0 in its adapter_config.json)"),
    (["--lora-rank", "4", "--lora-targets", "q_proj,v_proj"],
     "--lora-targets q_proj,v_proj conflicts with the adapter resumed from {a} (lora_targets="
     "down_proj,gate_proj,k_proj,o_proj,q_proj,up_proj,v_proj in its adapter_config.json)"),
    (["--lora-rank", "16", "--lora-alpha", "32"],
     "--lora-rank 16 --lora-alpha 32.0 conflicts with the adapter resumed from {a} "
     "(lora_rank=4, lora_alpha=8.0 in its adapter_config.json), whose own shape is kept: "
     "drop --lora-rank, --lora-alpha (or give the adapter's values), or drop "
     "--resume-from-adapter to train a new adapter"),
    # The adapter's own values pass this check (the run then stops at the next one: the
    # base model directory here is empty).
    (["--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "all-linear"], None),
    (["--lora-targets", "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"], None),
])
def test_train_lora_shape_flags_must_match_the_resumed_adapter(capsys, tmp_path, data, extra,
                                                               refused):
    """The resumed adapter's own shape won and the flags were silently ignored (exit 0,
    the exported adapter still of rank 4)."""
    adapter, out = tmp_path / "adapter", tmp_path / "o"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps(
        {"r": 4, "lora_alpha": 8.0, "target_modules": LAYERS, "peft_type": "LORA"}))
    (tmp_path / "base").mkdir()
    argv = ["train", *flags(data=str(data), out_dir=str(out)), "--model",
            str(tmp_path / "base"), "--resume-from-adapter", str(adapter), *extra]
    if refused is not None:
        fails(capsys, 2, argv, refused.format(a=adapter), limit_s=5)
    else:
        line = fails(capsys, 2, argv, "has no config.json", limit_s=5)
        assert "adapter" not in line, line
    assert not out.exists()


def test_train_seq_of_one_token_fails_before_setup(capsys, tmp_path, data):
    """A 1-token sequence has no next token to predict: refused with the settings, not
    after the data setup as "are all labels ignored?" (exit 1)."""
    out = tmp_path / "o"
    fails(capsys, 2, ["train", *flags(data=str(data), out_dir=str(out), seq=1)],
          "seq=1: a sequence needs at least 2 tokens (one to predict from, one to "
          "predict): use --seq 2 or more", limit_s=5)
    assert not out.exists()


@pytest.mark.parametrize("env, fragment", [
    ({"WORLD_SIZE": "two"}, "environment variable WORLD_SIZE='two': use an integer >= 1"),
    ({"WORLD_SIZE": "-3"}, "environment variable WORLD_SIZE='-3': use an integer >= 1"),
    ({"LOCAL_RANK": "x"}, "environment variable LOCAL_RANK='x': use an integer >= 0"),
    ({"LOCAL_WORLD_SIZE": "0"}, "environment variable LOCAL_WORLD_SIZE='0'"),
    ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "http"},
     "environment variable MASTER_PORT='http': use an integer >= 1 and <= 65535"),
])
def test_train_bad_launcher_environment_is_named(capsys, monkeypatch, tmp_path, data, env,
                                                 fragment):
    """torchrun's variables set by hand and wrong: named, exit 2 (was "unexpected
    ValueError: invalid literal for int()", exit 1; WORLD_SIZE=-3 trained alone)."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    argv = ["train", *flags(data=str(data), out_dir=str(tmp_path / "o"))]
    if "MASTER_PORT" in env:
        argv += ["--batch", "4", "--microbatches", "2"]
    fails(capsys, 2, argv, fragment, "torchrun sets it", limit_s=30)


@pytest.mark.parametrize("argv, fragments", [
    (["--lr", "fast"], ["argument --lr", "'fast'"]),
    (["--steps", "1.5"], ["argument --steps", "'1.5'"]),
    (["--resume", "yes"], ["argument --resume", "--resume auto"]),
])
def test_train_flag_that_does_not_parse(capsys, tmp_path, argv, fragments):
    fails(capsys, 2, ["train", "--out-dir", str(tmp_path / "o"), *argv], *fragments)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("content, fragments", [
    ("[1, 2]", ["holds a list, not a table"]),
    ('{"lr": NaN}', ["lr=nan"]),
    ('{"steps": "10"}', ["'steps'", "'10'"]),
    ('{"train": {"lr": 1e-3}, "other": {"x": 1}}',
     ["has a 'train' table and also 'other'", "name = value at the top level",
      "all of them in one 'train' table"]),
    ('{"lr": 1e-3, "optim": {"beta1": 0.9}}', ["'optim' is a table, not a setting"]),
])
def test_train_config_file_refused(capsys, tmp_path, content, fragments):
    path = tmp_path / "run.json"
    path.write_text(content)
    fails(capsys, 2, ["train", "--config", str(path)], *fragments)


# -- train: output directory (found before any setup) ----------------------------------------

def test_out_dir_naming_a_file(capsys, tmp_path, data):
    f = tmp_path / "results.txt"
    f.write_text("keep me")
    fails(capsys, 2, ["train", *flags(data=str(data), out_dir=str(f))], str(f), "is a file",
          limit_s=3)
    fails(capsys, 2, ["train", *flags(data=str(data), out_dir=str(f / "run"))],
          "cannot be created", str(f), limit_s=3)
    assert f.read_text() == "keep me"


@pytest.mark.parametrize("out_dir, fragments", [
    ("/proc/rotapipe-run", ["out_dir '/proc/rotapipe-run' cannot be created in '/proc'",
                            "pass an --out-dir on a writable file system"]),
    ("/proc/rotapipe/run", ["out_dir '/proc/rotapipe/run' cannot be created in '/proc'"]),
])
def test_out_dir_that_cannot_be_created(capsys, data, out_dir, fragments):
    """A folder where nothing can be made (here /proc, which refuses even root) fails
    with the settings (exit 2), not with "No such file or directory" after the data
    setup (exit 1)."""
    import os
    if not pathlib.Path("/proc/self").is_dir() or not os.access("/proc", os.W_OK):
        pytest.skip("needs /proc with write permission (root): else the permission "
                    "check refuses it first")
    fails(capsys, 2, ["train", *flags(data=str(data), out_dir=out_dir)], *fragments,
          limit_s=3)


def test_out_dir_check_leaves_nothing_behind(tmp_path):
    """The write check of out_dir (and of the folder it is made in) leaves no trace."""
    from rotapipe.train.checkpoint import check_out_dir
    check_out_dir(tmp_path / "new" / "run")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "run").mkdir()
    check_out_dir(tmp_path / "run")
    assert list((tmp_path / "run").iterdir()) == []


def test_out_dir_whose_checkpoints_entry_is_a_file(capsys, tmp_path, data):
    out = tmp_path / "o"
    out.mkdir()
    (out / "checkpoints").write_text("")
    fails(capsys, 2, ["train", *flags(data=str(data), out_dir=str(out))],
          "checkpoints exists but is not a directory", limit_s=3)
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints"]


# -- train: data that is not text ------------------------------------------------------------

@pytest.mark.parametrize("name", ["noise.txt", "noise.jsonl", "noise.md"])
def test_random_bytes_are_refused_with_the_file_name(capsys, tmp_path, name):
    import random
    f = tmp_path / name
    f.write_bytes(random.Random(0).randbytes(4096))
    fails(capsys, 1, ["train", *flags(data=str(f), out_dir=str(tmp_path / "o"))],
          str(f), "is not text", limit_s=3)
    assert not (tmp_path / "o").exists()


def test_jsonl_line_that_is_not_utf8(capsys, tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    fails(capsys, 1, ["train", *flags(data=str(f), out_dir=str(tmp_path / "o"))],
          f"{f}:2", "not UTF-8", limit_s=3)


@pytest.mark.parametrize("kind", ["character device", "FIFO"])
def test_data_that_is_not_a_regular_file(capsys, tmp_path, kind):
    """/dev/null or a named pipe exists: it is named as what it is, not "does not
    exist", and nothing blocks reading a FIFO."""
    import os
    if kind == "FIFO":
        path = tmp_path / "pipe"
        os.mkfifo(path)
    else:
        path = pathlib.Path("/dev/null")
    fails(capsys, 2, ["train", *flags(data=str(path), out_dir=str(tmp_path / "o"))],
          f"data file '{path}' is a {kind}, not a regular file: pass a file or a "
          "directory of files", limit_s=3)
    assert not (tmp_path / "o").exists()


def test_data_directory_with_a_fifo_inside_still_works(tmp_path):
    """A directory is read as before: the files in it, a FIFO beside them skipped."""
    import os
    from rotapipe.train.records import source_files
    text_jsonl(tmp_path / "d.jsonl", 10)
    os.mkfifo(tmp_path / "pipe.txt")
    assert source_files(str(tmp_path)) == [tmp_path / "d.jsonl"]


@pytest.mark.parametrize("name, content", [("a.txt", ""), ("a.txt", "\n\n   \n\t\n"),
                                           ("a.jsonl", "\n\n\n")])
def test_data_files_that_are_all_empty(capsys, tmp_path, name, content):
    """Blank lines only are empty too: refused before setup (they trained a tokenizer,
    built the model and evaluated before "lane 0 of the training split is empty")."""
    (tmp_path / name).write_text(content)
    fails(capsys, 2, ["train", *flags(data=str(tmp_path / name),
                                      out_dir=str(tmp_path / "o"))],
          "are empty (or hold only blank lines)", limit_s=3)


def test_text_in_another_encoding_is_still_text(tmp_path):
    from rotapipe.train.data import check_text
    f = tmp_path / "koi8.txt"
    f.write_bytes("Привет, мир! Это текст в KOI8-R.\n".encode("koi8_r") * 50)
    check_text(f)                                  # no error


@pytest.mark.parametrize("damage", ["truncate", "overwrite the header"])
def test_model_with_damaged_safetensors(capsys, tmp_path, data, damage):
    """A damaged weight file of --model is named, before the tokenizer and the model
    are built (it was "unexpected SafetensorError", naming no file)."""
    pytest.importorskip("transformers")
    from train_util import tiny_model_dir
    model = tiny_model_dir(tmp_path / "m")
    f = model / "model.safetensors"
    raw = f.read_bytes()
    f.write_bytes(raw[:len(raw) // 2] if damage == "truncate" else b"\xff" * 16 + raw[16:])
    fails(capsys, 1, ["train", *flags(data=str(data), out_dir=str(tmp_path / "o"),
                                      model=str(model))],
          f"model weights {str(f)!r} cannot be read (", "damaged or truncated", limit_s=10)
    assert not (tmp_path / "o").exists()


# -- train: resume -----------------------------------------------------------------------------

def test_resume_after_the_data_changed_warns(capsys, caplog, tmp_path):
    """The data files are fingerprinted in meta.json: a resume on other content says so
    (it used to continue silently at the saved position in the new data)."""
    data = text_jsonl(tmp_path / "d.jsonl", 200)
    argv = flags(data=str(data), out_dir=str(tmp_path / "o"), save_interval=2,
                 eval_interval=0, export=False)
    assert main(["train", *argv, "--steps", "2"]) == 0
    caplog.clear()
    assert main(["train", *argv, "--steps", "4", "--resume"]) == 0
    assert "data files differ" not in caplog.text
    text_jsonl(data, 200, seed=1)                      # same name, other records
    caplog.clear()
    rc, _, err = cli(capsys, "train", *argv, "--steps", "6", "--resume")
    assert rc == 0 and "Traceback" not in err, err
    assert "the data files differ from those checkpoint " in caplog.text
    assert f"(changed: {data})" in caplog.text and "not the run that was stopped" in \
        caplog.text


def test_summary_names_the_last_evaluated_step(capsys, tmp_path, data):
    """A run that ends after its last evaluation (here: --time-limit before --steps; an
    --epochs limit now ends the run with its own evaluation) says where the loss was
    measured; it used to print "over steps 0..N" with N unevaluated."""
    rc, out, err = cli(capsys, "train", *flags(data=str(data), out_dir=str(tmp_path / "o"),
                                                steps=100000, time_limit=0.001,
                                                eval_interval=100000, save_interval=0,
                                                export=False))
    summary = out.strip().splitlines()[-1]
    assert rc == 0 and "held-out loss" in summary, (out, err)
    end = int(summary.split("ended at step ")[1].split(",")[0])
    assert end > 0 and f"over steps 0..0 (ended at step {end}, not evaluated there)" in summary

def test_resume_with_nothing_to_resume_is_an_error(capsys, tmp_path, data):
    out = tmp_path / "typo"
    fails(capsys, 2, ["train", *flags(data=str(data), out_dir=str(out), resume=True)],
          "holds no checkpoint", "--resume auto", limit_s=5)
    assert not out.exists()


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> pathlib.Path:
    """A run of 4 steps with checkpoints at steps 2 and 4 (copy it before changing it)."""
    root = tmp_path_factory.mktemp("trained")
    data = text_jsonl(root / "d.jsonl", 200)
    rc = main(["train", *flags(data=str(data), out_dir=str(root / "o"), steps=4,
                               save_interval=2, eval_interval=0, export=False)])
    assert rc == 0
    return root


def _copy(trained, tmp_path) -> tuple[pathlib.Path, list[str]]:
    out = tmp_path / "o"
    shutil.copytree(trained / "o", out)
    return out, flags(data=str(trained / "d.jsonl"), out_dir=str(out), steps=6,
                      save_interval=2, eval_interval=0, export=False)


def _masters(out, step):
    from rotapipe.train import load_checkpoint
    return load_checkpoint(out / "checkpoints" / f"step-{step:08d}")[0]


@pytest.mark.parametrize("damage", ["truncate state.pt", "truncate masters.safetensors",
                                    "delete meta.json", "truncate tokenizer",
                                    "truncate state.pt, no manifest"])
def test_damaged_latest_checkpoint_falls_back_with_a_warning(capsys, caplog, tmp_path,
                                                               trained, damage):
    out, argv = _copy(trained, tmp_path)
    latest = out / "checkpoints" / "step-00000004"
    if "no manifest" in damage:                # a checkpoint from before manifests
        (latest / "manifest.json").unlink()
    if "tokenizer" in damage:
        f = latest / "tokenizer" / "tokenizer.json"
    else:
        f = latest / damage.split()[1].rstrip(",")
    if damage.startswith("delete"):
        f.unlink()
    else:
        f.write_bytes(f.read_bytes()[:64])
    rc, stdout, err = cli(capsys, "train", *argv, "--resume")
    assert rc == 0 and "Traceback" not in err, err
    warned = caplog.text              # the CLI's logging shows it on stderr
    assert "checkpoint " + str(latest) in warned and "skipping it" in warned, warned
    assert "damaged: step-00000004" in warned
    assert "resumed from " + str(out / "checkpoints" / "step-00000002") in stdout
    # the resumed run continued from step 2 (steps 3..6), as a clean resume would
    lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3, 4, 5, 6]
    clean, _ = _copy(trained, tmp_path / "clean")
    shutil.rmtree(clean / "checkpoints" / "step-00000004")
    rc, _, _ = cli(capsys, "train", *flags(data=str(trained / "d.jsonl"), out_dir=str(clean),
                                           steps=6, save_interval=2, eval_interval=0,
                                           export=False), "--resume")
    a, b = _masters(out, 6), _masters(clean, 6)
    assert rc == 0 and all((a[k] == b[k]).all() for k in a)


def _nan_masters(ckpt: pathlib.Path) -> None:
    """NaN in the last tensor of masters.safetensors, the file the same size (the
    manifest still agrees: only reading the values finds it)."""
    from safetensors.torch import load_file, save_file
    f = ckpt / "masters.safetensors"
    size, masters = f.stat().st_size, load_file(str(f))
    masters[sorted(masters)[-1]].view(-1)[0] = float("nan")
    save_file(masters, str(f))
    assert f.stat().st_size == size


@pytest.mark.parametrize("damage, fragment", [
    ("manifest [1]", "manifest.json is not a JSON object (it holds a list"),
    ('manifest {"masters.safetensors": "big"}',
     "manifest.json gives masters.safetensors a size of 'big', not a number of bytes"),
    ('manifest {"../../d.jsonl": 1}', "manifest.json names '../../d.jsonl', which is not a "
                                      "file inside the checkpoint"),
    ("nan masters", "masters.safetensors holds non-finite values in "),
    ('meta {"config": "x", "fingerprint": {}}', "meta.json['config'] is a str, not the dict"),
    ('meta {"config": {"steps": "4"}, "fingerprint": {"params": {}}}',
     "meta.json['config']['steps'] is a str, not the int"),
    ("meta []", "meta.json holds a list, not the dict a save writes"),
])
def test_checkpoint_damaged_inside_is_skipped_like_a_truncated_one(caplog, tmp_path, trained,
                                                                   damage, fragment):
    """Damage that the sizes in the manifest do not show (a manifest of the wrong shape,
    NaN masters, a meta.json field of the wrong type) is skipped with a warning naming
    the checkpoint and what is wrong, and the resume falls back to the one before."""
    from rotapipe.train.checkpoint import resume_from
    out, _ = _copy(trained, tmp_path)
    latest = out / "checkpoints" / "step-00000004"
    what, _, text = damage.partition(" ")
    if what == "nan":
        _nan_masters(latest)
    else:
        f = latest / f"{what}.json"
        f.write_text(text)
        if what == "meta":       # the manifest's size of meta.json still holds
            manifest = json.loads((latest / "manifest.json").read_text())
            manifest["meta.json"] = f.stat().st_size
            (latest / "manifest.json").write_text(json.dumps(manifest))
    path, _, state, _ = resume_from(out / "checkpoints", True)
    assert path.name == "step-00000002" and state["step"] == 2
    assert f"checkpoint {latest}: {fragment}" in caplog.text, caplog.text
    assert "damaged: step-00000004" in caplog.text


def test_every_checkpoint_damaged_is_a_runtime_error(capsys, tmp_path, trained):
    out, argv = _copy(trained, tmp_path)
    for step in (2, 4):
        f = out / "checkpoints" / f"step-{step:08d}" / "masters.safetensors"
        f.write_bytes(b"")
    fails(capsys, 1, ["train", *argv, "--resume"], "every checkpoint", "step-00000002",
          "step-00000004", "damaged")
    assert (out / "checkpoints" / "step-00000004").is_dir()       # nothing deleted


def test_resume_auto_starts_when_there_is_nothing(capsys, tmp_path, data):
    rc, stdout, err = cli(capsys, "train", *flags(data=str(data), out_dir=str(tmp_path / "o"),
                                                  steps=1, eval_interval=0, export=False),
                          "--resume", "auto")
    assert rc == 0 and "starting from step 0" in stdout, err


def test_fresh_run_into_checkpoints_is_refused(capsys, tmp_path, trained):
    out, argv = _copy(trained, tmp_path)
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    fails(capsys, 2, ["train", *argv], "already holds checkpoints", "--resume")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before


# -- the top-level handler -----------------------------------------------------------------------

def test_unexpected_error_is_one_line_that_points_to_debug(capsys, monkeypatch):
    import rotapipe.cli as cli_module

    def broken(args):
        raise TypeError("unsupported operand type(s) for +: 'int' and 'str'")
    run = cli_module.COMMANDS["simulate"]
    monkeypatch.setitem(cli_module.COMMANDS, "simulate", (run[0], broken, run[2]))
    fails(capsys, 1, ["simulate", *EXPLICIT], "unexpected TypeError",
          "run with --debug for the traceback")
    with pytest.raises(TypeError):
        main(["simulate", *EXPLICIT, "--debug"])


def test_os_error_is_one_line(capsys, monkeypatch):
    import rotapipe.cli as cli_module

    def full(args):
        raise OSError(28, "No space left on device", "/data/run/metrics.jsonl")
    run = cli_module.COMMANDS["plan"]
    monkeypatch.setitem(cli_module.COMMANDS, "plan", (run[0], full, run[2]))
    fails(capsys, 1, ["plan", "qwen3-1.7b"], "No space left on device",
          "/data/run/metrics.jsonl")


@pytest.mark.parametrize("argv, code, fragment", [
    (["simulate", *EXPLICIT, "--fwd-ms", "nan"], 2, "--fwd-ms"),
    (["train", "--out-dir", "{file}"], 2, "is a file"),
])
def test_real_process_exit_code_and_no_traceback(tmp_path, argv, code, fragment):
    f = tmp_path / "f"
    f.write_text("")
    argv = [a.replace("{file}", str(f)) for a in argv]
    r = subprocess.run([sys.executable, "-m", "rotapipe", *argv], env=env(),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == code, r.stderr
    assert "Traceback" not in r.stderr and fragment in r.stderr, r.stderr
