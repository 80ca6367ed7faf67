"""The job-grain step estimate the partitioner ranks its candidate cuts with
(:func:`estimate_step_ms`), and the re-timer its local search uses (:class:`Retimer`:
the same arithmetic from the first job a move changes). Pure arithmetic on a
:class:`~rotapipe.plan.partitioner.Footprint`; the planner simulates the best
candidates."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import PlanError
from .partition import Plan, StageKind

if TYPE_CHECKING:
    from .partitioner import Footprint

__all__ = ["estimate_step_ms", "estimate", "Retimer"]


def estimate_step_ms(plan: Plan, fp: Footprint, workers: int, calls: int = 1) -> float:
    """Step time at job grain: job ``g`` runs on worker ``g % workers``; its weights
    upload on the worker's link once the job two back there has ended (two stages
    resident) and the link is free; microbatch ``m`` starts when the worker is free,
    the weights are in, and microbatch ``m`` of the previous job has crossed to the
    host and back. A call ends when its last microbatch is through and every tail and
    backward job's weight gradients are down (its layers' ``dw_ms`` after its last
    compute: as long as the upload, or the adapters' gradients with LoRA). With
    ``calls > 1``: the mean period of overlapping calls."""
    return estimate(fp, [(s.start, s.stop) for s in plan.forward], plan.tail.start,
                     [(s.start, s.stop) for s in plan.backward], plan.tail_jobs, workers,
                     calls)


def _job_terms(fp: Footprint, kind: StageKind, a: int, b: int) -> tuple[float, ...]:
    """(early, per-microbatch time, weight upload, hop in, weight-gradient download) of
    a job over ``[a, b)``: ``early`` is the recompute a backward job may run before its
    input gradient; a forward job downloads no weight gradient."""
    cache = fp.__dict__.setdefault("_values", {})
    key = ("job", kind, a, b)
    t = cache.get(key)
    if t is None:
        c = fp.costs
        up = fp._sum("up", a, b)
        if kind is StageKind.FORWARD:
            t = (0.0, fp._sum("f", a, b), up, 2 * c.boundary_hop_ms(a), 0.0)
        elif kind is StageKind.TAIL:
            t = (0.0, fp._sum("f", a, b) + c.sum("backward_ms", a, b), up,
                 2 * c.boundary_hop_ms(a), fp._sum("dw", a, b))
        else:
            rb = fp._sum("rb", a, b)
            bw = c.sum("backward_ms", a, b)
            t = (rb - bw, bw, up, 2 * c.boundary_hop_ms(b), fp._sum("dw", a, b))
        cache[key] = t
    return t


def estimate(fp: Footprint, fwd, tail: int, bwd, tail_jobs: int, workers: int,
              calls: int) -> float:
    """:func:`estimate_step_ms` of the plan with forward runs ``fwd``, the tail from
    layer ``tail`` in ``tail_jobs`` jobs and backward runs ``bwd`` (no :class:`Plan`
    built: the candidate search scores thousands)."""
    jobs, mbs = _jobs(fp, fwd, tail, bwd, tail_jobs)
    return _run_jobs(jobs, mbs, len(fwd), fp.microbatches, workers, calls)


def _jobs(fp: Footprint, fwd, tail: int, bwd, tail_jobs: int):
    """(each job's :func:`_job_terms`, each job's microbatches), in dispatch order."""
    M, n = fp.microbatches, len(fp.costs.layers)
    if tail_jobs > M:
        raise PlanError(f"the tail is split into {tail_jobs} jobs but a call has only "
                        f"{M} microbatches: use at least {tail_jobs} microbatches "
                        "or fewer tail jobs")
    F, B, T = StageKind.FORWARD, StageKind.BACKWARD, StageKind.TAIL
    jobs = [_job_terms(fp, F, a, b) for a, b in fwd]
    jobs += [_job_terms(fp, T, tail, n)] * tail_jobs
    jobs += [_job_terms(fp, B, a, b) for a, b in reversed(bwd)]
    whole = range(M)
    mbs = [whole] * len(fwd) + [range(i, M, tail_jobs) for i in range(tail_jobs)] + \
        [whole] * len(bwd)
    return jobs, mbs


def _run_jobs(jobs, mbs, nf: int, M: int, workers: int, calls: int, *,
              resume=None, states: list | None = None) -> float:
    """The job-grain estimate of ``jobs`` (the first ``nf`` of them forward) over
    ``calls`` calls. ``states`` (one call only) collects the state before each job:
    ``resume=(j, state)`` starts from ``states[j]`` of a run whose first ``j`` jobs
    were the same (the local search re-times only the jobs a move changed; the
    arithmetic is the same, so is the result)."""
    free = [0.0] * workers
    link = [0.0] * workers
    ended: list[float] = []
    ends, g = [], 0
    back = 2 * workers
    j0 = 0
    for _ in range(calls):
        ready = [0.0] * M
        last = 0.0      # the call's last weight-gradient download ends
        if resume is not None:
            j0, (f0, l0, r0, last, e0) = resume
            free, link, ready, ended, g = list(f0), list(l0), list(r0), e0[:j0], j0
            resume = None
        for j in range(j0, len(jobs)):
            early, t, up, hop, dw = jobs[j]
            if states is not None:
                states.append((tuple(free), tuple(link), tuple(ready), last, ended))
            w = g % workers
            two_back = ended[g - back] if g >= back else 0.0
            lw = link[w]
            lw = link[w] = (lw if lw >= two_back else two_back) + up
            f = free[w]
            if lw > f:
                f = lw
            if not j:
                hop = 0.0
            # f = max(f + early, ready[m] + hop) + t, written out (the hot loop).
            for m in mbs[j]:
                x = ready[m] + hop
                f += early
                f = (f if f >= x else x) + t
                ready[m] = f
            free[w] = f
            ended.append(f)
            if j >= nf and f + dw > last:
                last = f + dw   # its weight gradients go down
            g += 1
        ends.append(max(last, max(ready)))
        j0 = 0
    return ends[0] if calls == 1 else (ends[-1] - ends[0]) / (calls - 1)


class Retimer:
    """:func:`estimate` of the local search's moves, each computed once, and from the
    first job a move changes: the jobs before it run as in the current cut (the
    ``rebase``), so their state is taken from its run (one call only; with
    overlapping calls every move is timed whole). The result is :func:`estimate`'s,
    to the bit."""

    def __init__(self, fp: Footprint, body: int, tail_jobs: int, workers: int, calls: int):
        self.fp, self.body, self.tail_jobs = fp, body, tail_jobs
        self.workers, self.calls = workers, calls
        self.memo: dict[tuple, float] = {}
        self.base = None

    def rebase(self, fwd, bwd) -> None:
        """Make ``fwd`` / ``bwd`` the cut moves are compared with."""
        if self.calls != 1:
            return
        jobs, mbs = _jobs(self.fp, fwd, self.body, bwd, self.tail_jobs)
        states: list = []
        _run_jobs(jobs, mbs, len(fwd), self.fp.microbatches, self.workers, 1,
                  states=states)
        self.base = (jobs, mbs, len(fwd), states)

    def __call__(self, fwd, bwd) -> float:
        key = (tuple(fwd), tuple(bwd))
        e = self.memo.get(key)
        if e is not None:
            return e
        jobs, mbs = _jobs(self.fp, fwd, self.body, bwd, self.tail_jobs)
        resume = None
        if self.base is not None:
            bjobs, bmbs, bnf, states = self.base
            # The state before job j depends only on the jobs before it (their terms,
            # microbatches, and which are forward).
            stop = min(len(jobs), len(bjobs), len(fwd), bnf) if len(fwd) != bnf else \
                min(len(jobs), len(bjobs))
            j = 0
            while j < stop and jobs[j] == bjobs[j] and mbs[j] == bmbs[j]:
                j += 1
            if 0 < j < len(states):
                resume = (j, states[j])
        e = _run_jobs(jobs, mbs, len(fwd), self.fp.microbatches, self.workers,
                      self.calls, resume=resume)
        self.memo[key] = e
        return e
