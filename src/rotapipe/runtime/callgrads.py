"""A call's gradients, staged until the whole call succeeded (:class:`CallGrads`).

Each stage's weight gradients reach the host in the compute dtype (bf16: 2 bytes per
parameter) and are summed here over the call's microbatches and stages; they are merged
into ``param.grad`` (:meth:`rotapipe.runtime.host.HostState.commit`) only when the whole
call succeeded, so a failed call changes nothing. Widened to fp32 one parameter at a
time where they are merged or stepped (:meth:`CallGrads.fp32`), so the host holds one
fp32 gradient per parameter (docs/memory.md). An embedding table a stage moved by rows
arrives as a :class:`RowGrad`.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from .pool import BlockPool

__all__ = ["CallGrads", "RowGrad"]


@dataclass(frozen=True)
class RowGrad:
    """The gradient of an embedding table a stage moved by rows
    (:class:`rotapipe.model.Lookups`): ``values[i]`` is row ``rows[i]`` of a gradient of
    ``shape``; every other row is zero (no lookup reached it)."""

    rows: torch.Tensor
    values: torch.Tensor
    shape: torch.Size

    def into(self, out: torch.Tensor, alpha: float = 1.0, first: bool = False) -> None:
        """``out += alpha * self`` (``first``: ``out`` is zero and receives the rows as
        a dense gradient would be copied in, then scaled)."""
        values = self.values.to(out.dtype)
        if first:
            out.index_copy_(0, self.rows, values)
            if alpha != 1.0:
                out.mul_(alpha)
        else:
            out.index_add_(0, self.rows, values, alpha=alpha)


class CallGrads:
    """Gradients of one call, summed over stages (tied weights) and unscaled.

    ``staged`` holds fp32 gradients. With ``keep_dtype`` (no data parallelism: the
    all-reduce works on ``staged``), a gradient that arrives in a narrower compute
    dtype is kept as it came (a pageable copy of each contribution) and widened to fp32
    only when :meth:`get` / :meth:`pop` ask for it, with the same operations (so the
    same bits) as if it had been widened on arrival: the call's gradients then cost 2
    bytes per parameter (bf16) instead of 4 until the call commits."""

    def __init__(self, inv_scale: float, keep_dtype: bool = False,
                 pool: BlockPool | None = None, bounds: bool = False):
        self.inv_scale = inv_scale
        self.staged: dict[int, torch.Tensor] = {}
        self.bounds: dict[int, float | None] | None = {} if bounds else None
        """With ``bounds``: per parameter, a bound on the magnitude of its fp32
        gradient's elements, summed over its contributions as they arrive (``inf``: one
        is not finite; ``None``: not bounded, a row gradient): :meth:`known_finite`
        then decides finiteness without a pass over the fp32 gradient."""
        self.keep_dtype = keep_dtype
        self.pool = pool
        """Where gradients widened on arrival are allocated (:attr:`HostState.grad_pool`:
        the storages of the last step's, once nothing holds them); ``None``: new ones."""
        self.parts: dict[int, list[torch.Tensor]] = {}
        """Compute-dtype contributions per parameter (``keep_dtype``), summed in fp32
        when read."""
        self._widen: torch.Tensor | None = None
        """The reused buffer narrow gradients are widened into (``reuse=True``): a new
        tensor per parameter pays its page faults every call, several times the cast
        itself (benchmarks/host_grads.py). Dropped by :meth:`clear`."""
        self._lock = threading.Lock()

    # -- reading (fp32) --------------------------------------------------------------
    def pids(self) -> list[int]:
        with self._lock:
            return list(self.staged) + list(self.parts)

    def narrow(self, pid: int) -> bool:
        """Whether ``pid``'s gradient is kept in the compute dtype (each :meth:`get`
        widens it into a new tensor; ``staged`` ones are returned themselves)."""
        return pid in self.parts

    def get(self, pid: int, reuse: bool = False) -> torch.Tensor | None:
        """The fp32 gradient of ``pid`` (``None``: none arrived). A narrow one is
        widened into a new tensor, or with ``reuse`` into the call's one reused buffer
        (the result is then valid until the next such read: for a caller that reads
        it once)."""
        with self._lock:
            g, parts = self.staged.get(pid), self.parts.get(pid)
        if parts is None:
            return g
        with torch.no_grad():
            # The operations CallGrads.add's fp32 path runs on arrival, in its order.
            first = parts[0]
            out = self._buffer(first.shape) if reuse else None
            if isinstance(first, RowGrad):
                g32 = torch.zeros(first.shape, dtype=torch.float32) if out is None \
                    else out.zero_()
                first.into(g32, self.inv_scale, first=True)
            else:
                g32 = (torch.empty(first.shape, dtype=torch.float32) if out is None
                       else out).copy_(first)
                if self.inv_scale != 1.0:
                    g32.mul_(self.inv_scale)
            for more in parts[1:]:
                if isinstance(more, RowGrad):
                    more.into(g32, self.inv_scale)
                else:
                    g32.add_(more, alpha=self.inv_scale)
        return g32

    def pop(self, pid: int, reuse: bool = False) -> torch.Tensor | None:
        """:meth:`get`, then forget ``pid``."""
        g = self.get(pid, reuse)
        self.discard(pid)
        return g

    def _buffer(self, shape: torch.Size) -> torch.Tensor:
        """A view of the reused widening buffer, sized at first use for the largest
        narrow gradient."""
        n = shape.numel()
        if self._widen is None or self._widen.numel() < n:
            with self._lock:
                most = max([p[0].shape.numel() for p in self.parts.values()], default=0)
            self._widen = torch.empty(max(n, most), dtype=torch.float32)
        return self._widen[:n].view(shape)

    def discard(self, pid: int) -> None:
        with self._lock:
            self.staged.pop(pid, None)
            self.parts.pop(pid, None)
            if self.bounds is not None:
                self.bounds.pop(pid, None)

    def clear(self) -> None:
        with self._lock:
            self.staged.clear()
            self.parts.clear()
            if self.bounds is not None:
                self.bounds.clear()
        self._widen = None

    def fp32(self) -> Mapping[int, torch.Tensor]:
        """A read-only mapping pid -> fp32 gradient that widens each one when read (a
        pass over it holds one widened gradient at a time)."""
        return _Widened(self)

    def checked(self) -> Mapping[int, torch.Tensor]:
        """:meth:`fp32` for one look at each gradient (the finiteness check): narrow
        ones are widened into the reused buffer, so a value read is valid until the
        next read."""
        return _Widened(self, reuse=True)

    def known_finite(self, pid: int) -> bool | None:
        """Whether every element of ``pid``'s fp32 gradient is finite, from the bounds
        taken on arrival: ``True``, ``False``, or ``None`` when they cannot tell (not
        tracked, a row gradient, or contributions so large that their fp32 sum might
        overflow: check the gradient itself)."""
        if self.bounds is None:
            return None
        with self._lock:
            b = self.bounds.get(pid)
        if b is None:
            return None
        if b == math.inf:
            return False
        return True if b < _SAFE_BOUND else None

    def _bound(self, pid: int, grad: torch.Tensor | RowGrad) -> None:
        """Add ``grad``'s contribution to ``pid``'s bound (``bounds``): the largest
        magnitude of its elements (one reduction over the arriving dtype, cheaper than
        a norm of the widened gradient), times the unscaling."""
        if isinstance(grad, RowGrad):
            peak = None           # rows may repeat in a contribution: not bounded here
        elif grad.numel() == 0:
            peak = 0.0
        else:
            lo, hi = torch.aminmax(grad)
            lo, hi = abs(lo.item()), abs(hi.item())
            peak = math.inf if math.isnan(lo) or math.isnan(hi) else \
                max(lo, hi) * abs(self.inv_scale)
        with self._lock:
            prev = self.bounds.get(pid, 0.0)        # None: already unbounded
            self.bounds[pid] = None if peak is None or prev is None else prev + peak

    # -- arrival (host lane) ---------------------------------------------------------
    def add(self, pid: int, grad: torch.Tensor | RowGrad) -> None:
        if self.bounds is not None:
            self._bound(pid, grad)
        rows = isinstance(grad, RowGrad)
        dtype = grad.values.dtype if rows else grad.dtype
        if self.keep_dtype and dtype != torch.float32:
            # A pageable copy: the download buffer is page-locked and reused.
            if rows:
                copy = RowGrad(grad.rows, torch.empty_like(grad.values, device="cpu")
                               .copy_(grad.values), grad.shape)
            else:
                copy = torch.empty(grad.shape, dtype=grad.dtype).copy_(grad)
            with self._lock:
                self.parts.setdefault(pid, []).append(copy)
            return
        with self._lock, torch.no_grad():
            cur = self.staged.get(pid)
            if rows:
                if cur is None:
                    cur = self.staged[pid] = torch.zeros(grad.shape, dtype=torch.float32)
                    grad.into(cur, self.inv_scale, first=True)
                else:
                    grad.into(cur, self.inv_scale)
            elif cur is None:
                if grad.dtype == torch.float32 and self.inv_scale == 1.0:
                    self.staged[pid] = grad
                else:
                    g32 = (torch.empty(grad.shape, dtype=torch.float32) if self.pool is None
                           else self.pool.empty(grad.shape, torch.float32)).copy_(grad)
                    self.staged[pid] = g32.mul_(self.inv_scale) if self.inv_scale != 1.0 \
                        else g32
            else:
                cur.add_(grad, alpha=self.inv_scale)


_SAFE_BOUND = torch.finfo(torch.float32).max / 4
"""Below this the fp32 sum of a parameter's contributions cannot overflow (a wide
margin over the rounding of the sum and of the unscaling)."""


class _Widened(Mapping):
    def __init__(self, grads: CallGrads, reuse: bool = False):
        self.grads, self.reuse = grads, reuse

    def __getitem__(self, pid: int) -> torch.Tensor:
        g = self.grads.get(pid, self.reuse)
        if g is None:
            raise KeyError(pid)
        return g

    def __iter__(self) -> Iterator[int]:
        return iter(self.grads.pids())

    def __len__(self) -> int:
        return len(self.grads.pids())
