"""Resuming a training run: what a checkpoint must share with the run that resumes it,
and how its masters, optimizer state, scheduler, counters and random states come back
(unsharded, sharded and resharded); the consolidated masters swapped into the model
for an export. Used by :mod:`rotapipe.train.loop`.
"""

from __future__ import annotations

import contextlib
import logging
import pathlib
import random

import torch

from .. import distributed
from ..errors import CheckpointError, ConfigError
from .checkpoint import is_sharded, latest_checkpoint, load_shards
from .config import TrainConfig
from .records import data_changes

__all__ = ["RESUME_FIXED", "check_resume_config", "check_model_files", "restore",
           "restore_sharded", "restore_rest", "apply_settings", "sharded", "pipe_names",
           "masters_in_model"]

RESUME_FIXED = ("model", "layers", "dim", "heads", "kv_heads", "ffn", "vocab",
                "tokenizer_bytes", "lora", "qlora", "lora_rank", "lora_alpha", "lora_targets",
                "resume_from_adapter", "data", "data_config", "data_split", "text_field",
                "prompt_field", "response_field", "messages_field", "seq", "packing",
                "holdout", "batch", "seed", "optimizer", "optimizer_state")
"""Fields a resumed run must share with its checkpoint (the rest may change, e.g. steps)."""

log = logging.getLogger("rotapipe.train")

_SAVED_DEFAULTS = {"optimizer_state": "fp32"}
"""What a checkpoint written before a ``RESUME_FIXED`` field existed had."""


def check_resume_config(path, saved: dict, cfg: TrainConfig) -> None:
    for name in RESUME_FIXED:
        value = saved.get(name, _SAVED_DEFAULTS.get(name))
        if value != getattr(cfg, name):
            flag = "--" + name.replace("_", "-")
            how = (f"pass {flag}" if value else f"pass --no-{flag[2:]}") \
                if isinstance(value, bool) else f"leave out {flag}" if value is None \
                else f"pass {flag} {value}"
            raise ConfigError(f"checkpoint {path} was written with {name}={value!r}, this "
                              f"run has {getattr(cfg, name)!r}: {how} to resume it, or use "
                              "a new out_dir")


def check_model_files(path, saved, now: dict, cfg: TrainConfig) -> None:
    """The pretrained model's files (:func:`rotapipe.train.model.model_files`) must be
    those checkpoint ``path`` was trained on (``saved``, its ``meta.json``'s
    ``model_files``; a checkpoint from before they were kept is not checked). With LoRA
    the checkpoint holds the adapter alone and the frozen base comes from these files:
    other weights under the same name would continue the adapter on another model,
    silently, so the resume is refused. Without LoRA every weight comes from the
    checkpoint, and a changed ``config.json`` gets a warning."""
    changes = data_changes(saved, now)
    if changes is None:
        return
    what = f"the model files differ from those checkpoint {path} was trained on ({changes})"
    if cfg.uses_lora or cfg.qlora:
        raise ConfigError(f"{what}: the checkpoint holds the LoRA adapter alone, trained on "
                          "the frozen weights of those files, so resuming on these trains it "
                          "on another model: restore the model files (the same revision), "
                          "or start a new --out-dir (--resume-from-adapter with an exported "
                          "adapter continues it on another base on purpose)")
    log.warning(f"{what}: the weights come from the checkpoint, but a changed config.json "
                "changes the model (restore the files for an exact resume)")


def restore(pipe, model, opt, masters, state) -> None:
    """Masters and optimizer state of an unsharded checkpoint into an unsharded run
    (the rest: :func:`restore_rest`)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in masters:
                p.copy_(masters[name])
    pipe.host.write_back()               # compute-dtype copies follow the masters
    opt.load_state_dict(state["optimizer"])


def sharded(pipe) -> bool:
    """Whether ``pipe`` shards its optimizer state (``TrainConfig.shard``, torchrun)."""
    return getattr(pipe, "_shard", None) is not None


def pipe_names(pipe, model) -> dict[str, str]:
    """``{pipeline parameter name: the model's (Hugging Face) name}`` of the trainable
    parameters (a tied weight under its first name, as ``named_parameters`` gives)."""
    ls = pipe.layerset
    by_id = {id(p): pid for pid, p in enumerate(ls.params)}
    return {ls.param_names[by_id[id(p)]]: n for n, p in model.named_parameters()
            if id(p) in by_id}


def restore_sharded(pipe, model, opt, path, masters, state) -> None:
    """Masters and optimizer state from a sharded checkpoint (every rank's shard, cut
    for this run's world size and sharding: resharding), or from an unsharded one into
    a sharded run."""
    if is_sharded(path):
        try:
            shards = load_shards(path, mmap=True)
        except CheckpointError as exc:
            raise CheckpointError(f"{exc}; resuming needs every rank's shard: put out_dir "
                                  "on storage every server sees") from None
    else:
        hf = {v: k for k, v in pipe_names(pipe, model).items()}
        shards = [distributed.shard_from_state(
            pipe, {name: masters[hf[name]] for name in hf}, state["optimizer"])]
    distributed.load_shard_state_dicts(pipe, opt, shards)


def restore_rest(pipe, sched, stream, state, cfg: TrainConfig) -> None:
    """Scheduler, pipeline counters, RNG states, data cursor (the same on every rank);
    then this run's optimizer settings (:func:`apply_settings`)."""
    sched.load_state_dict(state["scheduler"])
    apply_settings(sched, cfg)
    pipe.load_pipeline_state(state["pipe"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(_tuples(state["rng"]["python"]))
    stream.load_state_dict(state["data"])


def apply_settings(sched, cfg: TrainConfig) -> None:
    """The learning rate, weight decay and betas of this run, not the checkpoint's:
    loading the optimizer's and the scheduler's state brings back the settings they
    were saved with, and a resume may change them (e.g. a lower --lr after a loss
    spike). The schedule's position is kept; its shape (warmup, decay) is this run's."""
    opt = sched.optimizer
    for group in opt.param_groups:
        group["initial_lr"] = cfg.lr
        group["weight_decay"] = cfg.weight_decay
        if "betas" in group:
            group["betas"] = (cfg.beta1, cfg.beta2)
        elif "momentum" in group:
            group["momentum"] = cfg.beta1
    sched.base_lrs = [cfg.lr] * len(opt.param_groups)
    for group, base, factor in zip(opt.param_groups, sched.base_lrs, sched.lr_lambdas):
        group["lr"] = base * factor(sched.last_epoch)
    sched._last_lr = [g["lr"] for g in opt.param_groups]


def _tuples(x):
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


@contextlib.contextmanager
def masters_in_model(model, ckdir: pathlib.Path):
    """The latest checkpoint's consolidated fp32 masters in ``model``'s trainable
    parameters for the block (the compute copies back after it)."""
    from safetensors import safe_open
    path = latest_checkpoint(ckdir)
    swapped = []
    try:
        with safe_open(str(path / "masters.safetensors"), framework="pt") as f:
            keys = set(f.keys())
            for name, p in model.named_parameters():
                if name in keys:
                    swapped.append((p, p.data))
                    p.data = f.get_tensor(name)
        yield
    finally:
        for p, data in swapped:
            p.data = data
