"""Data-parallel ranks hold one model: checksums of every weight compared across ranks.

Gradient averaging keeps ranks identical only if they start identical. A rank that
seeded its model differently, loaded another checkpoint, or runs another
``PipeConfig.seed`` (dropout streams) would otherwise train a model of its own with no
error (two ranks 2 steps later: embedding sums 6.94 and 33.67). So:

- **At construction** every rank sends ``(fingerprint, seed, names, checksums)`` in the
  one start-up gather the reducer already does
  (:class:`~rotapipe.runtime.allreduce.GradReducer`): no extra collective. Checksums
  cover every parameter, trained and frozen (an NF4 weight by its packed bytes), and
  every buffer.
- **After a load** (:meth:`RoundPipe.load_state_dict`, ``load_pipeline_state``,
  :func:`rotapipe.distributed.load_shard_state_dicts`) on any rank, the next training
  call compares the parameters and ``pipe.calls`` again. Which ranks loaded rides in
  the call's all-reduce of its loss units (one more float); only when some rank loaded
  since the last check do the ranks all-gather their checksums, all of them together
  (every rank saw the same sum). Buffers are left out there: those updated in forward
  (BatchNorm statistics) differ across ranks by design (docs/distributed.md).

A checksum is CRC-32 of the tensor's bytes (exact: the same bits give the same sum
whatever the thread count, unlike a floating-point sum), per 16 MiB chunk on a thread
pool (``zlib`` releases the GIL), the chunks' sums then summed again. Cost: one read
of the host weights, measured in docs/distributed.md.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from ..config import ShardMode
from ..errors import ConfigError

__all__ = ["fingerprint", "checksum", "checksums", "WeightCheck"]

CHUNK = 1 << 24
"""Bytes per CRC-32 job (a large tensor is spread over the pool's threads)."""


def fingerprint(pipe) -> str:
    """What must agree across data-parallel ranks besides the weights (plan, dtype,
    parameter shapes, sharding)."""
    shapes = [tuple(pipe.layerset.params[pid].shape) for pid in pipe.host.trainable]
    dpc = pipe.config.data_parallel
    shard = "" if dpc.shard is ShardMode.NONE else \
        f", shard {dpc.shard.value} (gradients in {dpc.grad_dtype})"
    return (f"plan {pipe.plan.to_text()}, compute dtype {pipe.host.dtype}, "
            f"{len(shapes)} trainable parameters, shapes hash {hash(tuple(shapes))}{shard}")


def _flat_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's values as bytes (a broadcast dimension, stride 0, counted once:
    an NF4 parameter's placeholder is one element expanded to its shape)."""
    t = t.detach()
    if any(s == 0 and n > 1 for s, n in zip(t.stride(), t.shape)):
        t = t[tuple(slice(0, 1) if s == 0 else slice(None) for s in t.stride())]
    flat = t.reshape(-1)
    if flat.numel() > 0 and flat.stride(0) != 1:
        flat = flat.clone(memory_format=torch.contiguous_format)
    if flat.dtype is torch.bool:
        flat = flat.view(torch.uint8)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def _jobs(t: torch.Tensor) -> list[memoryview]:
    data = _flat_bytes(t)
    return [data[i:i + CHUNK] for i in range(0, max(len(data), 1), CHUNK)]


def checksums(tensors: list[torch.Tensor], threads: int | None = None) -> list[int]:
    """CRC-32 of each tensor's dtype, shape and bytes (a tensor over :data:`CHUNK`
    bytes: of its chunks' CRCs), the chunks spread over ``threads`` threads."""
    jobs = [_jobs(t) for t in tensors]
    flat = [chunk for js in jobs for chunk in js]
    threads = threads or min(32, torch.get_num_threads(), os.cpu_count() or 1)
    if threads > 1 and len(flat) > 1 and sum(len(c) for c in flat) > CHUNK:
        with ThreadPoolExecutor(threads, thread_name_prefix="rotapipe-crc") as pool:
            crcs = list(pool.map(zlib.crc32, flat))
    else:
        crcs = [zlib.crc32(c) for c in flat]
    out, i = [], 0
    for t, js in zip(tensors, jobs):
        head = f"{t.dtype}{tuple(t.shape)}".encode()
        parts = crcs[i:i + len(js)]
        i += len(js)
        out.append(zlib.crc32(b"".join(c.to_bytes(4, "little") for c in parts), zlib.crc32(head)))
    return out


def checksum(t: torch.Tensor) -> int:
    return checksums([t])[0]


class WeightCheck:
    """The weights' agreement across data-parallel ranks of one pipeline (module
    docstring): its layer set and host state (read when a check runs), its
    ``PipeConfig.seed`` and its call counter (``calls()``: ``pipe.calls``)."""

    def __init__(self, layerset, host, seed: int, calls: Callable[[], int]):
        self.layerset, self.host, self.seed, self.calls = layerset, host, seed, calls
        self.loads = 0
        """Loads on this rank (state dicts, pipeline states) since it was built."""
        self.checked = 0.0
        """The ranks' summed :attr:`loads` when they last agreed."""

    def loaded(self) -> None:
        """This rank loaded weights or counters: the next training call compares."""
        self.loads += 1

    def _named(self, buffers: bool) -> Iterator[tuple[str, torch.Tensor]]:
        ls, quantized = self.layerset, self.host.quantized
        for pid, p in enumerate(ls.params):
            q = quantized.get(pid)
            yield f"parameter {ls.param_names[pid]}", (q.packed if q is not None else p)
        if buffers:
            for bid, name in enumerate(ls.buffer_names):
                yield f"buffer {name}", ls.buffer_value(bid)

    def payload(self, buffers: bool = True) -> tuple:
        """What a rank sends: ``(seed, calls, names' CRC, tensors' CRCs)``."""
        named = list(self._named(buffers))
        return (self.seed, self.calls(), zlib.crc32("\n".join(n for n, _ in named).encode()),
                tuple(checksums([t for _, t in named])))

    def names(self, buffers: bool = True) -> list[str]:
        return [name for name, _ in self._named(buffers)]

    def compare(self, gathered: list[tuple], members: list[int], loaded: bool = False) -> None:
        """Raise :class:`ConfigError` (the same on every rank: every rank compares the
        same gathered payloads) naming what differs first, rank ``members[0]``'s value
        against the first rank that differs, and the fix."""
        ref, names = gathered[0], self.names(buffers=not loaded)
        for field, what in ((2, "structure"), (0, "seed"), (1, "calls"), (3, "weights")):
            bad = [r for r, g in enumerate(gathered) if g[field] != ref[field]]
            if not bad:
                continue
            r = bad[0]
            ranks = (f"rank {members[0]} and rank{'s' if len(bad) > 1 else ''} "
                     f"{', '.join(str(members[b]) for b in bad)}")
            if what == "structure":
                raise ConfigError(
                    f"data parallelism needs the same model on every rank, but {ranks} "
                    "hold differently named parameters or buffers: build the same model "
                    "on every rank")
            if what == "seed":
                raise ConfigError(
                    f"PipeConfig.seed is {ref[0]} on rank {members[0]} but {gathered[r][0]} "
                    f"on rank {members[r]}: the dropout streams would differ from a "
                    "one-process run (data parallelism already gives each rank's "
                    "microbatches streams of their own). Use the same seed on every rank")
            if what == "calls":
                raise ConfigError(
                    f"pipe.calls is {ref[1]} on rank {members[0]} but {gathered[r][1]} on "
                    f"rank {members[r]} (load_pipeline_state on some ranks only?): the "
                    "ranks would draw other dropout streams than a one-process run. "
                    "Load the same pipeline state on every rank")
            mine, theirs = ref[3], gathered[r][3]
            diff = [i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b]
            when = ("after a load on some rank (pipe.load_state_dict, load_pipeline_state "
                    "or load_shard_state_dicts), " if loaded else "")
            fix = ("Load the same checkpoint on every rank (every rank calls "
                   "pipe.load_state_dict with the same state), then train on"
                   if loaded else
                   "Seed the model identically on every rank (torch.manual_seed(same "
                   "seed) before building it) or load the same checkpoint on each, "
                   "before wrapping it in RoundPipe")
            note = ("; if it is a buffer updated in forward (BatchNorm statistics, which "
                    "each rank keeps for its own shards), copy rank 0's to every rank "
                    "(torch.distributed.broadcast) before wrapping"
                    if names[diff[0]].startswith("buffer") else "")
            raise ConfigError(
                f"data-parallel ranks must hold the same weights, but {when}"
                f"{names[diff[0]]} differs between {ranks} (CRC-32 {mine[diff[0]]:#010x} "
                f"against {theirs[diff[0]]:#010x}; {len(diff)} of {len(mine)} tensors "
                "differ): each rank would train a model of its own, silently diverging. "
                f"{fix}{note}. Nothing was trained")

    def compare_if_loaded(self, dp, loads: float) -> None:
        """A training call's start (data parallel): ``loads`` is the ranks' summed
        :attr:`loads`. If some rank loaded since the ranks last agreed, every rank
        all-gathers its parameters' checksums and compares them (a mismatch raises,
        and the next call checks again)."""
        if loads == self.checked or dp.world == 1:
            return
        seed, calls, names, crcs = self.payload(buffers=False)
        mine = torch.tensor([seed & (2**63 - 1), calls, names, *crcs], dtype=torch.int64)
        gathered = [(int(v[0]), int(v[1]), int(v[2]), tuple(v[3:].tolist()))
                    for v in dp.gather(mine, "all-gather of the weights' checksums")]
        self.compare(gathered, dp.members, loaded=True)
        self.checked = loads

    def before_step(self, dp) -> None:
        """``pipe.step()`` of a sharded pipeline (a collective): compare first if some
        rank loaded since, as a training call does, or the step's all-gather would
        spread a mix of the ranks' weights to every rank, where no later check sees it.
        One all-reduce of one float."""
        self.compare_if_loaded(dp, dp.global_sum(float(self.loads), "sum of the weight loads"))
