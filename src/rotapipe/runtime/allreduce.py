"""Gradient all-reduce across data-parallel ranks, overlapped with the backward.

One :class:`GradReducer` per pipeline (this module); one :class:`CallReduce` per
training call (``callreduce.py``; backpressure, :class:`InFlight`, is ``inflight.py``'s;
both importable from here):

1. :meth:`GradReducer.global_sum` all-reduces the call's loss units (samples, or
   ``loss_weight`` items) before any work, so every rank weights microbatch ``m`` by
   ``units_m / global_units`` and the summed gradients are the global mean.
2. The host lane's optimizer hand-off (``O`` action) of each stage calls
   :meth:`CallReduce.handoff`: the stage's parameters whose *last* hand-off of the
   schedule this is are copied into flat fp32 buckets (at most ``bucket_mb`` each) and
   all-reduced (SUM) asynchronously, while shallower stages still run backward. A tied
   weight is handed off by two stages; it is reduced once, with the later hand-off,
   after the host summed both contributions (reducing each would be exact too, but
   costs twice the bytes).
3. :meth:`CallReduce.finish` waits for every bucket and points the call's staged
   gradients at the reduced buffers; the pipeline then commits them as usual.

Backpressure (:class:`InFlight`, ``DataParallelConfig.inflight_mb``): a hand-off waits
for older buckets while the buffers in flight would pass the cap, and the workers'
backward waits once ``2 x workers`` stages queue behind the host lane, so a slow link
costs time instead of host memory.

Ordering (why no tags are needed): gloo matches collectives by issue order. Every rank
runs the same schedule, so its host lane issues the same buckets in the same order; the
caller-thread collectives (units, loss) are issued only while no bucket is in flight.
The pipeline checks at construction that every rank has the same plan and parameters
(and the same weights and seed: :mod:`rotapipe.pipe.consistency`).

A parameter that got no gradient on one rank (an MoE expert no token reached) still
takes part, as zeros; a presence flag per parameter rides in the bucket so that a
parameter no rank touched keeps ``grad=None``, as in a one-process run.

Failure: every wait polls against a deadline (``timeout_s``) instead of trusting the
process group's timeout; a gloo error or the deadline raises
:class:`~rotapipe.errors.DistributedError`, which names the lost rank(s) found by the
:class:`Heartbeat` monitor (a rank whose heartbeat stopped died; one whose heartbeat
runs but that never issued the collective hung or left the loop).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ..config import DataParallelConfig
from ..errors import ConfigError, DistributedError
from ..schedule import ActionKind as K, Schedule
from .callreduce import CallReduce, ReduceStats, interval_union
from .heartbeat import Heartbeat
from .callgrads import CallGrads
from .inflight import InFlight

__all__ = ["CallReduce", "GradReducer", "InFlight", "ReduceStats", "collectives_in_flight",
           "interval_union"]

_LIVE: weakref.WeakSet = weakref.WeakSet()
"""Every live :class:`GradReducer` of the process, for :func:`collectives_in_flight`
(what the process-exit hook of :func:`rotapipe.distributed.init_from_env` asks)."""


def collectives_in_flight() -> int:
    """How many collectives the process's pipelines issued that have not completed (a
    call that failed leaves those its peers never joined)."""
    return sum(r.in_flight() for r in list(_LIVE))


class GradReducer:
    """Data-parallel collectives of one pipeline (see the module docstring)."""

    def __init__(self, config: DataParallelConfig, group, fingerprint: str,
                 shapes: dict[int, torch.Size], params_of: Callable[[str], Sequence[int]],
                 agree=None):
        self.config, self.group = config, group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.members = dist.get_process_group_ranks(group) if group is not None \
            else list(range(self.world))
        self._shapes, self._params_of = shapes, params_of
        self._layouts: dict[int, tuple[Schedule, dict[str, list[list[int]]]]] = {}
        self.issued = 0          # collectives issued so far (published by the heartbeat)
        self.broken: str | None = None
        self.last = ReduceStats()
        self.cap_bytes = int(config.inflight_bytes)
        """Buffers of collectives a rank keeps in flight (:class:`InFlight`)."""
        self.stage_limit: int | None = None
        """Stages whose backward may run ahead of their hand-off (:class:`InFlight`;
        the pipeline sets ``2 x workers``); ``None``: the backward never waits."""
        self.aborted: Callable[[], bool] = lambda: False
        """True once the call in flight failed (the pipeline sets it)."""
        self.last_gate: InFlight | None = None
        """The backpressure counters of the last training call."""
        self._stage_of: dict[str, str] = {}
        self._works: dict[int, object] = {}
        """Collective number -> its work, until :meth:`_wait` saw it complete."""
        _LIVE.add(self)
        token = f"{time.time_ns()}-{id(self)}"
        self._heartbeat = Heartbeat.start(dist.get_rank(), config.heartbeat_s, self)
        gathered: list = [None] * self.world
        try:
            # agree (pipe.consistency.WeightCheck): weights' checksums, seed; compared below
            agree = agree if self.world > 1 else None
            dist.all_gather_object(gathered, (fingerprint, token, agree and agree.payload()),
                                   group=group)
        except Exception as exc:  # noqa: BLE001 - gloo and NCCL raise RuntimeErrors
            self.close()
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            raise DistributedError(
                f"data parallelism's start-up check (the same model, plan and precision on "
                f"every rank) failed on rank {dist.get_rank()}: another rank exited or "
                "hung before building its pipeline, and its own output says why. Restart "
                f"the job. Underlying error: {type(exc).__name__}: {first}") from None
        bad = [self.members[r] for r, (fp, *_) in enumerate(gathered) if fp != gathered[0][0]]
        if bad:
            # The heartbeat has not written yet (no prefix) and never will: ranks that
            # fail here exit at once, and a thread left inside a store call that the
            # exited rank 0 served would abort this process at interpreter exit.
            self.close()
            raise ConfigError(
                f"data parallelism needs the same model, plan and precision on every rank, "
                f"but rank(s) {bad} differ from rank {self.members[0]}:\n  rank "
                f"{self.members[0]}: {gathered[0][0]}\n  rank {bad[0]}: "
                f"{gathered[self.members.index(bad[0])][0]}\nuse the same PipeConfig "
                "(workers, stages, precision) and model on every rank")
        try:
            if agree is not None:
                agree.compare([g[2] for g in gathered], self.members)
        except ConfigError:
            self.close()       # as above: before the heartbeat writes
            raise
        if self._heartbeat is not None:
            self._heartbeat.prefix = f"rotapipe/{gathered[0][1]}"

    @classmethod
    def create(cls, config: DataParallelConfig, group, *args) -> GradReducer | None:
        """The reducer ``config`` asks for, or ``None`` when data parallelism is off."""
        if config.enabled is False:
            return None
        ready = dist.is_available() and dist.is_initialized()
        if not ready:
            if config.enabled:
                raise ConfigError("data_parallel.enabled=True but no torch.distributed "
                                  "process group is initialized: launch with torchrun and "
                                  "call rotapipe.distributed.init_from_env() first")
            return None
        if config.enabled is None and dist.get_world_size(group) == 1:
            return None
        backend = str(dist.get_backend(group))
        if "gloo" not in backend and "mpi" not in backend:
            raise ConfigError(f"the process group's backend is {backend!r}, but gradients "
                              "live in host memory: initialize it with backend='gloo' (or "
                              "'cpu:gloo,cuda:nccl'), as rotapipe.distributed.init_from_env "
                              "does")
        return cls(config, group, *args)

    # -- caller-thread collectives ------------------------------------------------------
    def global_sum(self, value: float | list[float], what: str) -> float | list[float]:
        """Sum of ``value`` (or of each of a list: one all-reduce) over the ranks
        (float64), waited with the deadline."""
        self.check()
        t = torch.tensor(value if isinstance(value, list) else [value], dtype=torch.float64)
        seq = self.issued
        work = self._launch(t)
        self._wait(work, seq, what)
        return t.tolist() if isinstance(value, list) else float(t.item())

    def gather(self, tensor: torch.Tensor, what: str) -> list[torch.Tensor]:
        """Every rank's 1-D ``tensor`` (as long on each), in group order."""
        self.check()
        n, W = tensor.numel(), self.world
        out = torch.empty(n * W, dtype=tensor.dtype)
        work, seq = self.exchange(out, tensor.repeat(W), [n] * W, [n] * W)
        self._wait(work, seq, what)
        return list(out.split(n))

    def begin(self, schedule: Schedule, grads: CallGrads) -> CallReduce:
        self.check()
        return CallReduce(self, self._layout(schedule), grads, self.gate(schedule))

    def gate(self, schedule: Schedule | None = None) -> InFlight:
        """A call's :class:`InFlight` (``schedule=None``: the collectives of a whole
        step, issued by the caller: no backward to hold). The backward waits only on
        the generated RoundPipe schedules, where a worker finishes one backward stage
        before it starts the next (a user schedule may interleave stages on a worker,
        and could then wait for a hand-off that needs itself)."""
        stages, order = None, None
        if schedule is not None and schedule.name in ("roundpipe", "roundpipe-stale"):
            stages, order = self.stage_limit, {}
            for a in schedule.actions:
                if a.kind is K.OPTIMIZER:
                    order.setdefault(a.stage, len(order))
        self.last_gate = InFlight(self.cap_bytes, stages, order, self.aborted)
        return self.last_gate

    def stage_of(self, key: str) -> str | None:
        """The stage of an ``O`` action key (of a schedule seen by :meth:`_layout`)."""
        return self._stage_of.get(key)

    def check(self) -> None:
        if self.broken:
            raise DistributedError(self.broken)

    def fail(self, why: str) -> None:
        """Retire data parallelism for this pipeline: the ranks are out of step. The
        other ranks' diagnosis then reads why this one left (:meth:`Heartbeat.mark`)."""
        if self.broken is None:
            self.broken = (f"a previous call failed on rank {dist.get_rank()} ({why}), so "
                           "the ranks' collectives are out of step: restart the job from "
                           "the last checkpoint")
            if self._heartbeat is not None:
                self._heartbeat.mark(f"its own call failed ({why})")

    def in_flight(self) -> int:
        """Collectives issued and not complete (pruning the completed ones)."""
        for seq, work in list(self._works.items()):
            if work.is_completed():
                self._works.pop(seq, None)
        return len(self._works)

    def close(self) -> None:
        if self._heartbeat is not None:
            if self.broken is None:
                self._heartbeat.mark("its pipeline was closed")
            self._heartbeat.stop()

    # -- internals ----------------------------------------------------------------------
    def _layout(self, schedule: Schedule) -> dict[str, list[list[int]]]:
        """O action key -> buckets of parameter ids it reduces (cached per schedule)."""
        cached = self._layouts.get(id(schedule))
        if cached is not None and cached[0] is schedule:
            return cached[1]
        handoffs = [a for a in schedule.actions if a.kind is K.OPTIMIZER]
        self._stage_of.update((a.key, a.stage) for a in handoffs)
        last: dict[int, str] = {}
        for a in handoffs:
            for pid in self._params_of(a.stage):
                last[pid] = a.key
        limit = max(1, int(self.config.bucket_mb * 2**20) // 4)
        layout: dict[str, list[list[int]]] = {}
        for a in handoffs:
            buckets, size = [], limit
            for pid in self._params_of(a.stage):
                if last.get(pid) != a.key:
                    continue
                n = self._shapes[pid].numel()
                if size + n > limit and (not buckets or buckets[-1]):
                    buckets.append([])
                    size = 0
                buckets[-1].append(pid)
                size += n
            layout[a.key] = [b for b in buckets if b]
        self._layouts[id(schedule)] = (schedule, layout)
        return layout

    def _launch(self, tensor: torch.Tensor):
        try:
            work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group,
                                   async_op=True)
        except Exception as exc:  # noqa: BLE001 - gloo raises RuntimeError subclasses
            raise self._error(self.issued, "starting an all-reduce", exc) from exc
        self._works[self.issued] = work
        self.issued += 1
        return work

    def exchange(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int],
                 in_splits: list[int]) -> tuple[object, int]:
        """Start an asynchronous ``all_to_all_single`` (the sharded modes' reduce-scatter
        and all-gather, :mod:`rotapipe.runtime.shard`); return ``(work, seq)`` for
        :meth:`_wait`."""
        seq = self.issued
        try:
            work = dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group,
                                          async_op=True)
        except Exception as exc:  # noqa: BLE001 - gloo raises RuntimeError subclasses
            raise self._error(seq, "starting an all-to-all", exc) from exc
        self._works[seq] = work
        self.issued += 1
        return work, seq

    def _wait(self, work, seq: int, what: str) -> None:
        """Wait for ``work`` (collective number ``seq``) with the deadline."""
        deadline = time.monotonic() + self.config.timeout_s
        hb = self._heartbeat
        while not work.is_completed():
            gone = hb.left_before(seq) if hb is not None else []
            if gone:
                # A rank that left the loop (its call failed, its pipeline closed)
                # before issuing this collective never will: fail now, not at the
                # timeout (the diagnosis reads why it left).
                raise self._error(seq, what, RuntimeError(
                    f"rank(s) {gone} left the collectives before issuing this one"))
            if time.monotonic() > deadline:
                raise self._error(seq, what, TimeoutError(
                    f"not complete after {self.config.timeout_s:g} s "
                    "(data_parallel.timeout_s)"))
            time.sleep(0.0005)
        self._works.pop(seq, None)
        try:
            work.wait()
        except Exception as exc:  # noqa: BLE001 - gloo's errors are RuntimeErrors
            raise self._error(seq, what, exc) from exc

    def _error(self, seq: int, what: str, exc: BaseException) -> DistributedError:
        lost, why = self._heartbeat.diagnose(seq) if self._heartbeat is not None else \
            ([], "no rendezvous store to tell which rank")
        self.fail(f"{what} failed")
        who = ", ".join(f"rank {r}" for r in lost) if lost else "an unidentified rank"
        return DistributedError(
            f"data-parallel {what} (collective #{seq}) failed on rank {dist.get_rank()}: "
            f"{who} lost. {why}. Underlying error: {type(exc).__name__}: "
            f"{str(exc).strip()[:500]}", lost_ranks=tuple(lost))
