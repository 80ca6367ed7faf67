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
- *window*: a worker holds two stages' weights, so job ``j``'s upload starts only
  after the job two turns back on its worker has ended, and after the worker's
  previous upload; its compute follows its weights and the previous job's compute;
- *links*: each worker's upload and download links carry its weights, activations
  and gradients one transfer at a time.

Pure arithmetic and the simulator; stale (overlapping) calls are not covered.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..plan import ModelCosts, Plan, StageKind
from ..plan.partitioner import Direction, Footprint, assemble_plan
from ..sim.report import Report

__all__ = ["step_lower_bound", "call_lower_bound", "exact_search"]

_FWD, _TAIL, _BWD = 0, 1, 2
_KIND = {StageKind.FORWARD: _FWD, StageKind.TAIL: _TAIL, StageKind.BACKWARD: _BWD}


class _Terms:
    """Per-job terms of the bound, from prefix sums of one :class:`ModelCosts`."""

    def __init__(self, costs: ModelCosts, microbatches: int):
        self.costs, self.M = costs, microbatches
        acc = {k: [0.0] for k in ("f", "r", "b", "u", "g")}
        for l in costs.layers:
            for k, v in (("f", l.forward_ms), ("r", l.recompute_ms), ("b", l.backward_ms),
                         ("u", l.upload_ms), ("g", l.dw_ms)):
                acc[k].append(acc[k][-1] + v)
        self.acc = acc
        self.cache: dict[tuple[int, int, int], tuple[float, ...]] = {}

    def of(self, kind: int, a: int, b: int, n: int | None = None) -> tuple[float, ...]:
        """(chain, after, full, into, ready, dw, up_link, down_link, up, early) of a job:
        ``chain`` its compute on one microbatch's critical path, ``after`` its compute
        lane's work from the first chained compute on, ``full`` all its compute,
        ``into`` the hops from the previous job (job 0: the input upload), ``ready``
        its earliest first chained compute start by its own weight upload, ``dw`` its
        weight-gradient download, its upload and download link time, its weight upload
        ``up`` and ``early`` the compute it may run before its first chained one (a
        backward stage's first recompute). ``n``: the
        microbatches the job runs (a split tail's job runs a share; default all)."""
        key = (kind, a, b, n)
        t = self.cache.get(key)
        if t is None:
            t = self.cache[key] = self._of(kind, a, b, self.M if n is None else n)
        return t

    def _of(self, kind, a, b, M):
        acc, hop = self.acc, self.costs.boundary_hop_ms
        # dw: the weight-gradient download (the upload's length unless LoRA's grad_ms)
        f, r, bw, up, dw = (acc[k][b] - acc[k][a] for k in ("f", "r", "b", "u", "g"))
        if kind == _FWD:
            into = 2 * hop(a) if a else hop(0)
            return (f, M * f, M * f, into, up, 0.0, up + M * hop(a), M * hop(b), up, 0.0)
        if kind == _TAIL:
            into = 2 * hop(a) if a else hop(0)
            c = f + bw
            return (c, M * c, M * c, into, up, dw, up + M * hop(a), M * hop(a) + dw, up, 0.0)
        return (bw, M * bw + (M - 1) * r, M * (r + bw), 2 * hop(b), up + r, dw,
                up + M * (hop(a) + hop(b)), (M * hop(a) if a else 0.0) + dw, up, r)

    def jobs(self, plan: Plan) -> list[tuple[float, ...]]:
        """The terms of every job of ``plan``, in execution order."""
        return [self.of(_KIND[s.kind], s.start, s.stop,
                        len(plan.tail_microbatches(s.index, self.M))
                        if s.kind is StageKind.TAIL and plan.tail_jobs > 1 else None)
                for s in plan.jobs()]


def _bound(terms: Sequence[tuple[float, ...]], workers: int, tail: tuple[int, int] = (0, 0),
           ) -> float:
    """The bound of jobs with ``terms`` dealt round-robin over ``workers``. ``tail``:
    the ``[start, stop)`` job indices of a tail split into parallel jobs (each
    microbatch crosses only one of them, so the chains count one)."""
    J = len(terms)
    p, q = tail
    if q - p <= 1:
        p = q = 0
    # rest[j]: after the last microbatch leaves job j, the later jobs' chain + final DW.
    rest = [0.0] * J
    acc = terms[-1][5]
    for j in range(J - 1, -1, -1):
        if p <= j < q:
            # A tail job: the backward jobs follow (with none, its own DW ends the call).
            rest[j] = acc if q < J else terms[j][5]
            if j == p:
                acc += terms[j][3] + terms[j][0]
            continue
        rest[j] = acc
        acc += terms[j][3] + terms[j][0]
    # own[j]: from job j's first compute on, what worker j % workers still must run.
    own = [0.0] * J
    for j in range(J - 1, -1, -1):
        nxt = j + workers
        own[j] = terms[j][2] + (own[nxt] if nxt < J else max(rest[j], terms[j][5]))
    best = 0.0
    head = terms[0][3] + terms[0][4]   # the input and the weights share the upload link
    # up[j], end[j]: job j's weights are in, its last compute ends. A worker uploads
    # its jobs' weights in turn, and job j's only once job j - 2 * workers (two back on
    # its worker) has ended and freed its own; its compute follows its weights and the
    # worker's previous job.
    up, end = [0.0] * J, [0.0] * J
    for j in range(J):
        t = terms[j]
        if j and not p < j < q:        # the tail's jobs all wait on the same chain
            head += t[3]
        h = max(head, t[4])
        nxt = j + workers
        later = own[nxt] if nxt < J else max(rest[j], t[5])
        best = max(best, h + t[1] + max(rest[j], later))
        if not p <= j < q - 1:
            head += t[0]
        prev = j - workers
        up[j] = max(up[prev] if prev >= 0 else 0.0,
                    end[j - 2 * workers] if j >= 2 * workers else 0.0) + t[8]
        end[j] = max(up[j] + t[2], max(h, up[j] + t[9]) + t[1],
                     (end[prev] if prev >= 0 else 0.0) + t[2])
        best = max(best, end[j] + max(rest[j], t[5]))
    for w in range(min(workers, J)):
        best = max(best, sum(terms[j][6] for j in range(w, J, workers)),
                   sum(terms[j][7] for j in range(w, J, workers)))
    return best


