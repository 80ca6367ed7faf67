"""The memory-aware partitioner: exact min-max stage cuts under a device-memory limit,
and the candidate RoundPipe plans they give.

A stage's *cost* is the time its job holds a worker: ``M`` microbatches of its compute
(forward; recompute + backward; forward + backward for the fused tail), or its weight
upload over PCIe if that is longer (the upload of a worker's next stage is hidden
behind its current stage only if it is no longer). A stage *fits* when, on its worker,

    resident(stage) + prefetch * cap + working(stage) <= usable memory,  resident <= cap

where ``resident`` is its weights (plus weight gradients for stages that run backward),
``cap`` bounds the resident bytes of each stage prefetched beside it (with
``PipeConfig.prefetch`` = ``prefetch``, at most ``prefetch + 1`` stages are resident per
worker, see :mod:`rotapipe.schedule.roundpipe`), and ``working`` is
one microbatch's working set (:meth:`Footprint.working`). This is a sufficient
condition: a plan whose stages all fit never exceeds the limit.

For a stage count ``k`` the partitioner finds the cut with the smallest heaviest stage
among the cuts whose stages all fit (:func:`min_max_cut`). It is exact: cost and
memory of a run of layers only grow when the run grows, so the greedy "extend every
stage as far as the threshold allows" cut uses the fewest stages for a threshold, and a
binary search over the O(n^2) possible stage costs finds the smallest threshold that
``k`` stages reach (a split of a fitting stage still fits, so fewer stages can always be
split up to ``k``). The tests check it against brute force. Which ``k``, tail size and
grain are best is decided by step time: :func:`candidate_plans` ranks them with
:func:`estimate_step_ms`; :mod:`rotapipe.planner.autoplan` simulates the best.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .._enums import RecomputeGrain
from ..errors import PlanError
from .costs import ModelCosts
from .estimate import Retimer, estimate, estimate_step_ms
from .partition import INPUT_DEPTH, Plan, Stage, StageKind

__all__ = ["Footprint", "Direction", "min_max_cut", "candidate_plans", "estimate_step_ms",
           "assemble_plan", "check_layers_fit", "candidate_tail_sizes",
           "INPUT_DEPTH"]


class Direction:
    """Which pass a run of layers is cut for (plain strings)."""

    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass(frozen=True)
class Footprint:
    """Per-layer times and bytes the partitioner reads, for ``microbatches`` microbatches.

    Built from :class:`~rotapipe.plan.ModelCosts` by :meth:`of`; prefix sums make a run's
    cost O(1)."""

    costs: ModelCosts
    microbatches: int
    grain: RecomputeGrain
    grad_bytes: tuple[int, ...]
    """Bytes of each layer's weight gradients on the device (0 for frozen layers)."""
    prefetch: int = 1
    """Stages whose weights a worker uploads ahead of the one it computes
    (``PipeConfig.prefetch``): each is counted at the resident cap."""

    @classmethod
    def of(cls, costs: ModelCosts, microbatches: int,
           grain: RecomputeGrain = RecomputeGrain.STAGE,
           grad_bytes: Sequence[int] | None = None, prefetch: int = 1) -> Footprint:
        grads = tuple(grad_bytes) if grad_bytes is not None else \
            tuple(l.weight_bytes for l in costs.layers)
        if len(grads) != len(costs.layers):
            raise PlanError(f"grad_bytes has {len(grads)} entries for "
                            f"{len(costs.layers)} layers")
        if not isinstance(prefetch, int) or prefetch < 1:
            raise PlanError(f"prefetch={prefetch!r} must be an int >= 1")
        fp = cls(costs, microbatches, grain, grads, prefetch)
        fp._prefix()
        return fp

    def _prefix(self) -> None:
        acc = {k: [0.0] for k in ("f", "rb", "up", "dw", "w", "g", "out", "saved")}
        for l, g in zip(self.costs.layers, self.grad_bytes):
            rec = l.recompute_ms * (2 if self.grain is RecomputeGrain.LAYER else 1)
            for k, v in (("f", l.forward_ms), ("rb", rec + l.backward_ms),
                         ("up", l.upload_ms), ("dw", l.dw_ms), ("w", l.weight_bytes),
                         ("g", g),
                         ("out", l.output_bytes), ("saved", l.saved_bytes)):
                acc[k].append(acc[k][-1] + v)
        object.__setattr__(self, "_acc", acc)

    def _sum(self, key: str, a: int, b: int) -> float:
        p = self._acc[key]
        return p[b] - p[a]

    def boundary(self, at: int) -> int:
        return self.costs.input_bytes if at == 0 else self.costs.layers[at - 1].output_bytes

    def cost(self, direction: str, a: int, b: int) -> float:
        """Time layers ``[a, b)`` hold a worker for one job (all microbatches)."""
        compute = self._sum("f" if direction == Direction.FORWARD else "rb", a, b)
        return max(self.microbatches * compute, self._sum("up", a, b))

    def tail_cost(self, a: int, jobs: int = 1) -> float:
        """Time one of ``jobs`` tail jobs from layer ``a`` holds its worker."""
        n = len(self.costs.layers)
        compute = self._sum("f", a, n) + self.costs.sum("backward_ms", a, n)
        share = math.ceil(self.microbatches / jobs)
        return max(share * compute, self._sum("up", a, n))

    def resident(self, direction: str, a: int, b: int) -> int:
        """Weights (+ their gradients when the stage runs backward) of ``[a, b)``."""
        w = self._sum("w", a, b)
        return int(w + (self._sum("g", a, b) if direction != Direction.FORWARD else 0))

    def working(self, direction: str, a: int, b: int, max_saved: int | None = None) -> int:
        """Device bytes of one microbatch in flight through ``[a, b)`` besides weights:
        ``INPUT_DEPTH`` inputs (plus output gradients going backward), the output, and
        the activations the pass keeps: a forward keeps one layer's at a time, a
        stage-grain backward the whole stage's, a layer-grain backward one layer's
        plus each layer's input checkpoint. The tail (``b`` = number of layers) keeps
        its whole stage's activations: it never recomputes."""
        if max_saved is None:
            max_saved = max(l.saved_bytes for l in self.costs.layers[a:b])
        inp, out = self.boundary(a), self.boundary(b)
        if direction == Direction.FORWARD:
            return int(INPUT_DEPTH * inp + out + max_saved)
        edges = INPUT_DEPTH * (inp + out) + inp
        if b == len(self.costs.layers) or self.grain is RecomputeGrain.STAGE:
            return int(edges + self._sum("saved", a, b))
        return int(edges + max_saved + self._sum("out", a, b))

    def needs(self, direction: str, a: int, b: int, cap: int) -> int:
        """Device bytes of a worker running ``[a, b)`` beside :attr:`prefetch` stages of
        ``cap`` bytes."""
        return self.resident(direction, a, b) + self.prefetch * cap + \
            self.working(direction, a, b)


