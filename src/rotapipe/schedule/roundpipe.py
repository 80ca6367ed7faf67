"""The RoundPipe schedule generator: stage jobs dealt round-robin over stateless workers.

Job ``j`` of the plan's execution order (``F0..Fk-1, T, Bj-1..B0``) runs on worker
``j % workers``. A worker uploads the stage's weights (prefetched while its previous
job computes), runs the stage for every microbatch (each starting as soon as its input
is in host memory), downloads results, and frees the weights. At most two stages'
weights are resident per worker: the upload of job ``j`` waits (on the host) for the
free of the job two back on the same worker.

With the stale optimizer (:func:`roundpipe_stale_schedule`) calls overlap: the stage
jobs of call ``c`` continue the round-robin where call ``c - 1`` stopped, so the next
call's forward stages fill the workers while the previous call's backward drains.
"""

from __future__ import annotations

from collections.abc import Collection

from ..errors import ScheduleError
from ..plan import Plan, Stage, StageKind
from .actions import HOST, Action, ActionKind as K, Schedule, action_key

INPUT_DEPTH = 2
"""Inputs a worker may hold on the device ahead of the compute that consumes them."""


def roundpipe_schedule(plan: Plan, workers: int, microbatches: int, *,
                       side_inputs: bool = False,
                       buffer_layers: Collection[int] = (),
                       training: bool = True, tail_barrier: bool = False) -> Schedule:
    """Generate the RoundPipe schedule of one training call.

    ``side_inputs``: the model has per-microbatch side inputs, uploaded once per
    microbatch per worker (``UZ`` actions). ``buffer_layers``: layers with buffers that
    their forward may update; the stages holding them download buffers (``DB``) and
    backward stages wait for those downloads before uploading the layers again.
    ``tail_barrier``: the first fused-tail action waits until every microbatch's tail
    input has reached host memory (for losses that need whole-batch statistics).
    """
    if workers < 1 or microbatches < 1:
        raise ScheduleError(f"workers={workers} and microbatches={microbatches} must be >= 1")
    gen = _Generator(plan, workers, microbatches, side_inputs, frozenset(buffer_layers))
    gen.tail_barrier = tail_barrier and training and plan.tail.start > 0
    if not training:
        # Evaluation: forward stages only, the tail's layers run as one more forward
        # stage, nothing is checkpointed and no buffer update is kept.
        gen.jobs = plan.eval_jobs()
        gen.checkpoints = frozenset()
        gen.buffer_layers = frozenset()
    for j, stage in enumerate(gen.jobs):
        gen.job(j, stage)
    return Schedule(plan, workers, microbatches, tuple(gen.out),
                    "roundpipe" if training else "roundpipe-eval")


def roundpipe_stale_schedule(plan: Plan, workers: int, microbatches: int, *,
                             calls: int = 4, staleness: int = 1,
                             side_inputs: bool = False) -> Schedule:
    """``calls`` overlapping training calls with an optimizer ``staleness`` steps stale.

    Call ``c``'s job ``j`` runs on worker ``(c * jobs + j) % workers``: the round-robin
    continues across calls, so call ``c + 1``'s forward stages start while call ``c``'s
    backward stages drain. The weight upload of a stage in call ``c`` waits for the
    optimizer hand-off of every stage holding its layers in call ``c - 1 - staleness``
    (``staleness=0`` is the exact optimizer: the next call reads this call's update).
    A simulator reports the steady state between the first and the last call.
    """
    if calls < 1 or staleness < 0:
        raise ScheduleError(f"calls={calls} must be >= 1 and staleness={staleness} >= 0")
    if workers < 1 or microbatches < 1:
        raise ScheduleError(f"workers={workers} and microbatches={microbatches} must be >= 1")
    gen = _Generator(plan, workers, microbatches, side_inputs, frozenset())
    updaters = [s for s in gen.jobs if s.kind is not StageKind.FORWARD]
    for c in range(calls):
        gen.start_call(c)
        older = c - 1 - staleness
        for j, stage in enumerate(gen.jobs):
            reads = [action_key(K.OPTIMIZER, u.name, call=older) for u in updaters
                     if older >= 0 and u.start < stage.stop and stage.start < u.stop]
            gen.job(j, stage, weight_deps=reads)
    return Schedule(plan, workers, microbatches, tuple(gen.out), "roundpipe-stale")


