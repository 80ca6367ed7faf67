"""Bad values for every kind of config field are refused at construction.

Each case asserts the exception type (:class:`rotapipe.ConfigError`) and a message that
names the field, the value and what is allowed; NaN and inf are refused wherever a
number is; enums given as strings are accepted by value (any case). Issue 15, item 2.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

import rotapipe
from rotapipe import (BackendKind, ConfigError, DataParallelConfig, OptimizerMode,
                      PartitionMode, PinMode, PipeConfig, PrecisionConfig, RecomputeGrain)
from rotapipe.train import TrainConfig, load_config
from train_util import deadline

NAN, INF = float("nan"), float("inf")


@pytest.fixture(autouse=True)
def bounded():
    """Every case ends within 20 s: a hang fails the test instead of the run."""
    with deadline(20.0):
        yield


def refused(make, *fragments):
    """``make()`` raises ConfigError whose message holds every fragment (literally)."""
    with pytest.raises(ConfigError) as info:
        make()
    message = str(info.value)
    for f in fragments:
        assert f in message, f"{f!r} not in {message!r}"
    assert "\n" not in message
    return message


# -- PipeConfig ----------------------------------------------------------------------------

@pytest.mark.parametrize("field, value, allowed", [
    ("timeout_s", NAN, "finite number of seconds > 0"),
    ("timeout_s", INF, "finite number of seconds > 0"),
    ("timeout_s", -1.0, "finite number of seconds > 0"),
    ("timeout_s", "10", "(got str)"),
    ("device_memory", "8GiB", "whole number of bytes > 0"),
    ("device_memory", NAN, "whole number of bytes > 0"),
    ("device_memory", 1.5, "whole number of bytes"),
    ("microbatches", True, "an int in [1, 65,536] (got bool)"),
    ("microbatches", "4", "an int in [1, 65,536] (got str)"),
    ("workers", True, "an int in [1, 256] (one worker per GPU; an emulated worker runs a "
                      "thread per stream) or None (got bool)"),
    ("workers", 0, "an int in [1, 256]"),
    ("workers", 100_000, "an int in [1, 256]"),
    ("forward_stages", 2.0, "positive int or None"),
    ("prefetch", "2", "int >= 1"),
    ("seed", "x", "int >= 0 (got str)"),
    ("seed", -1, "int >= 0"),
    ("check_races", "no", "True or False"),
    ("gate_copies", 1, "True or False"),
    ("copy_chunk_mb", INF, "chunk size in MiB > 0"),
    ("copy_chunk_mb", "32", "chunk size in MiB > 0"),
    ("clip_grad_norm", NAN, "finite norm > 0"),
    ("grain", 3, "'stage', 'layer'"),
    ("backend", "tpu", "'auto', 'cuda', 'emulated'"),
    ("optimizer_mode", "later", "'sync', 'overlap', 'stale'"),
    ("partition", None, "'auto', 'even', 'refine'"),
    ("pin", "locked", "'copy', 'register', 'off'"),
    ("precision", 42, "PrecisionConfig"),
])
def test_pipe_config_field_refused(field, value, allowed):
    refused(lambda: PipeConfig(**{field: value}), f"{field}={value!r}", allowed)


def test_pipe_config_enums_by_value_in_any_case():
    c = PipeConfig(grain="Layer", backend=" EMULATED ", optimizer_mode="STALE",
                   partition="even", pin="Off")
    assert (c.grain, c.backend, c.optimizer_mode, c.partition, c.pin) == (
        RecomputeGrain.LAYER, BackendKind.EMULATED, OptimizerMode.STALE, PartitionMode.EVEN,
        PinMode.OFF)
    assert isinstance(c.grain, RecomputeGrain)      # a member, not the string
    # a dtype is shorthand for the precision; an integral float of bytes becomes an int
    c = PipeConfig(precision="bf16", device_memory=8e9)
    assert c.precision == PrecisionConfig(compute_dtype=torch.bfloat16)
    assert c.device_memory == 8_000_000_000 and isinstance(c.device_memory, int)


def test_replace_revalidates():
    import dataclasses
    good = PipeConfig(timeout_s=5.0)
    refused(lambda: dataclasses.replace(good, timeout_s=NAN), "timeout_s=nan")
    assert good.timeout_s == 5.0                    # the original is untouched


# -- DataParallelConfig and PrecisionConfig -------------------------------------------------

@pytest.mark.parametrize("field, value, allowed", [
    ("bucket_mb", "25", "MiB > 0 (got str)"),
    ("bucket_mb", INF, "MiB > 0"),
    ("timeout_s", INF, "seconds > 0"),
    ("heartbeat_s", NAN, "seconds > 0"),
])
def test_data_parallel_field_refused(field, value, allowed):
    refused(lambda: DataParallelConfig(**{field: value}),
            f"data_parallel.{field}={value!r}", allowed)


@pytest.mark.parametrize("field, value, allowed", [
    ("init_scale", NAN, "finite number > 0"),
    ("init_scale", "65536", "finite number > 0 (got str)"),
    ("loss_scale", INF, "'dynamic', a finite number > 0, or None"),
    ("loss_scale", NAN, "'dynamic', a finite number > 0, or None"),
    ("loss_scale", True, "(got bool)"),
    ("growth_interval", 2.5, "positive int"),
    ("growth_interval", True, "positive int (steps) (got bool)"),
    ("compute_dtype", 16, "compute_dtype=16 is not supported"),
])
def test_precision_field_refused(field, value, allowed):
    refused(lambda: PrecisionConfig(**{field: value}), f"{field}=", allowed)


def test_precision_strings_by_value():
    p = PrecisionConfig(compute_dtype="FP16", loss_scale="Dynamic")
    assert p.compute_dtype == torch.float16 and p.loss_scale == "dynamic"


# -- TrainConfig -----------------------------------------------------------------------------

@pytest.mark.parametrize("field, value, allowed", [
    ("lr", NAN, "finite number > 0"),
    ("lr", INF, "finite number > 0"),
    ("lr", "1e-3", "(got str)"),
    ("beta1", 1.0, "in [0, 1)"),
    ("beta2", NAN, "in [0, 1)"),
    ("weight_decay", -0.1, ">= 0"),
    ("min_lr_ratio", NAN, "in [0, 1]"),
    ("lora_alpha", INF, "> 0"),
    ("grad_clip", NAN, "finite norm > 0, or 0"),
    ("time_limit", NAN, "seconds > 0 or None"),
    ("dist_timeout", INF, "seconds > 0"),
    ("holdout", INF, "fraction in [0, 1)"),
    ("heads", True, "(got bool)"),
    ("steps", 10.0, "positive int"),
    ("data", "", "non-empty string"),
    ("out_dir", " ", "non-empty string"),
    ("model", 3, "(got int)"),
    ("export", "no", "True or False"),
    ("resume", "yes", "'auto'"),
    ("dtype", "int8", "'fp32', 'bf16' or 'fp16'"),
    ("backend", "tpu", "'auto', 'cuda', 'emulated'"),
    ("grain", "block", "'stage', 'layer'"),
    ("optimizer", "adam", "'adamw' or 'sgd'"),
    ("optimizer_mode", "async", "'sync', 'overlap', 'stale'"),
])
def test_train_config_field_refused(field, value, allowed):
    refused(lambda: TrainConfig(**{field: value}), f"{field}={value!r}", allowed)


def test_train_config_relations():
    refused(lambda: TrainConfig(heads=4, kv_heads=3), "heads=4", "kv_heads=3")
    refused(lambda: TrainConfig(sample_prompt="", sample_tokens=5), "sample_prompt=''")
    assert TrainConfig(sample_prompt="", sample_tokens=0).sample_tokens == 0


def test_train_config_strings_by_value():
    cfg = TrainConfig(optimizer="AdamW", optimizer_mode="Overlap", backend="Emulated",
                      grain="LAYER", dtype="BF16", resume="auto")
    assert (cfg.optimizer, cfg.optimizer_mode) == ("adamw", "overlap")
    pipe = cfg.pipe_config()
    assert (pipe.backend, pipe.grain, pipe.precision.compute_dtype) == (
        BackendKind.EMULATED, RecomputeGrain.LAYER, torch.bfloat16)


def test_config_file_values_are_checked_the_same(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text("lr = nan\n")
    refused(lambda: load_config(f), "lr=nan", "finite number > 0")
    f.write_text('steps = "10"\n')
    refused(lambda: load_config(f), "'steps'", "'10'", "int")
    f.write_text('resume = "auto"\n')
    assert load_config(f).resume == "auto"
    f.write_bytes(bytes(range(128, 256)))
    refused(lambda: load_config(f), str(f), "not UTF-8 text")
    j = tmp_path / "run.json"
    j.write_text("[1, 2]")
    refused(lambda: load_config(j), str(j), "list, not a table")


def test_messages_name_field_value_and_allowed():
    """The format every field check shares: ``field=value: use <allowed>``."""
    msg = refused(lambda: TrainConfig(lr=NAN), "lr=nan")
    # None: the run chooses (a pretrained model gets another default than from scratch)
    assert re.fullmatch(r"lr=nan: use a finite number > 0 or None", msg), msg
    msg = refused(lambda: PipeConfig(device_memory="8GiB"))
    assert re.fullmatch(r"device_memory='8GiB': use a whole number of bytes > 0 .* or None "
                        r"\(got str\)", msg), msg
    assert math.isnan(NAN)      # (the constants are what the cases think they are)


# -- empty batches (the validation layer before torch.split) ------------------------------------

def test_empty_batch_is_an_input_error_and_changes_nothing():
    from models import emulated, lm_loss, tiny_transformer, token_batch
    torch.manual_seed(0)
    with rotapipe.RoundPipe(tiny_transformer(), lm_loss, config=emulated(2, 4)) as pipe:
        x, y = token_batch(4, 5)
        before = {k: v.clone() for k, v in pipe.state_dict().items()}
        with pytest.raises(rotapipe.InputError, match=r"inputs hold an empty batch \(dimension "
                                                      r"0 has size 0\)"):
            pipe(x[:0])
        with pytest.raises(rotapipe.InputError, match="empty batch"):
            pipe.forward_backward(x[:0], y[:0])
        assert pipe.calls == 0 and all(p.grad is None for p in pipe.parameters())
        after = pipe.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        # a clean call afterwards matches the plain model
        ref = pipe._container(x)
        assert torch.allclose(pipe(x), ref, atol=1e-5)