def _memory_reach(fp: Footprint, direction: str, start: int, stop: int, cap: int,
                  memory: int) -> list[int]:
    """``reach[a - start]``: the largest ``b`` such that ``[a, b)`` fits (``a``: none)."""
    key = ("reach", direction, start, stop, cap, memory)
    cache = fp.__dict__.setdefault("_values", {})
    if key in cache:
        return cache[key]
    saved = [l.saved_bytes for l in fp.costs.layers]
    reach, b = [], start
    for a in range(start, stop):
        # Fitting is monotone (a sub-run of a fitting run fits), so b never goes back.
        b = max(b, a)
        while b < stop:
            res = fp.resident(direction, a, b + 1)
            ms = max(saved[a:b + 1])
            need = res + fp.prefetch * cap + fp.working(direction, a, b + 1, ms)
            if res > cap or need > memory:
                break
            b += 1
        reach.append(b)
    cache[key] = reach
    return reach


def _greedy(fp: Footprint, direction: str, start: int, stop: int, limit: float,
            cap: int, memory: int) -> list[tuple[int, int]] | None:
    """Fewest runs over ``[start, stop)`` with cost <= ``limit`` that fit; None if a
    single layer does not. Extending every run as far as allowed is optimal because
    cost and memory grow with the run."""
    acc = fp._acc
    comp = acc["f" if direction == Direction.FORWARD else "rb"]
    up, M = acc["up"], fp.microbatches
    reach = _memory_reach(fp, direction, start, stop, cap, memory)
    runs, a = [], start
    lim = limit + 1e-9 * max(limit if limit < math.inf else 1.0, 1.0)
    while a < stop:
        b, end = a, reach[a - start]
        ca, ua = comp[a], up[a]
        while b < end and M * (comp[b + 1] - ca) <= lim and up[b + 1] - ua <= lim:
            b += 1
        if b == a:
            return None
        runs.append((a, b))
        a = b
    return runs