class _Generator:
    def __init__(self, plan, workers, mbs, side, buffer_layers):
        self.plan, self.W, self.M = plan, workers, mbs
        self.side, self.buffer_layers = side, buffer_layers
        self.jobs = plan.jobs()
        self.checkpoints = plan.checkpoint_boundaries()
        self.out: list[Action] = []
        self.call = 0
        self.start_call(0)

    def start_call(self, call: int) -> None:
        self.call = call
        self.side_key: dict[tuple[int, int], str] = {}   # (worker, mb) -> UZ key
        self.act_producer: dict[int, str] = {}           # boundary -> forward stage name
        self.buffer_dl: dict[int, str] = {}              # layer -> DB key
        self.tail_barrier = False

    def key(self, kind, stage_name, mb=None, at=None, call=None):
        return action_key(kind, stage_name, mb, at, self.call if call is None else call)

    def emit(self, kind, worker, stage, mb=None, at=None, deps=(), host_deps=()):
        a = Action(kind, worker, stage.name, mb, at, tuple(deps), tuple(host_deps),
                   self.call)
        self.out.append(a)
        return a.key

    def job(self, j: int, s: Stage, weight_deps=()) -> None:
        g = self.call * len(self.jobs) + j          # job index over all calls
        w = g % self.W
        host_deps = list(weight_deps)
        if g >= 2 * self.W:
            call2, j2 = divmod(g - 2 * self.W, len(self.jobs))
            host_deps.append(self.key(K.FREE, self.jobs[j2].name, call=call2))
        up_deps = sorted({self.buffer_dl[l] for l in s.layers if l in self.buffer_dl}) \
            if s.kind is StageKind.BACKWARD else []
        uw = self.emit(K.UPLOAD_WEIGHTS, w, s, deps=up_deps, host_deps=host_deps)
        compute_keys: list[str] = []
        for m in range(self.M):
            ins = [uw] + self.inputs(w, s, m, compute_keys)
            if s.kind is StageKind.FORWARD:
                compute_keys.append(self.emit(K.FORWARD, w, s, m, deps=ins))
                for b in range(s.start + 1, s.stop + 1):
                    if b == s.stop or b in self.checkpoints:
                        self.act_producer[b] = s.name
                        self.emit(K.DOWNLOAD_ACT, w, s, m, b, deps=[compute_keys[-1]])
            elif s.kind is StageKind.TAIL:
                if m == 0 and self.tail_barrier:
                    producer = self.act_producer[s.start]
                    ins = ins + [f"DA:{producer}:m{k}@{s.start}" for k in range(1, self.M)]
                compute_keys.append(self.emit(K.FUSED, w, s, m, deps=ins))
                self.emit(K.DOWNLOAD_GRAD, w, s, m, s.start, deps=[compute_keys[-1]])
            else:
                r = self.emit(K.RECOMPUTE, w, s, m, deps=[k for k in ins if not k.startswith("UG:")])
                ug = [k for k in ins if k.startswith("UG:")]
                compute_keys.append(self.emit(K.BACKWARD, w, s, m, deps=[r] + ug))
                if s.start > 0:
                    self.emit(K.DOWNLOAD_GRAD, w, s, m, s.start, deps=[compute_keys[-1]])
        self.emit(K.FREE, w, s)
        last = compute_keys[-1]
        if s.kind is not StageKind.BACKWARD and any(l in self.buffer_layers for l in s.layers):
            db = self.emit(K.DOWNLOAD_BUFFERS, w, s, deps=[last])
            for l in s.layers:
                self.buffer_dl[l] = db
        if s.kind is not StageKind.FORWARD:
            dw = self.emit(K.DOWNLOAD_WGRAD, w, s, deps=[last])
            self.emit(K.OPTIMIZER, HOST, s, host_deps=[dw])

    def inputs(self, w: int, s: Stage, m: int, compute_keys: list[str]) -> list[str]:
        """Emit the uploads a compute action of (stage, microbatch) reads; return keys."""
        keys = []
        # Bound device memory: the upload of input m waits until the compute of input
        # m - INPUT_DEPTH of the same stage has finished with its own input.
        host_deps = [compute_keys[m - INPUT_DEPTH]] if m >= INPUT_DEPTH else []
        if self.side:
            if (w, m) not in self.side_key:
                self.side_key[(w, m)] = self.emit(K.UPLOAD_SIDE, w, s, m)
            keys.append(self.side_key[(w, m)])
        producer = self.act_producer.get(s.start)
        deps = [self.key(K.DOWNLOAD_ACT, producer, m, s.start)] if s.start > 0 else []
        if s.start > 0 and producer is None:
            raise ScheduleError(f"no forward stage downloads the activation at layer "
                                f"{s.start} that stage {s} needs")
        keys.append(self.emit(K.UPLOAD_ACT, w, s, m, s.start, deps=deps, host_deps=host_deps))
        if s.kind is StageKind.BACKWARD:
            deeper = self.deeper_stage(s)
            keys.append(self.emit(K.UPLOAD_GRAD, w, s, m, s.stop,
                                  deps=[self.key(K.DOWNLOAD_GRAD, deeper.name, m, s.stop)],
                                  host_deps=host_deps))
        return keys

    def deeper_stage(self, s: Stage) -> Stage:
        if s.stop == self.plan.tail.start:
            return self.plan.tail
        return self.plan.backward[s.index + 1]
