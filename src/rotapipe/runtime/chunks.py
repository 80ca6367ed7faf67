"""Weight uploads and weight-gradient downloads as chunks the executor issues gated.

A stage's weights move layer by layer; layer ``l`` in ``layer_chunks(bytes_l,
chunk_bytes)`` near-equal byte ranges over the concatenation of its tensors
(``transfer.split_bytes``). The first chunk of a layer allocates its device tensors
(and uploads its buffers, a few bytes); the last chunk of the stage hands the stage's
weights to the worker's store. A split upload (``UW`` then ``UT``,
``rotapipe.schedule.roundpipe``) moves the frozen tensors and the buffers first and
the trained tensors after the optimizer's hand-off; the ``UT``'s last chunk adds them
to the stage's weights in the store. Under timed emulation the chunk count and each chunk's
duration follow the emulated layer's bytes, exactly as the simulator's
(``rotapipe.sim.ActionTimes``).

Pageable weights (``PipeConfig(pin="off")``) go through a device's pinned bounce
buffers: on the dispatcher thread a chunk's bytes are copied into a free buffer (one
whose last copy's event completed), then the stream copies from it. A copy engine
never reads pageable memory (on CUDA such a copy would be synchronous).

An embedding table a stage uses only for lookups (:class:`rotapipe.model.Lookups`)
moves by rows: the call's distinct looked-up rows are gathered on the dispatcher thread
into the bounce buffers (a gather is never page-locked), uploaded into a compact device
buffer and scattered into a table whose other rows are NaN; its gradient's download
gathers the same rows on the device and hands the host a
:class:`~rotapipe.runtime.callgrads.RowGrad`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..plan import StageKind
from ..schedule import Action, ActionKind as K
from .backend import Device
from .executor import Chunk
from .callgrads import RowGrad
from .transfer import layer_chunks, sleep_until, split_bytes

__all__ = ["ChunkedCopies", "BouncePool"]


def _row_bytes(t: torch.Tensor) -> int:
    """Bytes of one row (dim 0) of a table."""
    return math.prod(t.shape[1:]) * t.element_size()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes."""
    return t.reshape(-1).view(torch.uint8)


class BouncePool:
    """A device's pinned bounce buffers: ``count`` of them, grown to the largest chunk
    asked for. ``empty(nbytes) -> uint8 tensor`` allocates page-locked memory."""

    def __init__(self, empty: Callable[[int], torch.Tensor], count: int = 2):
        self._empty = empty
        self._buffers: list[torch.Tensor | None] = [None] * count
        self._events: list[object] = [None] * count

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self._buffers if b is not None)

    def free(self) -> int | None:
        """Index of a buffer no copy still reads, or ``None``."""
        for i, ev in enumerate(self._events):
            if ev is None or ev.query():
                return i
        return None

    def take(self, i: int, nbytes: int) -> torch.Tensor:
        buf = self._buffers[i]
        if buf is None or buf.numel() < nbytes:
            buf = self._buffers[i] = self._empty(nbytes)
        self._events[i] = _Taken()
        return buf[:nbytes]

    def used_until(self, i: int, event) -> None:
        """Buffer ``i`` is read by the copy before ``event``."""
        self._events[i] = event


class _Taken:
    """Placeholder event of a buffer being filled (never free)."""

    def query(self) -> bool:
        return False