def _run_costs(fp: Footprint, direction: str, start: int, stop: int) -> list[float]:
    """Every run's cost over ``[start, stop)``, sorted (the thresholds to search)."""
    key = (direction, start, stop)
    cache = fp.__dict__.setdefault("_values", {})
    if key not in cache:
        acc = fp._acc
        comp = acc["f" if direction == Direction.FORWARD else "rb"]
        up, M = acc["up"], fp.microbatches
        cache[key] = sorted({max(M * (comp[b] - comp[a]), up[b] - up[a])
                             for a in range(start, stop) for b in range(a + 1, stop + 1)})
    return cache[key]


def _bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**26 else f"{int(n):,} bytes"


def _fit_error(fp: Footprint, direction: str, start: int, stop: int, cap: int,
               memory: int) -> PlanError:
    for i in range(start, stop):
        need = fp.needs(direction, i, i + 1, max(cap, fp.resident(direction, i, i + 1)))
        if need > memory or fp.resident(direction, i, i + 1) > cap:
            return _layer_error(fp, i, direction, need, cap, memory)
    return PlanError(f"layers [{start}:{stop}) cannot be cut into stages that fit "
                     f"{_bytes(memory)}: use more stages or fewer tokens per microbatch")


def _layer_error(fp: Footprint, i: int, direction: str, need: int, cap: int,
                 memory: int) -> PlanError:
    return PlanError(
        f"layer {i} ({fp.costs.layers[i].name}) alone needs {_bytes(need)} on a worker "
        f"({direction}, {fp.grain.value} recompute, {fp.costs.tokens} tokens per "
        f"microbatch, beside a prefetched stage of {_bytes(cap)}); the usable device "
        f"memory is {_bytes(memory)}: use fewer tokens per microbatch (more "
        "microbatches or a shorter sequence), LoRA, or a device with more memory")


def check_layers_fit(fp: Footprint, memory: int) -> None:
    """Raise :class:`PlanError` naming the layer that needs the most memory alone if
    it exceeds ``memory`` (then no plan fits: every plan holds each layer in some
    stage, beside a prefetched stage at least as large as the largest layer)."""
    n = len(fp.costs.layers)
    roles = [(i, d) for i in range(n - 1) for d in (Direction.FORWARD, Direction.BACKWARD)]
    roles.append((n - 1, Direction.BACKWARD))   # the last layer is always in the tail
    cap = max(fp.resident(d, i, i + 1) for i, d in roles)
    i, d = max(roles, key=lambda r: fp.needs(r[1], r[0], r[0] + 1, cap))
    need = fp.needs(d, i, i + 1, cap)
    if need > memory:
        raise _layer_error(fp, i, d, need, cap, memory)


def min_max_cut(fp: Footprint, direction: str, start: int, stop: int, parts: int, *,
                cap: int, memory: int) -> tuple[float, list[tuple[int, int]]]:
    """The cut of ``[start, stop)`` into exactly ``parts`` runs, each fitting, whose
    heaviest run is lightest; returns (heaviest cost, runs). Raises :class:`PlanError`
    naming the layer that cannot fit, or if ``parts`` runs cannot fit."""
    n = stop - start
    if not 1 <= parts <= n:
        raise PlanError(f"cannot cut {n} layers into {parts} non-empty stages")
    if _greedy(fp, direction, start, stop, math.inf, cap, memory) is None:
        raise _fit_error(fp, direction, start, stop, cap, memory)
    values = _run_costs(fp, direction, start, stop)
    lo = 0
    hi = len(values) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        runs = _greedy(fp, direction, start, stop, values[mid], cap, memory)
        if runs is None or len(runs) > parts:
            lo = mid + 1
        else:
            hi = mid
    runs = _greedy(fp, direction, start, stop, values[lo], cap, memory)
    if runs is None or len(runs) > parts:
        raise PlanError(f"{parts} stages cannot hold layers [{start}:{stop}) within "
                        f"{memory / 2**30:.2f} GiB: use more stages")
    while len(runs) < parts:   # split the heaviest multi-layer run: nothing gets heavier
        i = max((k for k in range(len(runs)) if runs[k][1] - runs[k][0] > 1),
                key=lambda k: fp.cost(direction, *runs[k]))
        a, b = runs[i]
        mid = a + 1 + max(range(b - a - 1), key=lambda m: -abs(
            fp.cost(direction, a, a + 1 + m) - fp.cost(direction, a + 1 + m, b)))
        runs[i:i + 1] = [(a, mid), (mid, b)]
    return max(fp.cost(direction, a, b) for a, b in runs), runs


