"""The training job: build, (resume,) train with warmup + cosine LR and clipping,
evaluate, checkpoint, export, sample. Reads top to bottom in :func:`train`.

Every check that can fail (config, files, data lines, sequence length, a checkpoint
from another model) runs before the first step. Ctrl-C (SIGINT) finishes the current
step, saves a checkpoint and returns normally; a second Ctrl-C aborts.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import pathlib
import signal
import sys
import threading
import time

import torch

from .. import distributed
from ..errors import NonFiniteError
from .checkpoint import check_compatible, check_out_dir, is_sharded, resume_from
from .config import TrainConfig
from .data import TrainBatches
from .job import _Job
from .records import TextFields, data_changes, data_fingerprint, source_files
from .survey import check_data, check_lanes  # noqa: F401 - check_data: tests import it here
from .tokens import check_chats
from .metrics import MetricSinks, check_sinks, plot_loss, read_metrics
from .sample import check_prompts, sample_prompts
from .resume import (check_model_files, check_resume_config, restore, restore_rest,
                     restore_sharded, sharded)
from .model import (adapter_dir, build_model, build_tokenizer, check_run_ram,
                    check_sequence_length, check_weight_files, fingerprint, model_files)
from .setup import (check_host_ram_everywhere, check_same_resume, collective, describe,
                    epoch_steps, eval_sequences, join, make_optimizer, quiet,
                    quiet_third_party)

__all__ = ["train", "TrainResult"]

log = logging.getLogger("rotapipe.train")

@dataclasses.dataclass
class TrainResult:
    """What a run did: steps, held-out losses (first and last evaluation), wall time."""

    start_step: int
    step: int
    eval_first: float | None
    eval_last: float | None
    seconds: float
    tokens: int
    interrupted: bool
    checkpoint: pathlib.Path | None
    sample: str | None


def lr_factor(cfg: TrainConfig):
    """``step -> lr multiplier`` of the optimizer step with 0-based index ``step``: a
    linear warmup reaching the peak at step ``warmup - 1`` (step 0 without warmup),
    then a cosine reaching ``min_lr_ratio`` at the last step, ``steps - 1``. The cosine
    ran until ``steps`` (as transformers' ``get_cosine_schedule_with_warmup`` does, whose
    last step is above its floor): the last step trained at 0.1046 of the lr, not the
    0.1 the docs promise (24 steps, warmup 2)."""
    peak = max(cfg.warmup - 1, 0)
    def f(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        t = min(1.0, (step - peak) / max(1, cfg.steps - 1 - peak))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))
    return f


class _Stop:
    """SIGINT -> finish the step and save (installed only from the main thread)."""

    def __init__(self):
        self.requested = False
        self.agreed = False            # every rank saw a request (at a step boundary)
        self._prev = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._prev = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        log.warning("interrupted: finishing the current step, then saving (Ctrl-C again "
                    "to abort)")

    def __exit__(self, *exc):
        if self._prev is not None:
            signal.signal(signal.SIGINT, self._prev)


def train(cfg: TrainConfig, echo=print) -> TrainResult:
    """Run the job ``cfg`` describes; ``echo`` prints the progress lines."""
    given, cfg = cfg, cfg.effective()          # settings left at None filled in
    out = pathlib.Path(cfg.out_dir)
    ckdir = out / "checkpoints"
    fields = TextFields(cfg.text_field, cfg.prompt_field, cfg.response_field,
                        cfg.messages_field)
    dinfo = join(cfg)                 # torchrun: every rank runs this same job
    if not dinfo.is_main:
        echo = quiet                  # rank 0 prints, logs, checkpoints and exports

    # -- checks before any work ------------------------------------------------------
    check_out_dir(out)
    check_sinks(cfg.report_to)
    if not (cfg.progress and sys.stderr.isatty()):
        quiet_third_party()              # no weight-loading bars in a log file either
    files = source_files(cfg.data, cfg.data_config, cfg.data_split)
    survey = check_data(files, fields)
    # Before the tokenizer and the model: the training split holds a record.
    check_lanes(files, fields, batch=cfg.batch, microbatches=cfg.microbatches,
                holdout=cfg.holdout)
    eval_files = source_files(cfg.eval_data, cfg.data_config, "test", "eval_data") \
        if cfg.eval_data else None
    if eval_files:
        check_data(eval_files, fields, "eval_data")
    check_sequence_length(cfg)
    check_weight_files(cfg)
    adapter_dir(cfg)
    prompts = sample_prompts(cfg) if cfg.sample_tokens else []
    asked = [f"{n}={getattr(given, n)!r}" for n in ("sample_prompt", "sample_file",
                                                     "sample_interval")
             if getattr(given, n)]
    if not cfg.sample_tokens and asked:
        log.warning(f"{', '.join(asked)} with sample_tokens=0: no sample is written (0 new "
                    "tokens); pass --sample-tokens N (e.g. 60) to see one")
    # the newest whole checkpoint (damaged ones skipped with a warning), or None
    resume, masters, state, meta = resume_from(ckdir, cfg.resume) or (None,) * 4
    check_same_resume(dinfo, resume)
    saved = meta["config"] if resume is not None else {}
    epochs = saved.get("epochs") if given.epochs is None else cfg.epochs
    if resume is not None and given.steps is None and epochs == saved.get("epochs"):
        # Left out, the length is the saved run's (its --steps, or its count of its
        # epochs): a resume without --steps continued a --steps 100 run from scratch to
        # the default 400, on another schedule. Other --epochs are counted below, as for
        # a new run (the saved count stopped --resume --epochs 2 where epoch 1 had).
        cfg = dataclasses.replace(cfg, epochs=epochs).with_steps(int(saved["steps"]))
        kept = ("steps",) + (("epochs",) if given.epochs is None and epochs else ())
    else:
        kept = ()
    data_files = data_fingerprint(files)
    weight_files = model_files(cfg)
    if resume is not None:
        check_resume_config(resume, meta["config"], cfg)
        check_model_files(resume, meta.get("model_files"), weight_files, cfg)
        changes = data_changes(meta.get("data_files"), data_files)
        if changes:
            log.warning(f"the data files differ from those checkpoint {resume} was trained "
                        f"on ({changes}): the run resumes at its saved position in the "
                        "new data, so it is not the run that was stopped (restore the "
                        "files for an exact resume, or start a new --out-dir)")
    elif cfg.resume:
        echo(f"no checkpoint in {ckdir}: starting from step 0")

    # -- model, tokenizer, pipeline, optimizer ------------------------------------------
    t0 = time.perf_counter()
    tokenizer = build_tokenizer(cfg, files, resume / "tokenizer" if resume else None)
    # Every chat record renders with the template now, not at the step that reads it.
    check_chats(files + (eval_files or []), tokenizer, fields)
    if cfg.steps is None:                      # the schedule length from epochs
        cfg = cfg.with_steps(epoch_steps(cfg, files, tokenizer, fields))
    elif given.steps is not None and cfg.epochs is not None:
        # Both limits: the run ends at the first, so the schedule (and its warmup, when
        # chosen for the run) is as long as the run really is.
        counted = epoch_steps(cfg, files, tokenizer, fields)
        if counted < cfg.steps:
            cfg = dataclasses.replace(cfg, warmup=given.warmup).with_steps(counted)
    if cfg.warmup > cfg.steps:
        log.warning(f"warmup={cfg.warmup} is longer than the run ({cfg.steps} steps): the "
                    f"learning rate rises to {cfg.steps}/{cfg.warmup} of lr={cfg.lr:g} and "
                    f"never decays; use --warmup {cfg.steps // 10} (or at most "
                    f"{cfg.steps}) for the whole warmup and cosine")
    # Before any weight is loaded: the model state must fit the RAM available.
    ram = check_host_ram_everywhere(cfg, tokenizer, dinfo)
    model = build_model(cfg, tokenizer)
    if resume is not None:
        check_compatible(resume, meta, fingerprint(model))
    from ..adapters import wrap_hf
    wrapped = wrap_hf(model, verify="full" if cfg.verify else "tail",
                      quantize="nf4" if cfg.qlora else None)
    # A sample prompt filling the model's context fails now, not after the training.
    check_prompts(prompts, tokenizer, wrapped.config)
    pipe = wrapped.pipe(cfg.pipe_config())
    # Training mode from the first step, dropout included: from_pretrained leaves a model
    # in eval mode, and a resumed run starts without the step-0 evaluation that used to
    # switch it (a resume must train its next step as the run it continues did).
    pipe.train()
    try:
        # Before the first step allocates the rest: the whole count on this plan.
        ram_plan = None if dinfo.distributed else check_run_ram(cfg, pipe, tokenizer)
        opt = make_optimizer(cfg, pipe)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(cfg))
        # The pipeline steps the schedule after each optimizer step (overlap / stale:
        # a step is still under way when train_step returns).
        pipe.attach_optimizer(opt, scheduler=sched)
        stream = TrainBatches(files, tokenizer, batch=cfg.batch, seq=cfg.seq,
                              seed=cfg.seed, holdout=cfg.holdout, fields=fields,
                              packing=cfg.packing)
        held = eval_sequences(cfg, files, eval_files, tokenizer, fields)
        start = 0
        if resume is not None:
            if sharded(pipe) or is_sharded(resume):
                restore_sharded(pipe, model, opt, resume, masters, state)
            else:
                restore(pipe, model, opt, masters, state)
            restore_rest(pipe, sched, stream, state, cfg)
            start = int(state["step"])
            echo(f"resumed from {resume} (step {start})")
        describe(cfg, given, pipe, wrapped, tokenizer, files, held,
                 time.perf_counter() - t0, echo, kept)
        echo(ram)
        if ram_plan:
            echo(ram_plan)
        if dinfo.distributed:
            shard = "" if not sharded(pipe) else \
                f"; shard {cfg.shard.value}: each rank holds 1/{dinfo.world_size} of the " \
                f"fp32 masters and optimizer state, gradients sent in {cfg.grad_dtype}"
            echo(f"data parallel: {dinfo.world_size} ranks (torchrun), "
                 f"{cfg.batch // dinfo.world_size} sequences of the global batch per rank"
                 + shard)
        job = _Job(cfg, out, pipe, wrapped, tokenizer, opt, sched, stream, held, start,
                   state, echo)
        job.checkpoint = resume            # until this run saves one
        job.prompts = prompts
        job.data_files = data_files
        job.model_files = weight_files
        job.empty_records = survey.empty, survey.first_empty
        result = _loop(job)
    finally:
        pipe.close()
    if dinfo.distributed:              # not after an error: a broken gloo group can hang
        distributed.shutdown()
    return result


def _loop(job: _Job) -> TrainResult:
    from tqdm import tqdm

    cfg = job.cfg
    job.out.mkdir(parents=True, exist_ok=True)
    metrics_path = job.out / "metrics.jsonl"
    main = job.dist.is_main                      # torchrun: rank 0 writes metrics.jsonl
    if main:
        _truncate_metrics(metrics_path, job.start)
        _truncate_metrics(job.out / "samples.jsonl", job.start)
    evals = [(m["step"], m["eval_loss"]) for m in (read_metrics(metrics_path) if main else [])
             if "eval_loss" in m]
    t_start = time.perf_counter()
    # A bar only on a terminal: in a log file its carriage-return frames are noise, and
    # the log_every lines say the same.
    show = cfg.progress and main and sys.stderr.isatty()
    bar = tqdm(total=cfg.steps, initial=job.start, disable=not show,
               unit="step", dynamic_ncols=True, leave=False)
    if show:
        job.say = bar.write                       # lines above the bar, not through it
    pending = None
    sinks = MetricSinks(cfg.report_to if main else "none", job.out,
                        dataclasses.asdict(cfg), job.start)
    can_eval = bool(cfg.eval_interval) and job.held is not None

    def emit(r: dict) -> None:
        """Write a finished step record; progress, log line, trace."""
        step = r["step"]
        metrics.write(json.dumps(r) + "\n")
        metrics.flush()
        sinks.log(r)
        bar.set_postfix(loss=f"{r['loss']:.3f}", tok_s=f"{r['tokens_per_s']:.0f}",
                        lr=f"{r['lr']:.2e}", bubble=f"{r['bubble']:.0%}",
                        mem=f"{r['device_mem_mib']:.0f}MiB", refresh=False)
        if cfg.trace and step == min(3, cfg.steps) and job.dist.is_main:
            job.say(f"trace of step {step}: {job.write_trace()}")
        bar.update(1)
        why = ("fp16 overflow" if job.pipe.scaler.dynamic else "non-finite loss or "
               "gradient") if r["skipped"] else ""
        if step % cfg.log_every == 0 or step == 1 or why:
            job.say(f"step {step:5d}  loss {r['loss']:.4f}  lr {r['lr']:.2e}  grad norm "
                    f"{r['grad_norm']:.2f}  {r['tokens_per_s']:7.0f} tokens/s  device "
                    f"{r['device_mem_mib']:.0f} MiB" + (f"  (skipped: {why})" if why else ""))
        job.skipped_in_row = job.skipped_in_row + 1 if r["skipped"] else 0
        if job.skipped_in_row >= cfg.max_skipped_steps:
            raise NonFiniteError(
                f"{job.skipped_in_row} optimizer steps in a row were skipped ({why}, "
                f"steps {step - job.skipped_in_row + 1}..{step}): training stopped; "
                f"{job.go_back('raise --max-skipped-steps')}")

    with _Stop() as stop, open(metrics_path if main else os.devnull, "a") as metrics:
        if job.start == 0 and can_eval:
            record = {"step": 0}
            evals.append((0, job.evaluate(record)))
            metrics.write(json.dumps(record) + "\n")
            sinks.log(record)
        # torchrun: Ctrl-C reaching any rank stops every rank after the same step.
        while job.step < cfg.steps and not _stop_everywhere(stop, job.pipe):
            if cfg.epochs is not None and job.stream.epoch >= cfg.epochs:
                break
            if cfg.time_limit is not None and collective(
                    job.pipe, "time-limit check", distributed.any_rank,
                    job.elapsed >= cfg.time_limit):
                job.say(f"time limit {cfg.time_limit:g} s reached")
                break
            r = job.train_step()
            # The previous step's record is complete once this call returned (its
            # call drained meanwhile): written one step late when calls overlap.
            if pending is not None:
                emit(job.finish(pending))
            pending, step = r, r["step"]
            # The epochs limit can end the run before the counted steps (rows with no
            # label skipped, lanes of uneven length): that step is the last one too.
            epochs_done = cfg.epochs is not None and job.stream.epoch >= cfg.epochs
            last = step == cfg.steps or epochs_done
            evaluate = can_eval and (step % cfg.eval_interval == 0 or last)
            save = cfg.save_interval and step % cfg.save_interval == 0
            if evaluate or save or last:
                job.finish(r)
                if evaluate:
                    evals.append((step, job.evaluate(r)))
                emit(r)
                pending = None
            if save:
                job.save()
            if cfg.sample_interval and step % cfg.sample_interval == 0 and not last:
                job.samples()
            if epochs_done and step < cfg.steps:
                job.say(f"epochs={cfg.epochs} reached at step {step} (every row of the "
                        f"batch has been through its share of the training split), before "
                        f"the counted {cfg.steps} steps: the run ends here")
                break
        if pending is not None:
            emit(job.finish(pending))
        bar.close()
        sinks.close()
        job.say = job.echo
        if (job.step > job.start or stop.agreed) and not job.saved_now():
            job.save()
    wall = time.perf_counter() - t_start
    sample = None
    skipped = sum(s.skipped for s in job.stream.lanes)
    if skipped:
        job.echo(f"skipped {skipped} training sequences with no label to learn within "
                 f"seq={cfg.seq} (prompts longer than that; a longer --seq keeps them)")
    empty, first = job.empty_records
    if empty:
        job.echo(f"skipped {empty} empty record{'s' if empty != 1 else ''} of the data (the "
                 f"first at {first}): a blank {cfg.text_field!r} or response has nothing to "
                 "learn but the end-of-text token")
    if stop.agreed:
        job.echo(f"stopped at step {job.step}; saved {job.checkpoint}; continue with "
                 "--resume")
    else:
        if cfg.export and job.dist.is_main:
            job.export()
        sample = (job.samples() or [None])[0]
    if main and job.step > job.start:
        png = plot_loss(metrics_path, job.out / "loss.png")
        if png is not None:
            job.echo(f"loss curve: {png}")
    first, last = (evals[0][1], evals[-1][1]) if evals else (None, None)
    if evals:
        # This run's tokens over this run's training time (a resumed run too).
        tokens = job.tokens - job.tokens_at_start
        rate = tokens / job.elapsed if job.elapsed else 0.0
        which = "eval" if cfg.eval_data else "held-out"
        # The range is the evaluations' own: a run stopped (Ctrl-C, time limit, epochs)
        # after its last evaluation did not measure the loss at its last step.
        ended = "" if evals[-1][0] == job.step else \
            f" (ended at step {job.step}, not evaluated there)"
        job.echo(f"{which} loss {first:.4f} -> {last:.4f} ({100 * (last / first - 1):+.1f}%)"
                 f" over steps {evals[0][0]}..{evals[-1][0]}{ended}; {wall:.1f} s, "
                 f"{tokens} tokens, {rate:.0f} tokens/s while training")
    return TrainResult(job.start, job.step, first, last, wall, job.tokens, stop.agreed,
                       job.checkpoint, sample)


def _stop_everywhere(stop: _Stop, pipe) -> bool:
    """``stop.requested`` on any rank (one all-reduce per step under torchrun)."""
    # Decide on the agreed value only: Ctrl-C may land on one rank after the all-reduce
    # (it then counts at the next step's check, on every rank).
    stop.agreed = collective(pipe, "stop check", distributed.any_rank, stop.requested)
    return stop.agreed


def _truncate_metrics(path: pathlib.Path, step: int) -> None:
    """Drop lines after ``step`` (written by a run that died after its last checkpoint)."""
    if not path.is_file():
        return
    keep = [m for m in read_metrics(path) if m.get("step", 0) <= step] if step else []
    path.write_text("".join(json.dumps(m) + "\n" for m in keep))
