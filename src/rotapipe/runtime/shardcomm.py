"""The collectives of the sharded host optimizer (``shard.py``): which elements of each
parameter a rank owns (:class:`ShardLayout`), the bytes it sent (:class:`Traffic`), and
the reduce-scatter of gradients and all-gather of updated weights, bucket by bucket, at
most the in-flight cap at once (:class:`ShardCollectives`). Why they are all-to-alls,
and when they run, is in ``shard.py``'s module docstring."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .inflight import InFlight

__all__ = ["ShardCollectives", "ShardLayout", "Traffic"]


class ShardLayout:
    """Which elements of each trainable parameter each rank owns (module docstring)."""

    def __init__(self, numels: dict[int, int], world: int, rank: int):
        self.world, self.rank = world, rank
        self.bounds = {pid: [j * n // world for j in range(world + 1)]
                       for pid, n in numels.items()}

    def range(self, pid: int, rank: int | None = None) -> tuple[int, int]:
        """``[start, end)`` of rank ``rank``'s piece (default: this rank's)."""
        j = self.rank if rank is None else rank
        b = self.bounds[pid]
        return b[j], b[j + 1]

    def length(self, pid: int, rank: int | None = None) -> int:
        a, b = self.range(pid, rank)
        return b - a


@dataclass
class Traffic:
    """Bytes this rank sent to other ranks (its own piece excluded), since the last
    :meth:`ShardedOptimizer.reset_traffic`."""

    scatter_bytes: int = 0
    """Gradients (reduce-scatter)."""
    gather_bytes: int = 0
    """Updated weights (all-gather)."""
    collectives: int = 0

    @property
    def total(self) -> int:
        return self.scatter_bytes + self.gather_bytes


@dataclass
class _Exchange:
    """One bucket's all-to-all in flight."""

    pids: list[int]
    out: torch.Tensor
    work: object
    seq: int
    what: str
    done: bool = field(default=False)
    nbytes: int = 0
    """Its send and receive buffers (what :class:`InFlight` counts)."""
    gate: InFlight | None = None
    views: list[int] = field(default_factory=list)


