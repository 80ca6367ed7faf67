"""The optimizer work of one training call of a sharded data-parallel pipeline
(:class:`ShardCall`): its reduce-scatters at the host lane's hand-offs, ``overlap``'s
per-stage steps and all-gathers, the commit and the undo. The pipeline-wide state and
the collectives are :class:`~rotapipe.runtime.shard.ShardedOptimizer`'s."""

from __future__ import annotations

import typing

import torch

from ..config import OptimizerMode, ShardMode
from ..errors import NonFiniteError
from ..schedule import Schedule
from .callgrads import CallGrads
from .host import own_step
from .stepping import Cost, Snapshot, merged, partly_stepped

if typing.TYPE_CHECKING:
    from .shard import ShardedOptimizer, _Exchange

__all__ = ["ShardCall"]


class ShardCall:
    """The optimizer work of one training call of a sharded pipeline (the
    :class:`~rotapipe.runtime.stepping.CallHook` interface: :meth:`handoff` on the host
    lane, :meth:`commit` once the call is complete, :meth:`abort` when it failed)."""

    def __init__(self, owner: ShardedOptimizer, optimizer, schedule: Schedule,
                 grads: CallGrads, units: float, step: bool, cost: Cost, view: int | None):
        self.o, self.opt, self.grads, self.units = owner, optimizer, grads, units
        self.step, self.cost, self.view = step, cost, view
        self.layout = owner.r._layout(schedule)      # O action key -> buckets (pids)
        self.gate = owner.r.gate(schedule)           # backpressure (InFlight)
        total = owner.samples + units
        self.keep, self.new = owner.samples / total, units / total
        self.sends = owner.shard is ShardMode.GRADIENTS or step
        self.per_stage = step and owner.mode is OptimizerMode.OVERLAP and not owner.whole_step
        self.sent: list[_Exchange] = []
        self.gathers: list[_Exchange] = []
        self.queue: list[_Exchange] = []       # both kinds, in issue order
        self.reduced: dict[int, torch.Tensor] = {}
        self.prev: dict[int, torch.Tensor | None] | None = None
        self.snapshots: list[Snapshot] = []
        self.changed: str | None = None
        """Set when the whole step raised part-way (:meth:`commit`): what stays, for
        the failure's report (``CallStream._fail`` then calls :meth:`keep_changes`)."""

    def _source(self, pid: int) -> torch.Tensor | None:
        """What this rank sends for ``pid``: the call's gradient (``gradients``), or the
        local sum since the last step (``optimizer``). The staged copy is dropped once
        it is in the send buffer."""
        g = self.grads.staged.pop(pid, None)
        if self.o.shard is ShardMode.OPTIMIZER:
            return merged(self.o.local.get(pid), g, self.keep, self.new)
        return g

    def _final(self, pid: int) -> torch.Tensor | None:
        """The step's gradient of this rank's piece of ``pid``."""
        if self.o.shard is ShardMode.OPTIMIZER:
            return self.reduced.get(pid)        # already merged before it was sent
        prev = self.prev.get(pid) if self.prev is not None else self.o.masters[pid].grad
        return merged(prev, self.reduced.get(pid), self.keep, self.new)

    def handoff(self, key: str) -> None:
        try:
            if self.sends:
                self._handoff(key)
        finally:
            self.gate.leave(self.o.r.stage_of(key))

    def _complete_oldest(self) -> bool:
        """Complete the oldest collective of the call still in flight (a reduce-scatter
        is collected, an all-gather landed): :class:`InFlight`'s ``wait_oldest``."""
        x = next((x for x in self.queue if not x.done), None)
        if x is None:
            return False
        if x.views:
            self.o._land([x])
        else:
            self.o._collect([x], self.reduced)
        return True

    def _handoff(self, key: str) -> None:
        sent = []
        for pids in self.layout.get(key, ()):
            self.gate.admit(self.o._scatter_bytes(pids), self._complete_oldest)
            x = self.o._scatter(pids, self._source)
            x.gate = self.gate
            sent.append(x)
            self.queue.append(x)
        self.sent += sent
        if self.per_stage and sent:
            self.o._collect(sent, self.reduced)
            self._step_pieces([pid for x in sent for pid in x.pids])
        else:
            self.o._collect(self.sent, self.reduced, ready_only=True)

    def _step_pieces(self, pids: list[int]) -> None:
        """overlap: step the pieces completed at this hand-off, start their all-gather."""
        o = self.o
        if self.prev is None:     # earlier calls' pieces must not be stepped with them
            self.prev = {pid: q.grad for pid, q in o.masters.items()}
            for q in o.masters.values():
                q.grad = None
        stepped = {}
        for pid in pids:
            if pid in o.masters:
                g = self._final(pid)
                if g is not None:
                    stepped[pid] = g
        if stepped and not all(torch.isfinite(torch.linalg.vector_norm(g))
                               for g in stepped.values()):
            # Per-stage steps see this rank's pieces only, and skipping needs every
            # rank to agree: the call fails here (its peers then fail naming this rank).
            raise NonFiniteError(
                f"rank {o.r.rank}: a gradient piece is not finite (overlap steps each "
                "stage's pieces as they land, so the step cannot be skipped on every "
                "rank alike; with clipping on, or optimizer_mode sync/stale, the global "
                "check applies nonfinite='skip')")
        if stepped:
            qs = [o.masters[pid] for pid in stepped]
            self.snapshots.append(Snapshot(self.opt, qs, list(stepped)))
            for pid, q in zip(stepped, qs):
                q.grad = stepped[pid]
            try:
                with own_step():
                    self.opt.step()
            finally:
                for q in qs:
                    q.grad = None
            if self.cost is not None:
                self.cost(list(stepped))
        # Every rank gathers the same buckets, stepped here or not.
        views = [self.view] if self.view is not None else list(range(len(o.host.views)))
        self.gate.admit(o._gather_bytes(pids, views), self._complete_oldest)
        x = o._gather(pids, views)
        x.gate = self.gate
        self.gathers.append(x)
        self.queue.append(x)

    def commit(self) -> None:
        o = self.o
        if self.sends:
            o._collect(self.sent, self.reduced)
        if not self.step:
            with torch.no_grad():
                if o.shard is ShardMode.GRADIENTS:
                    for pid, q in o.masters.items():
                        q.grad = self._final(pid)
                else:
                    for pid in o.host.trainable:
                        g = merged(o.local.get(pid), self.grads.staged.get(pid),
                                    self.keep, self.new)
                        if g is not None:
                            o.local[pid] = g
            o.samples += self.units
            o.show_grads()
            return
        if self.per_stage:
            o._land(self.gathers)
            o.latest = self.view if self.view is not None else 0
            o.scaler.update(False)
            o.last_norm, o.last_skipped = None, False
            o.zero_grad()
            self.snapshots = []
            return
        for pid, q in o.masters.items():
            q.grad = self._final(pid)
        o.local.clear()
        broken = o.r.broken
        try:
            o._whole_step(self.opt, self.cost, self.view)
        except BaseException:
            if o.r.broken is not None and broken is None:    # _keep_partial_step
                self.changed = partly_stepped(o.max_norm is not None) + \
                    " (on this rank's pieces; data parallelism is retired)"
            raise

    def keep_changes(self) -> None:
        """After a whole step raised part-way: this rank's compute copies already
        follow its pieces (:meth:`ShardedOptimizer._keep_partial_step`)."""

    def abort(self) -> None:
        """Undo the pieces stepped during the call and put the accumulated gradients
        back. The ranks are out of step after a failure (data parallelism is retired):
        the compute copies of other ranks' pieces are not restored."""
        o = self.o
        for snap in reversed(self.snapshots):
            snap.restore()
        with torch.no_grad():
            for snap in self.snapshots:
                for pid in snap.pids:
                    a, b = o.layout.range(pid)
                    for view in o.host.views:
                        view[pid].view(-1)[a:b].copy_(o.masters[pid].detach())
        o.host.settle([pid for snap in self.snapshots for pid in snap.pids])
        self.snapshots = []
        if self.prev is not None:
            for pid, g in self.prev.items():
                o.masters[pid].grad = g