class ChunkedCopies:
    """Builds the :class:`~rotapipe.runtime.executor.Chunk` lists of one pipeline's
    weight uploads and weight-gradient downloads (the :class:`ActionRunner` owns it).

    ``layer_bytes`` / ``trained_bytes``: under timed emulation, the emulated layers'
    weight bytes and trained bytes (the chunk counts of uploads and of split uploads'
    trained parts follow them; the chunk durations come from the runner's ``timing``);
    ``pinned(pid)``: whether parameter ``pid``'s compute copy is page-locked;
    ``pinned_empty(nbytes)``: new page-locked bytes for the bounce buffers."""

    def __init__(self, runner, chunk_bytes: int, pinned: Callable[[int], bool],
                 pinned_empty: Callable[[int], torch.Tensor]):
        self.r = runner
        self.chunk_bytes = chunk_bytes
        self.pinned = pinned
        self.layer_bytes: Sequence[int] | None = None
        self.trained_bytes: Sequence[int] | None = None
        self.bounce = [BouncePool(pinned_empty) for _ in runner.devices]

    # -- planning -------------------------------------------------------------------
    def rows(self, a: Action) -> dict[int, torch.Tensor]:
        """Tables ``a``'s stage moves by rows -> the call's rows (host, int64)."""
        r = self.r
        lookups = r.lookups
        if not lookups:
            return {}
        s = r.stages[a.stage]
        out = {}
        for p in lookups.stage_pids(s.layers):
            key = ("rows", p)
            if p not in r.host.quantized and r.host_store.contains(key):
                out[p] = r.host_store.get(key)
        return out

    def _layers(self, a: Action, pick, rows: dict | None = None
                ) -> list[tuple[int, list[int], list[int]]]:
        """Per layer of ``a``'s stage: ``(layer, pids, byte sizes)`` of its tensors
        (``pick(pid)`` filters; tied weights count once, with their first layer; a
        table in ``rows`` counts its rows)."""
        seen: set[int] = set()
        out = []
        for l in self.r.stages[a.stage].layers:
            pids = [p for p in self.r.ls.layer_params[l] if p not in seen and pick(p)]
            seen.update(pids)
            sizes = []
            for p in pids:
                c = self.r.compute[p]
                sizes.append(rows[p].numel() * _row_bytes(c) if rows and p in rows
                             else c.numel() * c.element_size())
            out.append((l, pids, sizes))
        return out

    def _parts(self, l: int, sizes: list[int], trained: bool = False
               ) -> list[list[tuple[int, int, int]]]:
        """Layer ``l``'s chunks: under timed emulation their count follows the emulated
        layer's bytes (its trained bytes for the trained part of a split upload), as
        the simulator's."""
        emulated = self.trained_bytes if trained else self.layer_bytes
        nbytes = emulated[l] if emulated is not None else sum(sizes)
        return split_bytes(sizes, layer_chunks(nbytes, self.chunk_bytes))

    def _timed(self, a: Action, index: int, body: Callable[[], None]) -> Callable[[], None]:
        """``body``, lasting at least chunk ``index``'s emulated duration."""
        timing = self.r.timing
        if timing is None:
            return body
        durations = timing(a)
        seconds = durations[index] if index < len(durations) else 0.0

        def run():
            t0 = time.perf_counter()
            body()
            sleep_until(t0 + seconds)
        return run

    # -- weight uploads ---------------------------------------------------------------
    def upload(self, a: Action) -> list[Chunk]:
        """The chunks of weight upload ``a``: a ``UW`` (of every tensor, or of the
        frozen ones when the call's routes split the stage's upload) or a ``UT`` (the
        trained tensors, added to what the stage's ``UW`` stored)."""
        r = self.r
        s, dev = r.stages[a.stage], r.devices[a.worker]
        grad = r.ctx.training and s.kind is not StageKind.FORWARD
        params: dict[int, nn.Parameter] = {}
        buffers: dict[int, torch.Tensor] = {}
        dst: dict[int, torch.Tensor] = {}
        landing: list[tuple] = []       # store keys of the layers landed so far
        chunks: list[Chunk] = []
        trained = a.kind is K.UPLOAD_TRAINED
        if trained or (a.stage, a.call) in r.routes.split:
            rows = {p: t for p, t in self.rows(a).items()
                    if r.ls.params[p].requires_grad == trained}
            layers = self._layers(a, lambda p: r.ls.params[p].requires_grad == trained, rows)
        else:
            rows = self.rows(a)
            layers = self._layers(a, lambda p: True, rows)
        for l, pids, sizes in layers:
            for j, pieces in enumerate(self._parts(l, sizes, trained)):
                def body(l=l, pids=pids, pieces=pieces, first=j == 0, src=None):
                    if first:
                        for p in pids:
                            c = r.compute[p]
                            # A table moved by rows lands in a compact buffer first.
                            shape = c.shape if p not in rows else \
                                (rows[p].numel(),) + tuple(c.shape[1:])
                            dst[p] = dev.empty(shape, c.dtype)
                            if p in rows:      # a transient beside the full table
                                r.stores[a.worker].put(("rowbuf", s.name, p), dst[p],
                                                       f"looked-up rows of {s}")
                        held = [dst[p] for p in pids if p not in rows]
                        if not trained:         # the UW brings the buffers
                            known = set(buffers)
                            self._upload_buffers(dev, l, buffers)
                            held += [t for b, t in buffers.items() if b not in known]
                        # The layer's memory is taken now, as the caching allocator
                        # takes it on a GPU: charged from its first chunk, not from the
                        # stage's last one (docs/concepts.md, "Copy engines").
                        key = ("landing", a.key, l)
                        r.stores[a.worker].put(key, held, f"weights of {s} landing")
                        landing.append(key)
                    for i, lo, hi in pieces:
                        target = _bytes(dst[pids[i]])[lo:hi]
                        if src is not None:        # staged in a pinned bounce buffer
                            target.copy_(src[i], non_blocking=True)
                        else:
                            host = r.compute[pids[i]].contiguous()
                            target.copy_(_bytes(host)[lo:hi], non_blocking=True)
                chunks.append(self._upload_chunk(a, dev, pids, pieces, body, len(chunks),
                                                 rows))

        def finish():
            kept = {}
            for p, host_rows in rows.items():
                # In the uploading stream: rows -> a full-size table, NaN elsewhere.
                c, compact = r.compute[p], dst[p]
                index = dev.upload(host_rows)
                table = dev.empty(c.shape, c.dtype)
                if table.is_floating_point():
                    table.fill_(float("nan"))
                dst[p] = table.index_copy_(0, index, compact)
                r.stores[a.worker].pop(("rowbuf", s.name, p))
                kept[p] = index
            if grad and any(r.ls.params[p].requires_grad for p in kept):
                # The gradient's download gathers the same rows (same worker and job).
                r.stores[a.worker].put(("rows", s.name), kept, f"row indices of {s}")
            for p, t in dst.items():
                q = r.host.quantized.get(p)
                if q is not None:
                    # NF4: dequantize the uploaded bytes on the device, in the stream
                    # that uploaded them (the stage's event covers it); the packed copy
                    # is dropped, the stage holds the compute-dtype weight.
                    t = q.dequantize(t, r.host.dtype_of(p))
                params[p] = nn.Parameter(t, requires_grad=grad and r.ls.params[p].requires_grad)
            store = r.stores[a.worker]
            for key in landing:         # the same tensors, charged below as the stage's
                store.pop(key)
            landing.clear()
            if trained:
                # Popped first, so the device budget never counts the frozen part twice.
                frozen, kept_buffers = store.pop(("w", s.name))
                params.update(frozen)
                buffers.update(kept_buffers)
            store.put(("w", s.name), (dict(params), dict(buffers)), f"weights of stage {s}")
            params.clear()  # the chunks' closures outlive the copy: hold no tensor
            buffers.clear()
            dst.clear()
        if not chunks:
            return [Chunk(finish)]
        last = chunks[-1].copy
        chunks[-1].copy = lambda: (last(), finish())
        return chunks

    def _upload_chunk(self, a: Action, dev: Device, pids, pieces, body, index,
                      rows: dict) -> Chunk:
        """A chunk of pieces; through a bounce buffer when any piece is pageable (or
        is gathered: a table moved by rows)."""
        if all(self.pinned(pids[i]) and pids[i] not in rows for i, _, _ in pieces):
            return Chunk(self._timed(a, index, body))
        pool = self.bounce[a.worker]
        staged: dict[int, torch.Tensor] = {}
        slot = []

        def ready():
            return pool.free() is not None

        def stage():
            # On the dispatcher thread: pageable bytes -> a free pinned buffer.
            i = pool.free()
            buf = pool.take(i, sum(hi - lo for _, lo, hi in pieces))
            off = 0
            for k, lo, hi in pieces:
                n = hi - lo
                buf[off:off + n].copy_(self._source(pids[k], lo, hi, rows))
                staged[k] = buf[off:off + n]
                off += n
            slot[:] = [i]

        def issued(event):
            pool.used_until(slot[0], event)

        run = self._timed(a, index, lambda: body(src=staged))
        return Chunk(run, stage=stage, ready=ready, issued=issued)

    def _source(self, p: int, lo: int, hi: int, rows: dict) -> torch.Tensor:
        """Bytes ``[lo, hi)`` of what parameter ``p`` uploads: its compute copy, or the
        concatenation of its looked-up rows (gathered here, only those the range
        touches)."""
        c = self.r.compute[p]
        if p not in rows:
            return _bytes(c.contiguous())[lo:hi]
        row = _row_bytes(c)
        first, last = lo // row, -(-hi // row)
        store = self.r.host_store
        if store.contains(("fresh", p)):
            # The previous call's OR stepped these rows first (their whole table is
            # being stepped in place meanwhile): OverlapStep.step_rows.
            part = store.get(("fresh", p))[first:last]
        else:
            part = c.index_select(0, rows[p][first:last])
        return _bytes(part)[lo - first * row:hi - first * row]

    def _upload_buffers(self, dev: Device, l: int, buffers: dict) -> None:
        r = self.r
        for bid in r.ls.layer_buffers[l]:
            if bid in buffers:
                continue
            key = ("buf", bid)
            src = r.host_store.get(key) if r.host_store.contains(key) \
                else r.ls.buffer_value(bid)
            # Floating buffers (BatchNorm statistics) compute in the compute dtype, as
            # in a model cast with .to(dtype), but for those the model keeps in fp32
            # (a router's correction bias); the host keeps their dtype.
            dtype = r.ls.buffer_dtype(bid, r.host.dtype) if src.is_floating_point() \
                else None
            buffers[bid] = dev.upload(src, dtype)

    # -- weight-gradient downloads ------------------------------------------------------
    def download(self, a: Action) -> list[Chunk]:
        r = self.r
        dev = r.devices[a.worker]
        trainable = r.ls.params
        got: dict = {}
        out: dict[int, torch.Tensor] = {}
        chunks: list[Chunk] = []
        rows = {p: t for p, t in self.rows(a).items() if trainable[p].requires_grad}
        shapes: dict[int, torch.Size] = {}

        def take():
            # The stage's gradients, in stream order; a table moved by rows is gathered
            # at its rows on the device (the rest of its gradient is zero).
            if "grads" in got:
                return got["grads"]
            # Every chunk reads the gradients until the last one: they stay charged to
            # the device until then, as their memory stays allocated on a GPU. A table
            # moved by rows goes down as its gathered rows (charged beside its full
            # gradient while gathering; the full one is freed once gathered).
            store = r.stores[a.worker]
            grads = dict(store.get(("wgrad", a.stage)))
            gathered = {}
            if rows:
                index = store.pop(("rows", a.stage))
                for p in rows:
                    if p in grads:
                        shapes[p] = grads[p].shape
                        gathered[p] = grads.pop(p).index_select(0, index[p])
                store.put(("down rows", a.key), gathered,
                          f"looked-up gradient rows of {a.stage}")
            store.pop(("wgrad", a.stage))
            store.put(("down", a.key), grads, f"weight gradients of {a.stage} going down")
            got["grads"] = {**grads, **gathered}
            return got["grads"]

        for l, pids, sizes in self._layers(a, lambda p: trainable[p].requires_grad, rows):
            for j, pieces in enumerate(self._parts(l, sizes)):
                def body(pids=pids, pieces=pieces, first=j == 0):
                    grads = take()
                    if first:
                        for p in pids:
                            if p in grads:
                                out[p] = dev.empty_host(grads[p].shape, grads[p].dtype)
                    for i, lo, hi in pieces:
                        p = pids[i]
                        if p in grads:
                            _bytes(out[p])[lo:hi].copy_(_bytes(grads[p])[lo:hi],
                                                         non_blocking=True)
                chunks.append(Chunk(self._timed(a, len(chunks), body)))

        def finish():
            take()
            r.stores[a.worker].pop(("down", a.key))
            if rows:
                r.stores[a.worker].pop(("down rows", a.key))
            for p, shape in shapes.items():
                out[p] = RowGrad(rows[p], out[p], shape)
            r.host_store.put(("wgrad", a.stage), dict(out))
            # The chunks' closures live as long as the call's action lists: let the
            # gradients die once the optimizer has stepped them (docs/memory.md).
            out.clear()
            got.clear()
            shapes.clear()
        if not chunks:
            return [Chunk(finish)]
        last = chunks[-1].copy
        chunks[-1].copy = lambda: (last(), finish())
        return chunks
