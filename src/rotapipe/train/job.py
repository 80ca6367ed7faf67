"""One training run's live objects and what each step does with them: train a step,
finish its record, evaluate, checkpoint (sharded or not), sample, export. The order of a
run (what happens when) is :func:`rotapipe.train.loop.train`'s.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import random
import time

import torch
import torch.nn.functional as F

from .. import distributed
from ..errors import NonFiniteError
from ..sim.report import report
from .checkpoint import save_checkpoint, save_sharded_checkpoint
from .data import Batch
from .records import IGNORE
from .sample import generate_sample
from .resume import masters_in_model, pipe_names, sharded
from .model import fingerprint
from .setup import collective

__all__ = ["evaluate"]


EVAL_LOGITS = 1 << 28
"""Logit elements (1 GiB in fp32) one evaluation call returns at most: the held-out rows
go through the pipeline in chunks of that many, their losses summed."""


def evaluate(pipe, wrapped, ids, labels: torch.Tensor | None = None) -> float:
    """Mean next-token loss over the counted evaluation tokens (``ids``: a
    :class:`~rotapipe.train.data.Batch`, or token ids with ``labels``).

    The rows go through the pipeline in chunks of at most :data:`EVAL_LOGITS` logits
    (at least one row), and each row's cross-entropy is summed in fp32: all the logits
    at once, with their fp32 copy and log-softmax, took 4x their size (18 GiB for
    Qwen3's vocabulary at the default 64 sequences of 128 tokens)."""
    batch = ids if isinstance(ids, Batch) else Batch(ids, labels)
    n, seq = batch.ids.shape
    vocab = getattr(getattr(wrapped, "config", None), "vocab_size", None) or 1
    chunk = max(1, EVAL_LOGITS // (seq * vocab))
    total = torch.zeros((), dtype=torch.float64)
    pipe.eval()
    try:
        for start in range(0, n, chunk):
            part = batch.rows(start, min(n, start + chunk))
            logits = pipe(part.inputs())                           # [rows, seq, vocab]
            for row, target in zip(logits, part.labels):
                total += F.cross_entropy(row[:-1].float(), target[1:], ignore_index=IGNORE,
                                         reduction="sum").double()
            del logits
    finally:
        pipe.train()
    counted = int((batch.labels[:, 1:] != IGNORE).sum())
    return (total / counted).item() if counted else float("nan")

class _Job:
    """The live objects of a run, and its steps: train, evaluate, save, finish."""

    def __init__(self, cfg, out, pipe, wrapped, tokenizer, opt, sched, stream, held, start,
                 state, echo):
        self.cfg, self.out, self.pipe, self.wrapped = cfg, out, pipe, wrapped
        self.tokenizer, self.opt, self.sched, self.stream = tokenizer, opt, sched, stream
        self.held, self.start, self.step, self.echo = held, start, start, echo
        self.tokens = int(state["tokens"]) if state else 0
        self.tokens_at_start = self.tokens
        self.elapsed = 0.0                           # seconds spent in training steps (this run)
        self.checkpoint: pathlib.Path | None = None
        self.skipped_in_row = 0                      # optimizer steps skipped in a row
        self.say = echo
        self.dist = distributed.info()               # rank, world size (1 without torchrun)
        self.prompts: list[str] = []                 # sample prompts
        self.data_files: dict = {}                   # records.data_fingerprint, for meta.json
        self.model_files: dict = {}                  # model.model_files, for meta.json
        self.empty_records: tuple[int, str | None] = (0, None)  # skipped, the first's place

    def train_step(self) -> dict:
        """One optimizer step; its metrics."""
        cfg, pipe = self.cfg, self.pipe
        t = time.perf_counter()
        batch = self.stream.next()                                   # [batch, seq] each
        ids = batch.ids
        x, y = batch.inputs(), batch.labels    # torchrun: this rank's rows of the global batch
        if self.dist.distributed:
            x, y = distributed.shard_batch((x, y), self.dist.rank, self.dist.world_size)
        pipe.reset_peak_memory()
        lr = self.sched.get_last_lr()[0]
        scale = pipe.scaler.scale
        # The pipeline clips (config.clip_grad_norm) and reports the norm, in every
        # optimizer mode; without clipping the norm is measured here (sync only).
        if cfg.optimizer_mode == "sync" and not cfg.grad_clip and sharded(pipe):
            loss = pipe.forward_backward(x, y)
            stepped = pipe.step()              # measures the global norm across the ranks
            norm = pipe._shard.last_global_norm
        elif cfg.optimizer_mode == "sync" and not cfg.grad_clip:
            loss = pipe.forward_backward(x, y)                       # the global mean
            norm = torch.nn.utils.clip_grad_norm_(list(pipe.parameters()), float("inf")).item()
            stepped = pipe.step()
        else:
            # overlap / stale: the call returns with its loss while its backward drains;
            # the step's learning rate, norm and outcome are read when the record is
            # written (finish).
            loss = pipe.train_step(x, y)
            norm, stepped = None, None
        self.step += 1
        self.tokens += ids.numel()
        dt = time.perf_counter() - t
        self.elapsed += dt
        mem = max(pipe.peak_memory(), default=0) / 2**20
        self.timeline = pipe.last_timeline()   # the forward_backward call, measured
        bubble = report(self.timeline, ids.numel()).bubble.total if self.timeline else 0.0
        return {"step": self.step, "loss": loss, "lr": lr, "grad_norm": norm,
                "tokens": self.tokens, "tokens_per_s": ids.numel() / dt,
                "device_mem_mib": round(mem, 2), "bubble": round(bubble, 4),
                "loss_scale": scale, "skipped": None if stepped is None else not stepped,
                "elapsed_s": round(self.elapsed, 3), "_call": pipe.calls - 1}

    def finish(self, record: dict) -> dict:
        """The record of a step whose call has completed: its gradient norm and whether
        it was skipped (pipelined calls: known only once the call drained)."""
        call = record.pop("_call")
        if record["grad_norm"] is None:
            result = self.pipe.step_result(call)
            record["lr"] = result.lrs[0]
            record["grad_norm"] = float("nan") if result.grad_norm is None else result.grad_norm
            record["skipped"] = result.skipped
        record["loss_scale"] = self.pipe.scaler.scale
        return record

    def write_trace(self) -> str:
        """Chrome/Perfetto trace and timeline PNG of the last step's pipeline call."""
        from ..sim.gantt import draw_gantt
        from ..sim.trace import write_trace
        trace = write_trace(self.timeline, self.out / "trace.json")
        png = draw_gantt(self.timeline, self.out / "timeline.png",
                         title=f"rotapipe train, step {self.step} (measured)")
        return f"{trace} {png}"

    def evaluate(self, record: dict) -> float:
        loss = evaluate(self.pipe, self.wrapped, self.held)
        record.update(eval_loss=loss, eval_ppl=math.exp(min(loss, 50.0)))
        which = "eval" if self.cfg.eval_data else "held-out"
        self.say(f"eval  step {self.step:5d}  {which} loss {loss:.4f}  perplexity "
                 f"{record['eval_ppl']:.1f}")
        return loss

    def save(self) -> None:
        # Stale optimizer: every rank applies its pending step before the state is read.
        self.pipe.flush()
        if sharded(self.pipe):
            return self._save_sharded()
        if not self.dist.is_main:                    # rank 0 writes; the others wait for it
            self.checkpoint = self.out / "checkpoints" / f"step-{self.step:08d}"
            collective(self.pipe, "checkpoint barrier", distributed.barrier)
            return
        pipe, model = self.pipe, self.wrapped.model
        state = {"step": self.step, "tokens": self.tokens, "optimizer": self.opt.state_dict(),
                 "scheduler": self.sched.state_dict(), "pipe": pipe.pipeline_state(),
                 "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
                 "data": self.stream.state_dict()}
        meta = {"step": self.step, "plan": pipe.plan.to_text(),
                "fingerprint": fingerprint(model), "config": dataclasses.asdict(self.cfg),
                "data_files": self.data_files, "model_files": self.model_files}
        masters = {n: p for n, p in model.named_parameters() if p.requires_grad}
        bad = [n for n, p in masters.items() if not torch.isfinite(p).all()]
        if bad:
            raise NonFiniteError(
                f"the weights are not finite at step {self.step} ({bad[0]}"
                + (f" and {len(bad) - 1} more" if len(bad) > 1 else "") + "): no "
                f"checkpoint written; {self.go_back()}")
        self.checkpoint = save_checkpoint(self.out / "checkpoints", self.step,
                                          masters=masters, state=state, meta=meta,
                                          tokenizer=self.tokenizer, keep=self.cfg.keep)
        # no rank reads a half-written one
        collective(self.pipe, "checkpoint barrier", distributed.barrier)

    def _save_sharded(self) -> None:
        """Every rank writes its shard of the masters and optimizer state; rank 0 the
        consolidated fp32 masters and the shared state (``save_sharded_checkpoint``)."""
        pipe, model = self.pipe, self.wrapped.model
        shard = distributed.shard_state_dict(pipe, self.opt)
        bad = [n for n, piece in shard["pieces"].items()
               if not torch.isfinite(piece["master"]).all()]
        if collective(pipe, "finite-weights check", distributed.any_rank, bool(bad)):
            raise NonFiniteError(
                f"the weights are not finite at step {self.step}"
                + (f" ({bad[0]} on this rank)" if bad else " (on another rank)") + ": no "
                f"checkpoint written; {self.go_back()}")
        state = {"step": self.step, "tokens": self.tokens,
                 "optimizer": {"sharded": self.dist.world_size},
                 "scheduler": self.sched.state_dict(), "pipe": pipe.pipeline_state(),
                 "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
                 "data": self.stream.state_dict()}
        meta = {"step": self.step, "plan": pipe.plan.to_text(),
                "fingerprint": fingerprint(model), "config": dataclasses.asdict(self.cfg),
                "shards": self.dist.world_size, "data_files": self.data_files,
                "model_files": self.model_files}
        self.checkpoint = save_sharded_checkpoint(
            self.out / "checkpoints", self.step, shard=shard, names=pipe_names(pipe, model),
            state=state, meta=meta, tokenizer=self.tokenizer, keep=self.cfg.keep,
            is_main=self.dist.is_main,
            barrier=lambda: collective(pipe, "checkpoint barrier", distributed.barrier))

    def samples(self) -> list[str]:
        """Sample every prompt with the current weights (rank 0); print them and append
        them to out_dir/samples.jsonl."""
        if not self.prompts:
            return []
        # Pipelined calls drained, the masters current: on every rank, so that the ranks'
        # steps stay in lockstep (stale: the pending step is applied, as evaluation does).
        self.pipe.flush()
        if not self.dist.is_main:
            return []
        cfg, out = self.cfg, []
        how = "greedy" if not cfg.temperature else \
            f"temperature {cfg.temperature:g}, top-p {cfg.top_p:g}"
        chat = " as the user's message" if getattr(self.tokenizer, "chat_template",
                                                    None) else ""
        with open(self.out / "samples.jsonl", "a") as f:
            for prompt in self.prompts:
                text = generate_sample(self.wrapped, self.tokenizer, cfg, prompt)
                f.write(json.dumps({"step": self.step, "prompt": prompt, "sample": text})
                        + "\n")
                self.say(f"sample at step {self.step} ({how}, prompt {prompt!r}{chat}):\n"
                         f"{text}")
                out.append(text)
        return out

    def go_back(self, fix: str = "") -> str:
        """Where a stopped run goes on from, for its error: the last checkpoint (this
        run's, or the one it resumed from), or a new start when there is none."""
        ways = ["Lower --lr", "check the data"] + ([fix] if fix else [])
        fix = ", ".join(ways[:-1]) + " or " + ways[-1]
        if self.checkpoint is None:
            return f"there is no checkpoint to go back to. {fix}, and start again"
        return f"the last one is {self.checkpoint}. {fix}, and resume from it"

    def saved_now(self) -> bool:
        return self.checkpoint is not None and \
            self.checkpoint.name == f"step-{self.step:08d}"

    def export(self) -> None:
        final = self.out / "final"
        if sharded(self.pipe):
            # The model's trainable weights are the compute-dtype copies: export the
            # fp32 masters, as an unsharded run does, from the last checkpoint's
            # consolidated masters (always written at the end of a run).
            with masters_in_model(self.wrapped.model, self.out / "checkpoints"):
                self.wrapped.save_pretrained(str(final))
        else:
            self.wrapped.save_pretrained(str(final))
        self.tokenizer.save_pretrained(str(final))
        self.echo(f"exported {'LoRA adapter' if self.cfg.lora or self.cfg.qlora else 'model'} to {final}")
