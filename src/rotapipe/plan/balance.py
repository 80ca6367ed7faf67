"""Cost-balanced partitions: bound plans for the baseline schedules, and a searched
RoundPipe plan for simulation.

``bound_plan`` cuts the layers into contiguous chunks minimising the heaviest chunk,
the best a stage-to-device binding can do. ``roundpipe_plan`` sizes RoundPipe's stages
near the heaviest single job (usually the fused LM-head tail) and picks the stage
counts with a fast job-level estimate of the step time. It balances time only; the
planner with memory limits (issue 4) supersedes it.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence

from ..errors import PlanError
from .costs import ModelCosts
from .partition import Plan, Stage, StageKind

__all__ = ["split_balanced", "Recompute", "bound_plan", "roundpipe_plan", "roundpipe_plans",
           "estimate_roundpipe_ms", "greedy_compute_plan"]


def split_balanced(costs: Sequence[float], parts: int) -> list[tuple[int, int]]:
    """Cut ``costs`` into ``parts`` contiguous non-empty runs ``[start, stop)`` whose
    largest sum is as small as possible.

    Runs are filled greedily up to that sum from the front, so equal-cost layers give
    runs of one size first and the remainder last. (Spreading the remainder evenly
    looks fairer but is worse for a pipeline: a microbatch flows at the pace of the
    slowest of consecutive stages, so alternating sizes idle the smaller ones.)"""
    n = len(costs)
    if not 1 <= parts <= n:
        raise PlanError(f"cannot cut {n} layers into {parts} non-empty stages: use 1..{n}")
    eps = 1e-9 * max(sum(costs), 1.0)

    def greedy(limit: float) -> list[tuple[int, int]] | None:
        """Fewest runs with sums <= limit, filled from the front (None: impossible)."""
        runs, start, run = [], 0, 0.0
        for i, x in enumerate(costs):
            if x > limit + eps:
                return None
            if run + x > limit + eps:
                runs.append((start, i))
                start, run = i, x
            else:
                run += x
        return runs + [(start, n)]

    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    candidates = sorted({prefix[j] - prefix[i] for i in range(n) for j in range(i + 1, n + 1)})
    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        runs = greedy(candidates[mid])
        if runs is None or len(runs) > parts:
            lo = mid + 1
        else:
            hi = mid
    runs = greedy(candidates[lo])
    while len(runs) < parts:   # split the longest run: no run gets heavier
        i = max(range(len(runs)), key=lambda k: runs[k][1] - runs[k][0])
        a, b = runs[i]
        runs[i:i + 1] = [(a, a + 1), (a + 1, b)]
    return runs


def _plan(num_layers: int, fwd, tail: tuple[int, int], bwd) -> Plan:
    return Plan(num_layers,
                tuple(Stage(StageKind.FORWARD, i, a, b) for i, (a, b) in enumerate(fwd)),
                Stage(StageKind.TAIL, 0, *tail),
                tuple(Stage(StageKind.BACKWARD, i, a, b) for i, (a, b) in enumerate(bwd)))


class Recompute(str, enum.Enum):
    """Whether a bound (baseline) schedule recomputes its forwards in the backward, and
    when. The fused tail (the last chunk, with the loss) is never recomputed."""

    OFF = "off"
    """Forwards keep their autograd graph on the device until the backward (``FK``/``BK``)."""
    AHEAD = "ahead"
    """Ours: forwards keep only their input; a chunk's recompute (``R``) may run as soon as
    the compute before it is done, ahead of the output gradient its backward (``B``)
    waits for. Stronger than the paper's baselines: a device waiting for a gradient
    recomputes meanwhile."""
    AFTER_GRAD = "after-grad"
    """The paper's baselines (the artifact's runs): a chunk's recompute starts only once
    its output gradient has arrived, so recompute and backward run back to back."""

    @classmethod
    def of(cls, value: Recompute | str | bool | None) -> Recompute:
        """``True`` is :attr:`AHEAD`, ``False``/``None`` :attr:`OFF`; strings by value."""
        if isinstance(value, cls):
            return value
        if value is True:
            return cls.AHEAD
        if value is False or value is None:
            return cls.OFF
        try:
            return cls(str(value).lower())
        except ValueError:
            raise PlanError(f"recompute={value!r}: use one of "
                            f"{', '.join(m.value for m in cls)} (or True / False)") from None


def bound_plan(costs: ModelCosts | Sequence[float], chunks: int, *, devices: int | None = None,
               recompute: Recompute | str | bool = False) -> Plan:
    """A plan for the baselines: ``chunks`` contiguous chunks; the last chunk is the tail
    and backward stage ``Bi`` covers the same layers as forward stage ``Fi``.

    A chunk is priced as the baseline schedules run it: forward + backward, plus the
    recompute when ``recompute`` is on (:class:`Recompute`), except for the last chunk,
    which no schedule recomputes. ``costs`` may also be a list of per-layer weights
    (each chunk costs its sum, whatever ``recompute``).

    The cut minimises the heaviest chunk (the pipeline moves at the pace of its slowest
    stage; exact, checked against brute force), then, among such cuts, the most loaded
    device when chunk ``c`` runs on device ``c % devices`` (``devices`` defaults to
    ``chunks``): from the min-max cut it moves single boundaries while that helps."""
    redo = Recompute.of(recompute) is not Recompute.OFF
    if isinstance(costs, ModelCosts):
        body = [l.forward_ms + l.backward_ms + (l.recompute_ms if redo else 0.0)
                for l in costs.layers]
        tail = [l.forward_ms + l.backward_ms for l in costs.layers]
    else:
        body = tail = [float(c) for c in costs]
    n, p = len(body), devices or chunks
    for name, v in (("chunks", chunks), ("devices", devices)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise PlanError(f"{name}={v!r}: use a positive int")
    if not 1 <= chunks <= n:
        raise PlanError(f"cannot cut {n} layers into {chunks} non-empty chunks: use 1..{n}")
    price = _ChunkPrice(body, tail)
    runs = _min_max_chunks(price, chunks)
    if p < chunks:
        runs = _balance_devices(price, runs, p)
    return _plan(n, runs[:-1], runs[-1], runs[:-1])


class _ChunkPrice:
    """Cost of chunk ``[a, b)``: ``body`` prices for every chunk but the last, ``tail``
    prices for the last (the one ending at the model's last layer)."""

    def __init__(self, body: Sequence[float], tail: Sequence[float]):
        self.n = len(body)
        self.pb, self.pt = [0.0], [0.0]
        for x, y in zip(body, tail):
            self.pb.append(self.pb[-1] + x)
            self.pt.append(self.pt[-1] + y)
        self.eps = 1e-9 * max(self.pb[-1], self.pt[-1], 1.0)

    def __call__(self, a: int, b: int) -> float:
        pre = self.pt if b == self.n else self.pb
        return pre[b] - pre[a]


def _min_max_chunks(price: _ChunkPrice, k: int) -> list[tuple[int, int]]:
    """The cut into exactly ``k`` chunks with the lightest heaviest chunk.

    For a threshold ``T``, runs of body price ``<= T`` filled greedily from the front
    use the fewest runs for any prefix, so the last chunk starts as late as ``k - 1``
    such runs allow (the greedy run ``k``'s start, or the first layer over ``T``); a
    later start only lightens the tail-priced last chunk. ``T`` is reachable iff that
    last chunk is within it; a binary search over every chunk price finds the smallest
    reachable ``T``. Equal prices give runs of one size first, the remainder last (see
    :func:`split_balanced`)."""
    n, eps = price.n, price.eps
    if k == 1:
        return [(0, n)]

    def cut(limit: float) -> list[tuple[int, int]] | None:
        starts, start, stop = [0], 0, n - 1
        for i in range(n - 1):
            if price(i, i + 1) > limit + eps:
                stop = i
                break
            if price(start, i + 1) > limit + eps:
                start = i
                starts.append(i)
        s = starts[k - 1] if len(starts) >= k else stop
        if s < k - 1 or price(s, n) > limit + eps:
            return None
        starts = [x for x in starts if x < s]
        runs = list(zip(starts, starts[1:] + [s]))
        while len(runs) < k - 1:     # split the longest run: no run gets heavier
            i = max(range(len(runs)), key=lambda r: runs[r][1] - runs[r][0])
            a, b = runs[i]
            runs[i:i + 1] = [(a, a + 1), (a + 1, b)]
        return runs + [(s, n)]

    values = sorted({price(a, b) for a in range(n) for b in range(a + 1, n + 1)})
    lo, hi = 0, len(values) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if cut(values[mid]) is None:
            lo = mid + 1
        else:
            hi = mid
    return cut(values[lo])


def _balance_devices(price: _ChunkPrice, runs, p: int):
    cuts = [b for _, b in runs[:-1]]
    n = price.n

    def score(cuts):
        bounds = [0] + cuts + [n]
        chunk = [price(a, b) for a, b in zip(bounds, bounds[1:])]
        load = [sum(chunk[d::p]) for d in range(p)]
        return (round(max(chunk), 9), round(max(load), 9))

    best = score(cuts)
    improved = True
    while improved:
        improved = False
        for i in range(len(cuts)):
            for step in (-1, 1):
                c = cuts[i] + step
                lo = cuts[i - 1] if i else 0
                hi = cuts[i + 1] if i + 1 < len(cuts) else n
                if lo < c < hi:
                    trial = cuts[:i] + [c] + cuts[i + 1:]
                    s = score(trial)
                    if s < best:
                        cuts, best, improved = trial, s, True
    bounds = [0] + cuts + [n]
    return list(zip(bounds, bounds[1:]))


def estimate_roundpipe_ms(plan: Plan, costs: ModelCosts, workers: int,
                          microbatches: int, calls: int = 1) -> float:
    """Step time of RoundPipe at job grain: job ``j`` runs on worker ``j % workers``,
    its microbatch ``m`` starts after the worker is free and after microbatch ``m`` of
    job ``j - 1`` has crossed to the host and back (two hops). With ``calls > 1`` the
    calls overlap (stale optimizer: the round-robin continues, a call's first job
    waits for nothing) and the result is the mean period from the first call's end.
    Ignores link contention and weight uploads (prefetched); the simulator models both."""
    jobs = []   # (time before the input is needed, time after, hop from the last job)
    for s in plan.jobs():
        fwd = costs.sum("forward_ms", s.start, s.stop)
        bwd = costs.sum("backward_ms", s.start, s.stop)
        if s.kind is StageKind.FORWARD:
            jobs.append((0.0, fwd, 2 * costs.boundary_hop_ms(s.start)))
        elif s.kind is StageKind.TAIL:
            jobs.append((0.0, fwd + bwd, 2 * costs.boundary_hop_ms(s.start)))
        else:   # the recompute needs only the checkpoint: it runs before the gradient
            jobs.append((costs.sum("recompute_ms", s.start, s.stop), bwd,
                         2 * costs.boundary_hop_ms(s.stop)))
    free = [0.0] * workers
    ends = []
    g = 0
    for _ in range(calls):
        ready = [0.0] * microbatches
        for j, (early, t, hop) in enumerate(jobs):
            f = free[g % workers]
            for m in range(microbatches):
                f = max(f + early, ready[m] + (hop if j else 0.0)) + t
                ready[m] = f
            free[g % workers] = f
            g += 1
        ends.append(max(ready))
    return ends[0] if calls == 1 else (ends[-1] - ends[0]) / (calls - 1)


def roundpipe_plans(costs: ModelCosts, workers: int, microbatches: int, *,
                    overlap: bool = False, max_tail_layers: int = 3) -> list[Plan]:
    """Candidate RoundPipe plans for ``costs``, best first by
    :func:`estimate_roundpipe_ms` (fewest stages on ties; with ``overlap``, for the
    steady state of overlapping calls). Stages are sized near the heaviest single job
    (usually the fused tail): around that many forward and backward stages are tried,
    with tails of 1 to ``max_tail_layers`` layers."""
    L = len(costs.layers)
    if L == 1:
        return [_plan(1, [], (0, 1), [])]
    f = [l.forward_ms for l in costs.layers]
    rb = [l.recompute_ms + l.backward_ms for l in costs.layers]
    scored: list[tuple[float, int, int, Plan]] = []
    for tail_layers in range(1, min(max_tail_layers, L - 1) + 1):
        body = L - tail_layers
        tail_ms = sum(f[body:]) + sum(l.backward_ms for l in costs.layers[body:])
        job = max([tail_ms] + rb[:body] + f[:body]) or 1.0
        nf0 = max(1, math.ceil(sum(f[:body]) / job))
        nb0 = max(1, math.ceil(sum(rb[:body]) / job))
        for nf in range(max(1, nf0 - 1), min(body, nf0 + 2) + 1):
            for nb in range(max(1, nb0 - 1), min(body, nb0 + workers) + 1):
                plan = _plan(L, split_balanced(f[:body], nf), (body, L),
                             split_balanced(rb[:body], nb))
                t = estimate_roundpipe_ms(plan, costs, workers, microbatches,
                                          calls=6 if overlap else 1)
                scored.append((round(t, 6), nf + nb, len(scored), plan))
    return [plan for *_, plan in sorted(scored, key=lambda x: x[:3])]


def roundpipe_plan(costs: ModelCosts, workers: int, microbatches: int, *,
                   overlap: bool = False) -> Plan:
    """The best of :func:`roundpipe_plans` by the job-grain estimate."""
    return roundpipe_plans(costs, workers, microbatches, overlap=overlap)[0]


def greedy_compute_plan(costs: ModelCosts, tail_layers: int = 1) -> Plan:
    """The authors' partitioner, for comparison: layers packed greedily from the front
    into stages no heavier (in compute time) than the heaviest single layer's job,
    forward and backward independently; memory and PCIe are ignored."""
    L = len(costs.layers)
    body = L - min(tail_layers, L)
    f = [l.forward_ms for l in costs.layers]
    rb = [l.recompute_ms + l.backward_ms for l in costs.layers]

    def pack(times: list[float]) -> list[tuple[int, int]]:
        limit = max(times[:L]) * (1 + 1e-9)
        runs, a, acc = [], 0, 0.0
        for i in range(body):
            if i > a and acc + times[i] > limit:
                runs.append((a, i))
                a, acc = i, 0.0
            acc += times[i]
        return runs + ([(a, body)] if body else [])

    return _plan(L, pack(f), (body, L), pack(rb))
