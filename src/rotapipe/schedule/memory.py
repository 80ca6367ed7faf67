"""Device memory of a schedule: which buffers each action allocates, and their peak.

The buffers follow from the schedule alone, given a few sizes per layer
(:class:`MemorySizes`). A buffer is allocated when the action that produces it starts
and freed when the last action *on the same worker* that depends on it has finished
(the CUDA caching allocator can reuse the memory then). The rules, by action kind:

- ``UW`` a stage's weights, until its ``X`` (or the end of the schedule); a stage that
  runs backward also holds its weight gradients from its first backward until its
  ``DW``. A stage that computes on a worker without a ``UW`` there (bound schedules)
  keeps its weights and gradients resident for the whole schedule, unless the
  backward stage with its layers was uploaded there (``offload_optimizer``).
- ``UA`` / ``UG`` the activation / gradient at a layer boundary; ``F`` its output;
  ``FK`` and ``R`` the activations autograd keeps for the stage's backward, plus the
  output; ``B`` / ``BK`` the gradient w.r.t. the stage input; ``FT`` the tail's
  activations while it runs, then the gradient w.r.t. its input.

Timing decides how buffers overlap: the validator uses its unit-time dry run, the
simulator the simulated times.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..errors import ScheduleError
from ..plan import Stage
from .actions import HOST, ActionKind as K, Lane, Schedule, stage_map
from .routes import weight_stages

__all__ = ["Buffer", "MemorySizes", "MemoryPeak", "buffers", "check_limit", "format_bytes",
           "peak_memory"]


@dataclass(frozen=True)
class MemorySizes:
    """Bytes per layer that decide a schedule's device memory.

    All activation sizes are for one microbatch.
    """

    weights: tuple[int, ...]
    """Compute-dtype parameter bytes of each layer."""
    saved: tuple[int, ...]
    """Bytes autograd keeps for each layer's backward (its saved activations)."""
    outputs: tuple[int, ...]
    """Bytes of each layer's output: the activation (or gradient) at its stop boundary."""
    inputs: int = 0
    """Bytes of the model input (token ids) of one microbatch."""
    grads: tuple[int, ...] | None = None
    """Bytes of each layer's weight gradients on the device (LoRA: the adapters');
    ``None``: every weight is trained, its gradients as large as ``weights``."""

    def __post_init__(self):
        n = len(self.weights)
        if not (len(self.saved) == len(self.outputs) == n) or n == 0 or \
                (self.grads is not None and len(self.grads) != n):
            raise ScheduleError(f"memory sizes need one entry per layer: weights has {n}, "
                                f"saved {len(self.saved)}, outputs {len(self.outputs)}"
                                + ("" if self.grads is None else f", grads {len(self.grads)}"))

    @classmethod
    def uniform(cls, num_layers: int, weights: int, saved: int, outputs: int) -> MemorySizes:
        """Every layer the same sizes."""
        return cls((weights,) * num_layers, (saved,) * num_layers, (outputs,) * num_layers)

    def boundary(self, at: int) -> int:
        """Bytes of the activation entering layer ``at``."""
        return self.inputs if at == 0 else self.outputs[at - 1]

    def stage_weights(self, s: Stage) -> int:
        return sum(self.weights[s.start:s.stop])

    def stage_saved(self, s: Stage) -> int:
        return sum(self.saved[s.start:s.stop])

    def stage_grads(self, s: Stage) -> int:
        return sum((self.weights if self.grads is None else self.grads)[s.start:s.stop])


@dataclass(frozen=True)
class Buffer:
    """Device memory held by one action's result on one worker."""

    worker: int
    nbytes: int
    alloc: str | None
    """Key of the action whose start allocates it (``None``: held from the start)."""
    frees: tuple[str, ...]
    """Keys of the actions after all of which it is freed (empty: held to the end)."""
    weights: bool
    """Weights or weight gradients (else activations)."""


@dataclass(frozen=True)
class MemoryPeak:
    """Peak device memory of one worker and what made it."""

    worker: int
    total: int
    weights: int
    activations: int
    time: float


_HOLD_OUTPUT = {K.UPLOAD_ACT, K.UPLOAD_GRAD, K.FORWARD, K.FORWARD_KEEP, K.RECOMPUTE,
                K.BACKWARD, K.BACKWARD_KEPT, K.FUSED}
_BACKWARD = {K.BACKWARD, K.BACKWARD_KEPT, K.FUSED}