def assemble_plan(n: int, fwd, tail: int, bwd, tail_jobs: int = 1) -> Plan:
    """A :class:`Plan` of ``n`` layers from ``(start, stop)`` runs: forward ``fwd``, the
    tail from layer ``tail`` (split into ``tail_jobs`` jobs), backward ``bwd``."""
    return Plan(n, tuple(Stage(StageKind.FORWARD, i, a, b) for i, (a, b) in enumerate(fwd)),
                Stage(StageKind.TAIL, 0, tail, n),
                tuple(Stage(StageKind.BACKWARD, i, a, b) for i, (a, b) in enumerate(bwd)),
                tail_jobs)


def _caps(fp: Footprint, n_body: int, memory: int) -> list[int]:
    """Resident-byte caps to try: from the largest single layer up to the share of the
    memory one of the ``prefetch + 1`` resident stages may take."""
    lo = max(max(fp.resident(d, i, i + 1) for i in range(n_body))
             for d in (Direction.FORWARD, Direction.BACKWARD)) if n_body else 0
    lo = max(lo, fp.resident(Direction.BACKWARD, n_body, len(fp.costs.layers)))
    # A cap above the whole model's resident bytes changes nothing.
    hi = max(lo, min(memory // (fp.prefetch + 1),
                     fp.resident(Direction.BACKWARD, 0, len(fp.costs.layers))))
    caps = {lo, hi}
    x = lo
    while lo and x < hi:
        x = int(x * 2)
        caps.add(min(x, hi))
    return sorted(caps)


