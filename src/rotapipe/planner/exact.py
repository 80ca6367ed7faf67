"""Exact plan search on small models: every RoundPipe plan, bounded below, simulated
best-first until no unsimulated plan can beat the best simulated one.

A model of ``L`` layers has :func:`~rotapipe.planner.autoplan.plan_space` ``(L)`` plans
(87,381 for 10 layers): too many to simulate each (about a millisecond apiece), few
enough to bound each. :func:`step_lower_bound` bounds the simulated step of
:func:`~rotapipe.schedule.roundpipe_schedule` from per-stage sums and never exceeds it
(``tests/test_planner.py`` checks every plan of random small models against the
simulator). Simulating plans in increasing bound order and stopping at the first
bound that reaches the best simulated step finds the same step as simulating every
plan, after simulating a small fraction of them.

The bound is the largest of, for each job ``j`` (on worker ``w``):

- *flow*: the first microbatch reaches job ``j`` no earlier than the chain of the
  earlier jobs' compute for one microbatch, two hops per boundary (a stage's input
  goes down to the host and up again) and job 0's weight and input uploads (one
  link); ``j``'s compute lane then runs every microbatch in order (a backward stage's
  first recompute may run early, each later one follows the backward before it); the
  last microbatch then still crosses every later job, and the last job downloads its
  weight gradients;
- *worker*: from that point worker ``w`` also runs every later job dealt to it;
- *links*: each worker's upload and download links carry its weights, activations
  and gradients one transfer at a time.

Pure arithmetic and the simulator; stale (overlapping) calls are not covered.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..plan import ModelCosts, Plan, StageKind
from ..plan.partitioner import Direction, Footprint, assemble_plan
from ..sim.report import Report

__all__ = ["step_lower_bound", "exact_search"]

_FWD, _TAIL, _BWD = 0, 1, 2
_KIND = {StageKind.FORWARD: _FWD, StageKind.TAIL: _TAIL, StageKind.BACKWARD: _BWD}


class _Terms:
    """Per-job terms of the bound, from prefix sums of one :class:`ModelCosts`."""

    def __init__(self, costs: ModelCosts, microbatches: int):
        self.costs, self.M = costs, microbatches
        acc = {k: [0.0] for k in ("f", "r", "b", "u")}
        for l in costs.layers:
            for k, v in (("f", l.forward_ms), ("r", l.recompute_ms), ("b", l.backward_ms),
                         ("u", l.upload_ms)):
                acc[k].append(acc[k][-1] + v)
        self.acc = acc
        self.cache: dict[tuple[int, int, int], tuple[float, ...]] = {}

    def of(self, kind: int, a: int, b: int) -> tuple[float, ...]:
        """(chain, after, full, into, ready, dw, up_link, down_link) of a job:
        ``chain`` its compute on one microbatch's critical path, ``after`` its compute
        lane's work from the first chained compute on, ``full`` all its compute,
        ``into`` the hops from the previous job (job 0: the input upload), ``ready``
        its earliest first chained compute start by its own weight upload, ``dw`` its
        weight-gradient download, and its upload and download link time."""
        key = (kind, a, b)
        t = self.cache.get(key)
        if t is None:
            t = self.cache[key] = self._of(kind, a, b)
        return t

    def _of(self, kind, a, b):
        acc, M, hop = self.acc, self.M, self.costs.boundary_hop_ms
        f, r, bw, up = (acc[k][b] - acc[k][a] for k in ("f", "r", "b", "u"))
        if kind == _FWD:
            into = 2 * hop(a) if a else hop(0)
            return (f, M * f, M * f, into, up, 0.0, up + M * hop(a), M * hop(b))
        if kind == _TAIL:
            into = 2 * hop(a) if a else hop(0)
            c = f + bw
            return (c, M * c, M * c, into, up, up, up + M * hop(a), M * hop(a) + up)
        return (bw, M * bw + (M - 1) * r, M * (r + bw), 2 * hop(b), up + r, up,
                up + M * (hop(a) + hop(b)), (M * hop(a) if a else 0.0) + up)


def _bound(terms: Sequence[tuple[float, ...]], workers: int) -> float:
    J = len(terms)
    # rest[j]: after the last microbatch leaves job j, the later jobs' chain + final DW.
    rest = [0.0] * J
    acc = terms[-1][5]
    for j in range(J - 1, -1, -1):
        rest[j] = acc
        acc += terms[j][3] + terms[j][0]
    # own[j]: from job j's first compute on, what worker j % workers still must run.
    own = [0.0] * J
    for j in range(J - 1, -1, -1):
        nxt = j + workers
        own[j] = terms[j][2] + (own[nxt] if nxt < J else max(rest[j], terms[j][5]))
    best = 0.0
    head = terms[0][3] + terms[0][4]   # the input and the weights share the upload link
    for j in range(J):
        t = terms[j]
        if j:
            head += t[3]
        h = max(head, t[4])
        nxt = j + workers
        later = own[nxt] if nxt < J else max(rest[j], t[5])
        best = max(best, h + t[1] + max(rest[j], later))
        head += t[0]
    for w in range(min(workers, J)):
        best = max(best, sum(terms[j][6] for j in range(w, J, workers)),
                   sum(terms[j][7] for j in range(w, J, workers)))
    return best


def step_lower_bound(plan: Plan, costs: ModelCosts, workers: int, microbatches: int) -> float:
    """A lower bound (ms) on :func:`~rotapipe.planner.autoplan.simulate_plan` of ``plan``
    (one training call, exact optimizer); see the module docstring."""
    terms = _Terms(costs, microbatches)
    return _bound([terms.of(_KIND[s.kind], s.start, s.stop) for s in plan.jobs()], workers)


def _cuts(n: int) -> list[tuple[tuple[int, int], ...]]:
    """Every cut of ``[0, n)`` into consecutive non-empty runs."""
    out = []
    for mask in range(1 << max(0, n - 1)):
        bounds = [0] + [i + 1 for i in range(n - 1) if mask >> i & 1] + [n]
        out.append(tuple(zip(bounds, bounds[1:])))
    return out


def _fits(fp: Footprint, direction: str, runs) -> tuple[int, int]:
    """(largest resident bytes, largest resident + working bytes) of ``runs``."""
    if not runs:
        return 0, 0
    return (max(fp.resident(direction, a, b) for a, b in runs),
            max(fp.resident(direction, a, b) + fp.working(direction, a, b) for a, b in runs))


def exact_search(costs: ModelCosts, fp: Footprint, workers: int, microbatches: int,
                 memory: int, simulate, tail_layers: int | None = None,
                 ) -> tuple[Plan, Report, int] | None:
    """The plan with the fastest simulated step among every plan whose
    :func:`~rotapipe.planner.autoplan.device_need` fits ``memory``; returns (plan, report,
    plans simulated), or None if no plan fits. ``simulate(plan) -> Report`` runs one
    call; ``costs`` must be the costs it simulates with (recompute as the grain runs
    it) and ``fp`` the footprint of the same grain. ``tail_layers`` fixes the fused
    tail's length (``None``: every length)."""
    L = len(costs.layers)
    terms = _Terms(costs, microbatches)
    bounded: list[tuple[float, int, tuple, tuple]] = []
    if L == 1:
        tails = [1]                        # the only plan: the whole model is the tail
    else:
        tails = range(1, L) if tail_layers is None else [t for t in [tail_layers] if t < L]
    for tail in tails:
        body = L - tail
        tres, trw = _fits(fp, Direction.BACKWARD, [(body, L)])
        tjob = terms.of(_TAIL, body, L)
        fwds = [(c, _fits(fp, Direction.FORWARD, c)) for c in _cuts(body)] if body else [((), (0, 0))]
        bwds = [(c, _fits(fp, Direction.BACKWARD, c)) for c in _cuts(body)] if body else [((), (0, 0))]
        for fwd, (fres, frw) in fwds:
            if max(fres, tres) + max(frw, trw) > memory:
                continue
            head = [terms.of(_FWD, a, b) for a, b in fwd] + [tjob]
            for bwd, (bres, brw) in bwds:
                if max(fres, bres, tres) + max(frw, brw, trw) > memory:
                    continue
                jobs = head + [terms.of(_BWD, a, b) for a, b in reversed(bwd)]
                bounded.append((_bound(jobs, workers), body, fwd, bwd))
    if not bounded:
        return None
    bounded.sort(key=lambda x: x[0])
    best: tuple[Plan, Report] | None = None
    simulated = 0
    for lb, body, fwd, bwd in bounded:
        # Rounding slack: a plan whose bound equals the best step cannot beat it.
        if best is not None and lb * (1 - 1e-9) >= best[1].step_ms:
            break
        plan = assemble_plan(L, fwd, body, bwd)
        rep = simulate(plan)
        simulated += 1
        if best is None or rep.step_ms < best[1].step_ms - 1e-9 * max(rep.step_ms, 1.0):
            best = (plan, rep)
    return best[0], best[1], simulated