def buffers(schedule: Schedule, sizes: MemorySizes) -> list[Buffer]:
    """Every device buffer of ``schedule`` under ``sizes`` (see the module docstring)."""
    plan = schedule.plan
    if len(sizes.weights) != plan.num_layers:
        raise ScheduleError(f"memory sizes cover {len(sizes.weights)} layers, the plan "
                            f"has {plan.num_layers}")
    stages = stage_map(plan)
    users: dict[str, list[str]] = defaultdict(list)   # key -> same-worker dependents
    by_key = schedule.by_key()
    for a in schedule.actions:
        for d in a.deps + a.host_deps:
            if d in by_key and by_key[d].worker == a.worker:
                users[d].append(a.key)
    out: list[Buffer] = []
    uploaded: set[tuple[int, str, int]] = set()
    for a in schedule.actions:
        if a.kind is K.UPLOAD_WEIGHTS:
            uploaded.add((a.worker, a.stage, a.call))
    resident: dict[int, set[int]] = defaultdict(set)     # worker -> resident layers
    trained: dict[int, set[int]] = defaultdict(set)      # worker -> layers with grads
    twins = weight_stages(schedule)     # FK:Fc computes with the weights of UW:Bc
    first_bwd: dict[tuple[int, str, int], str] = {}
    x_key: dict[tuple[int, str, int], str] = {}
    dw_key: dict[tuple[int, str, int], str] = {}
    for a in schedule.actions:
        if a.worker == HOST:
            continue
        s = stages.get(a.stage)
        where = (a.worker, a.stage, a.call)
        if a.kind is K.FREE:
            x_key[where] = a.key
        elif a.kind is K.DOWNLOAD_WGRAD:
            dw_key[where] = a.key
        if s is None or a.lane is not Lane.COMPUTE or a.kind is K.FREE:
            pass
        elif (a.worker, twins.get(a.stage, a.stage), a.call) in uploaded:
            if a.kind in _BACKWARD:
                first_bwd.setdefault(where, a.key)
        else:
            resident[a.worker].update(s.layers)
            if a.kind in _BACKWARD:
                trained[a.worker].update(s.layers)
        if a.kind in _HOLD_OUTPUT and s is not None:
            out.append(Buffer(a.worker, _output_bytes(a.kind, a.at, s, sizes), a.key,
                              tuple(users[a.key]) or (a.key,), False))
        if a.kind is K.FUSED and s is not None:   # the tail's activations while it runs
            out.append(Buffer(a.worker, sizes.stage_saved(s), a.key, (a.key,), False))
    for a in schedule.actions:
        if a.kind is K.UPLOAD_WEIGHTS:
            s, where = stages[a.stage], (a.worker, a.stage, a.call)
            free = (x_key[where],) if where in x_key else ()
            out.append(Buffer(a.worker, sizes.stage_weights(s), a.key, free, True))
            if where in first_bwd:
                free = (dw_key[where],) if where in dw_key else ()
                out.append(Buffer(a.worker, sizes.stage_grads(s), first_bwd[where],
                                  free, True))
    grads = sizes.weights if sizes.grads is None else sizes.grads
    for w, layers in resident.items():
        nbytes = sum(sizes.weights[l] for l in layers)
        nbytes += sum(grads[l] for l in trained[w])
        out.append(Buffer(w, nbytes, None, (), True))
    return out


def _output_bytes(kind: K, at: int | None, s: Stage, sizes: MemorySizes) -> int:
    if kind in (K.UPLOAD_ACT, K.UPLOAD_GRAD):
        return sizes.boundary(at)
    if kind is K.FORWARD:
        return sizes.boundary(s.stop)
    if kind in (K.FORWARD_KEEP, K.RECOMPUTE):
        return sizes.stage_saved(s) + (sizes.boundary(s.stop) if kind is K.FORWARD_KEEP else 0)
    return sizes.boundary(s.start) if s.start > 0 else 0   # input gradient of a backward


def peak_memory(schedule: Schedule, sizes: MemorySizes, start: Mapping[str, float],
                end: Mapping[str, float]) -> list[MemoryPeak]:
    """Peak bytes per worker when each action runs over ``[start[key], end[key])``.

    At equal times frees come before allocations (the memory is reused)."""
    events: dict[int, list[tuple[float, int, int, bool]]] = defaultdict(list)
    for b in buffers(schedule, sizes):
        if b.nbytes == 0:
            continue
        t0 = start[b.alloc] if b.alloc is not None else float("-inf")
        t1 = max(end[k] for k in b.frees) if b.frees else float("inf")
        events[b.worker].append((t0, 1, b.nbytes, b.weights))
        events[b.worker].append((t1, 0, -b.nbytes, b.weights))
    peaks = []
    for w in range(schedule.workers):
        total = weights = 0
        best = MemoryPeak(w, 0, 0, 0, 0.0)
        for t, _, delta, is_w in sorted(events.get(w, ()), key=lambda e: (e[0], e[1])):
            total += delta
            weights += delta if is_w else 0
            if total > best.total:
                best = MemoryPeak(w, total, weights, total - weights,
                                  t if t != float("-inf") else 0.0)
        peaks.append(best)
    return peaks


def format_bytes(n: float) -> str:
    """``n`` bytes with a binary unit and one decimal, e.g. ``9.2 GiB``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def check_limit(peaks: Sequence[MemoryPeak], limit: int, where: str) -> None:
    """Raise :class:`ScheduleError` naming the first worker whose peak exceeds ``limit``."""
    for p in peaks:
        if p.total > limit:
            raise ScheduleError(
                f"worker {p.worker} needs {format_bytes(p.total)} at its peak (weights "
                f"{format_bytes(p.weights)} + activations {format_bytes(p.activations)}, "
                f"{where} t={p.time:g}); the limit is {format_bytes(limit)}: use more "
                "stages (smaller ones), recompute, or fewer microbatches in flight")