class ShardCollectives:
    """The reduce-scatters and all-gathers of :class:`~rotapipe.runtime.shard.
    ShardedOptimizer` (a base class of it; :class:`~rotapipe.runtime.shardcall.ShardCall`
    calls them per call). They read the optimizer's ``r`` (the
    :class:`~rotapipe.runtime.allreduce.GradReducer`), ``layout``, ``host``,
    ``grad_dtype``, ``masters`` and ``buckets``, and count in ``traffic`` and
    ``last_step_gate``."""

    def _bounded(self, issues: list[tuple[int, object]], complete) -> list[_Exchange]:
        """Issue ``(bytes, start)`` collectives in order, keeping at most the cap in
        flight (:class:`InFlight`): before one that would pass it, ``complete(x)`` the
        oldest. Returns them all (the caller completes the rest)."""
        gate = InFlight(self.r.cap_bytes)
        out: list[_Exchange] = []

        def oldest() -> bool:
            x = next((x for x in out if not x.done), None)
            if x is None:
                return False
            complete(x)
            return True

        for nbytes, start in issues:
            gate.admit(nbytes, oldest)
            x = start()
            x.gate = gate
            out.append(x)
        self.last_step_gate = gate
        return out

    def _scatter_bytes(self, pids: list[int]) -> int:
        """Send and receive buffer bytes of :meth:`_scatter` of ``pids``."""
        W = self.layout.world
        total = sum(self.host.layerset.params[pid].numel() for pid in pids) + W * len(pids)
        mine = sum(self.layout.length(pid) for pid in pids) + len(pids)
        return (total + W * mine) * self.grad_dtype.itemsize

    def _gather_bytes(self, pids: list[int], views: list[int]) -> int:
        """Send and receive buffer bytes of :meth:`_gather` of ``pids``."""
        W = self.layout.world
        size = self._gather_dtype(pids, views).itemsize
        mine = sum(self.layout.length(pid) for pid in pids)
        total = sum(self.host.layerset.params[pid].numel() for pid in pids)
        return (W * mine + total) * size

    def _scatter(self, pids: list[int], source) -> _Exchange:
        """Start the reduce-scatter of ``source(pid)`` (a full fp32 gradient or ``None``)
        for ``pids``; a presence flag per parameter rides along, so a parameter no rank
        has a gradient for keeps none."""
        W, lay = self.layout.world, self.layout
        grads = [source(pid) for pid in pids]
        present = torch.tensor([float(g is not None) for g in grads])
        chunks = []
        for j in range(W):
            parts = []
            for pid, g in zip(pids, grads):
                a, b = lay.range(pid, j)
                parts.append(g.reshape(-1)[a:b] if g is not None else torch.zeros(b - a))
            chunks.append(torch.cat(parts + [present]))
        splits = [c.numel() for c in chunks]
        inp = torch.cat(chunks).to(self.grad_dtype)
        mine = sum(lay.length(pid) for pid in pids) + len(pids)
        out = torch.empty(W * mine, dtype=self.grad_dtype)
        work, seq = self.r.exchange(out, inp, [mine] * W, splits)
        size = inp.element_size()
        self.traffic.scatter_bytes += (sum(splits) - splits[lay.rank]) * size
        self.traffic.collectives += 1
        return _Exchange(pids, out, work, seq,
                         f"gradient reduce-scatter of {len(pids)} parameters",
                         nbytes=(inp.numel() + out.numel()) * size)

    def _collect(self, sent: list[_Exchange], into: dict | None = None,
                 ready_only: bool = False) -> dict:
        """Wait for reduce-scatters (``ready_only``: take only those complete now);
        ``{pid: this rank's piece of the summed gradient}`` (fp32; absent where no rank
        had a gradient). A collected exchange drops its receive buffer (``W`` times
        the pieces), so at most the buckets in flight hold one."""
        into = {} if into is None else into
        W = self.layout.world
        for x in sent:
            if x.done or (ready_only and not x.work.is_completed()):
                continue
            self.r._wait(x.work, x.seq, x.what)
            total = x.out.view(W, -1).sum(0, dtype=torch.float32)   # rank order, fp32
            flags = total[total.numel() - len(x.pids):]
            off = 0
            for k, pid in enumerate(x.pids):
                n = self.layout.length(pid)
                if flags[k] > 0 and n > 0:
                    into[pid] = total[off:off + n]
                off += n
            x.done, x.out, x.work = True, None, None
            if x.gate is not None:
                x.gate.release(x.nbytes)
        return into

    def _gather(self, pids: list[int], views: list[int]) -> _Exchange:
        """Start the all-gather of this rank's pieces of ``pids`` into the sets of
        compute copies ``views`` (finished by :meth:`_land`)."""
        W, lay = self.layout.world, self.layout
        dtype = self._gather_dtype(pids, views)
        mine = [self.masters[pid].detach().to(dtype) if pid in self.masters
                else torch.empty(0, dtype=dtype) for pid in pids]
        send = torch.cat(mine)
        splits = [sum(lay.length(pid, i) for pid in pids) for i in range(W)]
        out = torch.empty(sum(splits), dtype=dtype)
        work, seq = self.r.exchange(out, send.repeat(W), splits, [send.numel()] * W)
        self.traffic.gather_bytes += send.numel() * send.element_size() * (W - 1)
        self.traffic.collectives += 1
        return _Exchange(pids, out, work, seq, f"weight all-gather of {len(pids)} parameters",
                         nbytes=(W * send.numel() + out.numel()) * send.element_size(),
                         views=views)

    def _gather_dtype(self, pids: list[int], views: list[int]) -> torch.dtype:
        """The dtype ``pids`` are all-gathered in: their compute copies', the widest of
        them (a tensor kept in fp32 beside bf16 ones, ``RoundPipe(keep_fp32=)``, must
        not land rounded)."""
        dtypes = {self.host.views[views[0]][pid].dtype for pid in pids}
        return max(dtypes, key=lambda d: d.itemsize)

    def _land(self, gathers: list[_Exchange]) -> None:
        """Wait for all-gathers and copy every rank's pieces into the compute copies."""
        lay = self.layout
        with torch.no_grad():
            for x in gathers:
                if x.done:
                    continue
                self.r._wait(x.work, x.seq, x.what)
                off = 0
                for i in range(lay.world):
                    for pid in x.pids:
                        a, b = lay.range(pid, i)
                        for v in x.views:
                            self.host.views[v][pid].view(-1)[a:b].copy_(x.out[off:off + b - a])
                        off += b - a
                x.done, x.out, x.work = True, None, None
                if x.gate is not None:
                    x.gate.release(x.nbytes)

    def _publish(self, views: list[int]) -> None:
        """All-gather every bucket into ``views``, at most the cap in flight."""
        self._land(self._bounded(
            [(self._gather_bytes(pids, views), lambda pids=pids: self._gather(pids, views))
             for pids in self.buckets], lambda x: self._land([x])))
