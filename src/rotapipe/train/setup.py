"""Setting up a training job before its first step: joining the ranks, the checks every
rank must agree on, the optimizer, the evaluation set and the run's summary
(:func:`rotapipe.train.loop.train` calls them in order)."""

from __future__ import annotations

import logging
import os
import sys

import torch

from .. import distributed
from ..errors import ConfigError, DistributedError, RotapipeError
from .config import TrainConfig
from .data import Batch, count_split, eval_set
from .model import check_host_ram, folded_expert_note
from .records import describe_sources

log = logging.getLogger("rotapipe.train")


def quiet(*args, **kwargs) -> None:
    pass


def quiet_third_party() -> None:
    """``progress=False`` or no terminal: no progress bars from transformers or
    huggingface_hub either (weight loading and saving, downloads)."""
    try:
        import transformers
        transformers.utils.logging.disable_progress_bar()
    except ImportError:
        pass
    try:
        import huggingface_hub.utils
        huggingface_hub.utils.disable_progress_bars()
    except ImportError:
        pass
    # datasets (hub datasets by name) reads this when it is imported; not imported here,
    # which costs most of a second.
    if "datasets" in sys.modules:
        sys.modules["datasets"].disable_progress_bars()
    else:
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")


def epoch_steps(cfg: TrainConfig, files, tokenizer, fields) -> int:
    """Optimizer steps of ``cfg.epochs`` passes over the training split: its tokens
    over the batch's (packed), or its records over the batch (``pad``)."""
    records, tokens = count_split(files, tokenizer, holdout=cfg.holdout, fields=fields)
    per_epoch = records if cfg.packing == "pad" else -(-tokens // cfg.seq)
    return max(1, -(-cfg.epochs * per_epoch // cfg.batch))


def epochs_cut(cfg: TrainConfig, given: TrainConfig) -> bool:
    """Whether ``epochs`` cut the ``steps`` the run was given (``cfg``: the run's
    effective settings, its ``steps`` counted from the data)."""
    return given.steps is not None and cfg.epochs is not None and cfg.steps < given.steps


def eval_sequences(cfg: TrainConfig, files, eval_files, tokenizer, fields) -> Batch | None:
    """The evaluation sequences: ``eval_data`` whole, else the held-out split of the
    data; None when there are none (``holdout=0`` and no ``eval_data``)."""
    kwargs = dict(seq=cfg.seq, fields=fields, packing=cfg.packing)
    if eval_files:
        return eval_set(eval_files, tokenizer, cfg.eval_sequences, holdout=1.0,
                        what=f"eval_data {cfg.eval_data!r}", **kwargs)
    if cfg.holdout == 0:
        return None
    try:
        return eval_set(files, tokenizer, cfg.eval_sequences, holdout=cfg.holdout, **kwargs)
    except ConfigError as exc:       # a small data set whose hash split came out empty
        log.warning("%s; training without evaluation", exc)
        return None


def join(cfg: TrainConfig) -> distributed.DistInfo:
    """Under torchrun (``WORLD_SIZE`` > 1) join the gloo process group (the pipeline then
    turns data parallelism on by itself); else rank 0 of 1."""
    world = distributed.env_int("WORLD_SIZE", 1, least=1)
    if world <= 1:
        if cfg.shard.value != "none":
            raise ConfigError(f"shard={cfg.shard.value!r} splits the optimizer state across "
                              "data-parallel ranks, but this is one process: launch with "
                              "torchrun --nproc-per-node N (N >= 2; or --nnodes) -m rotapipe "
                              "train ..., or drop --shard")
        return distributed.DistInfo(0, 1, distributed.env_int("LOCAL_RANK", 0))
    if cfg.batch % world or cfg.batch < world * cfg.microbatches:
        raise ConfigError(f"batch={cfg.batch} cannot be split over {world} ranks of "
                          f"{cfg.microbatches} microbatches: use a multiple of {world} that "
                          f"is at least {world * cfg.microbatches} (the batch is global)")
    return distributed.init_from_env(timeout_s=cfg.dist_timeout)


def check_same_resume(dinfo, resume) -> None:
    """Every rank must resume from the same (rank-0-written) checkpoint."""
    if not dinfo.distributed:
        return
    step = -1 if resume is None else int(resume.name.rsplit("-", 1)[1])
    t = torch.tensor([step, -step], dtype=torch.int64)
    collective(None, "resume-step check", torch.distributed.all_reduce, t,
                op=torch.distributed.ReduceOp.MAX)
    if int(t[0]) != -int(t[1]):
        raise ConfigError(f"rank {dinfo.rank} resumes from {resume or 'step 0'} but the "
                          "ranks see different checkpoints: put out_dir on storage every "
                          "server sees, or copy rank 0's latest checkpoint to each")


def check_host_ram_everywhere(cfg: TrainConfig, tokenizer, dinfo) -> str:
    """:func:`check_host_ram` on every rank, and every rank stops when one refuses (its
    machine may have less RAM free than the others): a rank that stopped alone would
    leave the rest to load the model and then fail in their next collective, on a
    closed connection or at ``dist_timeout``."""
    try:
        ram, refusal = check_host_ram(cfg, tokenizer, dinfo.world_size,
                                      distributed.env_int("LOCAL_WORLD_SIZE", 1, least=1)), None
    except ConfigError as exc:
        ram, refusal = "", exc
    if dinfo.distributed:
        refused = torch.zeros(dinfo.world_size, dtype=torch.int32)
        refused[dinfo.rank] = refusal is not None
        collective(None, "host-RAM check", torch.distributed.all_reduce, refused)
        ranks = [r for r, no in enumerate(refused.tolist()) if no]
        if ranks and refusal is None:
            raise ConfigError(
                f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} "
                f"refused this run: the model state does not fit the host RAM there "
                "(that rank's error names the settings that fit). Every rank stops before "
                "loading; free memory on that server or shrink the state on all ranks.")
    if refusal is not None:
        raise refusal
    return ram


def make_optimizer(cfg: TrainConfig, pipe) -> torch.optim.Optimizer:
    params = list(pipe.parameters())
    if cfg.optimizer_state == "int8":          # bitsandbytes keeps 8-bit state itself
        from ..runtime.optstate import bnb_optimizer
        return bnb_optimizer(cfg.optimizer, params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             weight_decay=cfg.weight_decay)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.beta1,
                               weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             weight_decay=cfg.weight_decay, fused=True)


def describe(cfg, given, pipe, wrapped, tokenizer, files, held, setup_s, echo,
             kept: tuple[str, ...] = ()) -> None:
    """The run's summary: model, effective settings (which ones are defaults chosen for
    this kind of run, which ones ``kept`` from the checkpoint resumed), data,
    evaluation, pipeline."""
    kind = "CUDA GPU" if pipe.devices[0].torch_device.type == "cuda" else "emulated CPU"
    n = sum(pipe.layerset.params[pid].numel() for pid in pipe.host.trainable)
    what = cfg.model or f"Qwen3 from scratch ({cfg.layers} layers, hidden {cfg.dim})"
    if cfg.resume_from_adapter:
        what += f" + adapter {cfg.resume_from_adapter}"
    data = "the Python standard library's .py files" if cfg.data == "stdlib" else cfg.data
    echo(f"model: {what}, {n / 1e6:.2f}M trainable parameters{' (QLoRA)' if cfg.qlora else ' (LoRA)' if cfg.lora else ''}"
         f", vocab {len(tokenizer)}, {cfg.dtype}")
    chosen = [k for k in ("lr", "warmup", "weight_decay", "steps", "epochs")
              if getattr(given, k) is None and getattr(cfg, k) is not None
              and k not in kept]
    cut = epochs_cut(cfg, given)
    epochs = f" ({cfg.epochs} epoch{'s' if cfg.epochs != 1 else ''})" \
        if cfg.epochs and ("steps" in chosen or "steps" in kept or cut) else ""
    echo(f"settings: lr {cfg.lr:g}, warmup {cfg.warmup}, weight decay {cfg.weight_decay:g}, "
         f"{cfg.steps} steps{epochs}, batch {cfg.batch} x {cfg.seq} tokens, optimizer "
         f"{cfg.optimizer} ({cfg.optimizer_state} state)"
         + (f"; {'pretrained-model' if cfg.pretrained else 'from-scratch'} defaults: "
            f"{', '.join(k.replace('_', ' ') for k in chosen)}" if chosen else "")
         + (f"; the checkpoint's: {', '.join(kept)}" if kept else ""))
    if cut:
        passes = f"{cfg.epochs} pass{'es' if cfg.epochs != 1 else ''}"
        echo(f"note: epochs={cfg.epochs} ends the run at step {cfg.steps}, before "
             f"steps={given.steps} ({passes} over the training split: {cfg.steps} steps of "
             f"{cfg.batch} x {cfg.seq} tokens): the learning-rate schedule decays over those "
             f"{cfg.steps} steps and the last evaluation is at step {cfg.steps}; drop "
             f"--epochs to train {given.steps} steps, repeating the data")
    if held is None:
        evaluation = "no evaluation (" + ("holdout 0 and no eval_data" if not cfg.holdout
                                          else "the held-out split is empty") + ")"
    elif cfg.eval_data:
        evaluation = f"evaluation on {cfg.eval_data}: {held.ids.shape[0]} sequences"
    else:
        evaluation = f"held-out {held.ids.shape[0]} sequences"
    echo(f"data: {data} ({describe_sources(files)}), {cfg.seq}-token sequences "
         f"({cfg.packing}), {evaluation}; setup {setup_s:.1f} s")
    if cfg.holdout and (cfg.eval_data or not cfg.eval_interval):
        # Held-out records are for evaluation: here they are neither trained nor evaluated.
        why = "eval_data is evaluated instead of them" if cfg.eval_data else \
            "eval_interval=0 never evaluates"
        echo(f"note: holdout={cfg.holdout:g} keeps that share of the records of data out of "
             f"training, and {why}: they are not used at all (--holdout 0 trains on them)")
    echo(f"pipeline: {len(pipe.devices)} {kind} workers, {cfg.microbatches} microbatches "
         f"of {cfg.batch // cfg.microbatches}, plan {pipe.plan.to_text()}")
    note = folded_expert_note(wrapped.model) if cfg.lora or cfg.qlora or \
        cfg.resume_from_adapter else None
    if note:
        echo(f"note: {note}")


def collective(pipe, what: str, fn, *args, **kwargs):
    """``fn(*args)``, a collective of the trainer's own; a lost rank becomes a one-line
    :class:`DistributedError` (named through the pipeline's heartbeats when it has them)."""
    try:
        return fn(*args, **kwargs)
    except RotapipeError:
        raise
    except Exception as exc:  # noqa: BLE001 - gloo raises RuntimeError subclasses
        reducer = getattr(pipe, "data_parallel", None)
        if reducer is not None:
            raise reducer._error(max(0, reducer.issued - 1), what, exc) from None
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        raise DistributedError(f"{what} across the ranks failed on rank "
                               f"{distributed.rank()}: a rank died, hung or left. Underlying "
                               f"error: {type(exc).__name__}: {first}") from None