def candidate_plans(fp: Footprint, workers: int, memory: int, *, calls: int = 1,
                    max_tail_layers: int = 3, spread: int = 2,
                    tail_layers: int | None = None, tail_jobs: int = 1,
                    limit: int | None = None, polish: int = 2) -> list[tuple[float, Plan]]:
    """Fitting RoundPipe plans for ``fp``, best first by :func:`estimate_step_ms`.

    Tries fused tails of 1..``max_tail_layers`` layers and longer ones (sizes growing
    1.5x) while the tail's job is at most one worker's share of the step and fits (a
    longer tail recomputes less), several resident caps, and, per
    direction, stage counts around the count that makes stages as heavy as the heaviest
    single job (RoundPipe's rule) up to ``spread`` workers' worth more; each count gets
    its exact min-max cut. ``tail_layers`` fixes the tail's length instead;
    ``tail_jobs`` splits the tail into that many jobs (each a share of the
    microbatches), which lowers the heaviest job the stages are sized against.
    With ``polish`` (> 0) two families join them: the forward cut with its first
    ``n = 1..workers`` stages one layer each (the first microbatch reaches every
    worker sooner), the rest re-cut; and the best ``polish`` plans re-cut by local
    search on the estimate (:func:`_polish`).
    ``limit``: return only the best ``limit``. Raises :class:`PlanError` (naming the
    layer) if nothing fits."""
    L = len(fp.costs.layers)
    check_layers_fit(fp, memory)
    if L == 1:
        plan = assemble_plan(1, [], 0, [])
        if fp.needs(Direction.BACKWARD, 0, 1, fp.resident(Direction.BACKWARD, 0, 1)) > memory:
            raise _fit_error(fp, Direction.BACKWARD, 0, 1, 0, memory)
        return [(estimate_step_ms(plan, fp, workers, calls), plan)][:limit]
    seen: dict[tuple, float] = {}   # (tail start, forward runs, backward runs) -> estimate
    origin: dict[tuple, int] = {}   # each cap's best plan -> that cap
    tried: set = set()
    error: PlanError | None = None
    if tail_layers is not None and not 1 <= tail_layers < L:
        raise PlanError(f"a fused tail of {tail_layers} layers leaves no layer of the "
                        f"{L} for the forward stages: use 1..{L - 1} tail layers")
    sizes = candidate_tail_sizes(fp, workers, tail_layers=tail_layers,
                                 max_tail_layers=max_tail_layers)
    for tail in sizes:
        body = L - tail
        tail_res = fp.resident(Direction.BACKWARD, body, L)
        for cap in _caps(fp, body, memory):
            if tail_res > cap or fp.needs(Direction.BACKWARD, body, L, cap) > memory:
                error = error or _fit_error(fp, Direction.BACKWARD, body, L, cap, memory)
                continue
            try:
                tail_job = fp.tail_cost(body, tail_jobs)
                cuts = {d: _cuts_for(fp, d, body, workers, cap, memory, tail_job, spread)
                        for d in (Direction.FORWARD, Direction.BACKWARD)}
            except PlanError as exc:
                error = error or exc
                continue
            key = tuple(map(tuple, cuts[Direction.FORWARD] + cuts[Direction.BACKWARD]))
            if key in tried:   # a larger cap changed no cut
                continue
            tried.add(key)
            # Coordinate search: the forward count with a middle backward cut, then the
            # backward count with the best forward cut (the two interact only weakly).
            fwds, bwds = cuts[Direction.FORWARD], cuts[Direction.BACKWARD]

            def score(fwd, bwd):
                key = (body, tuple(fwd), tuple(bwd))
                if key not in seen:
                    seen[key] = estimate(fp, fwd, body, bwd, tail_jobs, workers, calls)
                return seen[key]

            best_f = min(fwds, key=lambda f: score(f, bwds[len(bwds) // 2]))
            best_b = min(bwds, key=lambda b: score(best_f, b))
            last_f = min(fwds, key=lambda f: score(f, best_b))
            f = min((best_f, last_f), key=lambda f: score(f, best_b))
            origin.setdefault((body, tuple(f), tuple(best_b)), cap)
    if not seen:
        raise error or PlanError("no plan fits")
    # Thin first stages on the best few: the first n forward stages one layer each (the
    # first microbatch reaches every worker sooner), the rest re-cut as evenly.
    for body, f, b in sorted(origin, key=seen.get)[:polish]:
        cap = origin[body, f, b]
        for n in range(1, min(workers + 1, len(f))):
            try:
                thin = tuple([(i, i + 1) for i in range(n)] + min_max_cut(
                    fp, Direction.FORWARD, n, body, len(f) - n, cap=cap, memory=memory)[1])
            except PlanError:
                break
            seen.setdefault((body, thin, b),
                            estimate(fp, thin, body, b, tail_jobs, workers, calls))
            origin.setdefault((body, thin, b), cap)
    # Re-cut the best few by local search (see _polish), under the cap each was cut with.
    for key in sorted(origin, key=seen.get)[:polish]:
        body, fwd, bwd = key
        est, fwd, bwd = _polish(fp, body, list(fwd), list(bwd), tail_jobs, workers,
                                calls, origin[key], memory, seen[key])
        seen.setdefault((body, tuple(fwd), tuple(bwd)), est)
    # Ties (rounded) go to fewer jobs, then to the first scored.
    order = sorted(seen.items(), key=lambda kv: (round(kv[1], 6),
                                                 len(kv[0][1]) + tail_jobs + len(kv[0][2])))
    return [(est, assemble_plan(L, fwd, body, bwd, tail_jobs))
            for (body, fwd, bwd), est in order[:limit]]


_POLISH_EVALS = 800
"""Most estimates one :func:`_polish` computes (about 0.1 s of CPU on a 100-job plan;
on the paper's five models the search settles well before)."""


def _moves(runs: list[tuple[int, int]]):
    """Cuts one step from ``runs``: a boundary moved by one layer either way, two
    neighbouring runs merged, a run split in two halves."""
    for i in range(len(runs) - 1):
        (a, b), (_, d) = runs[i], runs[i + 1]
        for nb in (b - 1, b + 1):
            if a < nb < d:
                yield runs[:i] + [(a, nb), (nb, d)] + runs[i + 2:]
        yield runs[:i] + [(a, d)] + runs[i + 2:]
    for i, (a, b) in enumerate(runs):
        if b - a > 1:
            m = (a + b) // 2
            yield runs[:i] + [(a, m), (m, b)] + runs[i + 1:]


def _polish(fp: Footprint, body: int, fwd, bwd, tail_jobs: int, workers: int, calls: int,
            cap: int, memory: int, est: float):
    """Local search from the cut ``fwd`` / ``bwd`` (estimate ``est``): take any single
    move (:func:`_moves`, forward or backward) that lowers
    :func:`~rotapipe.plan.estimate.estimate` and whose runs fit (``cap``, ``memory``), until none does or :data:`_POLISH_EVALS` estimates
    were made. Returns (estimate, forward runs, backward runs).

    Why: the min-max cuts make every stage about equally heavy, but the round-robin
    pays for the first microbatch crossing the first stages (each worker starts one
    stage later than the one before) and for the last crossing the last ones; thinner
    stages there, and job lengths that even out the workers' shares when the job count
    is not a multiple of the workers, shorten the step. The job-grain estimate tracks
    the simulated step closely on such changes; the planner simulates the result."""
    reach = {d: _memory_reach(fp, d, 0, body, cap, memory)
             for d in (Direction.FORWARD, Direction.BACKWARD)}

    def fits(d, runs):
        r = reach[d]
        return all(b <= r[a] for a, b in runs)

    timed = Retimer(fp, body, tail_jobs, workers, calls)
    timed.rebase(fwd, bwd)
    evals, better = 0, True
    while better and evals < _POLISH_EVALS:
        better = False
        for d in (Direction.FORWARD, Direction.BACKWARD):
            for runs in _moves(fwd if d == Direction.FORWARD else bwd):
                f2, b2 = (runs, bwd) if d == Direction.FORWARD else (fwd, runs)
                evals += 1     # a move that does not fit counts, but is not timed
                if fits(d, runs):
                    e = timed(f2, b2)
                    if e < est - 1e-9 * est:
                        est, fwd, bwd, better = e, f2, b2, True
                        timed.rebase(fwd, bwd)
                if evals >= _POLISH_EVALS:
                    break
    return est, fwd, bwd


def candidate_tail_sizes(fp: Footprint, workers: int, *, tail_layers: int | None = None,
                         max_tail_layers: int = 3) -> list[int]:
    """The fused-tail lengths :func:`candidate_plans` tries (see there)."""
    return [tail_layers] if tail_layers else _tail_sizes(fp, workers, max_tail_layers)


def _tail_sizes(fp: Footprint, workers: int, short: int) -> list[int]:
    L = len(fp.costs.layers)
    sizes = list(range(1, min(short, L - 1) + 1))
    share = (fp.cost(Direction.FORWARD, 0, L) + fp.cost(Direction.BACKWARD, 0, L)) / workers
    t = short
    while t < L - 1:
        t = min(L - 1, max(t + 1, int(t * 1.5)))
        if fp.tail_cost(L - t) > share:
            break
        sizes.append(t)
    return sizes


def _cuts_for(fp, direction, body, workers, cap, memory, tail_cost, spread):
    total = fp.cost(direction, 0, body) if body else 0.0
    job = max([tail_cost] + [fp.cost(direction, i, i + 1) for i in range(body)])
    k0 = max(1, math.ceil(total / job)) if job > 0 else 1
    fewest = _greedy(fp, direction, 0, body, math.inf, cap, memory)
    if fewest is None:
        raise _fit_error(fp, direction, 0, body, cap, memory)
    k0 = max(k0, len(fewest))
    ks = range(max(len(fewest), k0 - 1), min(body, k0 + spread * workers) + 1)
    out, last_err = [], None
    cache = fp.__dict__.setdefault("_values", {})
    for k in ks:
        # Memoised per footprint: the planner cuts the same runs for every tail split.
        key = ("cut", direction, body, k, cap, memory)
        if key not in cache:
            try:
                cache[key] = min_max_cut(fp, direction, 0, body, k, cap=cap, memory=memory)[1]
            except PlanError as exc:
                cache[key] = exc
        if isinstance(cache[key], PlanError):
            last_err = cache[key]
        else:
            out.append(cache[key])
    if not out:
        raise last_err
    return out