def step_lower_bound(plan: Plan, costs: ModelCosts, workers: int, microbatches: int) -> float:
    """A lower bound (ms) on :func:`~rotapipe.planner.autoplan.simulate_plan` of ``plan``
    (one training call, exact optimizer; a split tail's jobs each run their share of
    the microbatches); see the module docstring."""
    return _plan_bound(plan, _Terms(costs, microbatches), workers)


def _plan_bound(plan: Plan, terms: _Terms, workers: int) -> float:
    """:func:`step_lower_bound` with the per-job terms of a :class:`_Terms` (reused
    across the plans of one ``costs`` and microbatch count)."""
    F = len(plan.forward)
    return _bound(terms.jobs(plan), workers, (F, F + plan.tail_jobs))


def call_lower_bound(costs: ModelCosts, workers: int, microbatches: int, *,
                     tail_jobs: int = 1, max_tail: int | None = None) -> float:
    """A lower bound (ms) on the simulated step of *every* plan of ``costs`` with
    ``tail_jobs`` tail jobs and a fused tail of at most ``max_tail`` layers (default:
    any length), one call with the exact optimizer. The largest of:

    - *flow*: the bound of :func:`step_lower_bound` summed over any cut. The first
      job's input and weights (at least layer 0's) share its upload link; microbatch
      0 then crosses every layer's forward and backward; one job runs its other
      microbatches in between (a layer in a forward stage: ``M - 1`` more forwards; in
      a backward stage: ``M - 1`` more recomputes and backwards; in the tail: the
      first tail job's other microbatches of forward + backward; a body layer is in
      both a forward and a backward stage); the last job's weight gradients (it
      holds layer 0) go down last (``dw_ms``);
    - *work*: all compute (every layer's forward and backward, the recompute of the
      layers outside the tail) over the workers;
    - *ends*: for any layer ``j``, no compute of layers ``j`` onward starts before
      ``j``'s weights are up, and once ``j``'s last backward ends every compute of the
      later layers has ended (each microbatch's backward reaches ``j`` after them), so
      only the earlier layers' work can run beside ``j``'s gradient download. The rest
      of the work fills at most the time between: ``upload(j) + dw(j) + (work - work
      of the layers before j) / workers``. At a call's two ends every worker idles
      while the first heavy layer's weights go up and its gradients go down
      (GPT-OSS-20B: 66 ms each way; docs/planning.md).

    The planner skips a microbatch count, grain or tail split whose bound exceeds the
    best step simulated so far."""
    layers, M = costs.layers, microbatches
    L = len(layers)
    # The tail's layers are never recomputed; with one layer the tail is all of them.
    t_max = 1 if L == 1 else L - 1 if max_tail is None else min(max(max_tail, 1), L - 1)
    share = -(-M // tail_jobs) - 1            # the first tail job's other microbatches
    fb = [l.forward_ms + l.backward_ms for l in layers]
    extra = [share * fb[-1]] + [
        min(share * fb[i], (M - 1) * max(l.forward_ms, l.recompute_ms + l.backward_ms))
        for i, l in enumerate(layers[:-1])]
    flow = (costs.input_hop_ms + (layers[0].upload_ms + layers[0].dw_ms) + sum(fb)
            + max(extra))
    recomputed = [l.recompute_ms if i < L - t_max else 0.0 for i, l in enumerate(layers)]
    total = M * (sum(fb) + sum(recomputed))
    ends, before = 0.0, 0.0             # before: the work of the layers before j
    for j, l in enumerate(layers):
        ends = max(ends, l.upload_ms + l.dw_ms + (total - before) / workers)
        before += M * (fb[j] + recomputed[j])
    return max(flow, total / workers, ends)


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
            if fp.prefetch * max(fres, tres) + max(frw, trw) > memory:
                continue
            head = [terms.of(_FWD, a, b) for a, b in fwd] + [tjob]
            for bwd, (bres, brw) in bwds:
                if fp.prefetch * max(fres, bres, tres) + max(frw, brw, trw) > memory:
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
