"""The RoundPipe schedule generator: stage jobs dealt round-robin over stateless workers.

Job ``j`` of the plan's execution order (``F0..Fk-1, T, Bj-1..B0``) runs on worker
``j % workers``. A worker uploads the stage's weights (prefetched while its previous
job computes), runs the stage for every microbatch (each starting as soon as its input
is in host memory), downloads results, and frees the weights. At most ``prefetch + 1``
stages' weights are resident per worker: the upload of job ``j`` waits (on the host)
for the free of the job ``prefetch + 1`` back on the same worker (default 1: two
stages, the running one and the next).

A job's weight gradients stay on its worker from its first backward until their
download: the first backward of a gradient-producing job (tail or backward stage)
waits for the weight-gradient download of the gradient job before the previous one on
its worker, so a worker holds at most two jobs' weight gradients (its own and the
previous one's, still downloading) however slow its copies run.

With a gradient window ``g`` (overlapping calls, :func:`roundpipe_stale_schedule`) the
weight-gradient download of the ``i``-th gradient-producing job (tail and backward
stages, counted over calls) waits (on the host) for the optimizer hand-off of job
``i - g``: a host lane slower than the workers then holds downloads back instead of
letting gradients queue in host memory, so at most ``g`` jobs' weight gradients are
on the host at once (the runtime's per-stage step frees each at its hand-off).

With the stale optimizer (:func:`roundpipe_stale_schedule`) calls overlap: the stage
jobs of call ``c`` continue the round-robin where call ``c - 1`` stopped, so the next
call's forward stages fill the workers while the previous call's backward drains.

Frozen weights (a LoRA base, any parameter the optimizer never updates) never wait for
an optimizer hand-off: when overlapping calls gate a stage's weights on an earlier
call's update and the stage holds frozen weights, its ``UW`` moves only the frozen part
(gated on memory alone, so it prefetches while the previous call drains) and a ``UT``
after it moves the trained part once the hand-offs are done; the stage computes after
the ``UT``.

An embedding table that forward stages move by the rows a call looks up is read by
the next exact call only at those rows: the backward stage holding it (and nothing
else) hands off in two host actions, ``OR`` (the rows the next call looks up, stepped
first) and ``O`` (the whole table), and the next call's forward stage reading the
table waits for the ``OR`` only (``rows_first``).

A buffer that forward stages may update (``buffer_layers``) is downloaded (``DB``) after
the last microbatch of every forward or tail stage holding it, and the upload of any
later stage holding it (forward, tail or backward) waits for the last such download:
the host copy of a buffer has one writer at a time, and a stage reads the buffer as the
previous holder left it. The order is kept per buffer, not per layer: a buffer held by
several layers (PEFT VeRA's projections, shared by every adapted block) passes from one
holder to the next in program order, so a forward stage holding it starts only once the
previous holder's forward has run every microbatch.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Mapping

from .._validate import MAX_MICROBATCHES
from ..errors import ScheduleError
from ..plan import Plan, Stage, StageKind
from ..plan.partition import INPUT_DEPTH
from .actions import HOST, Action, ActionKind as K, Schedule, action_key

MAX_WORKERS = 1024
"""Workers a schedule is generated for at most (``rotapipe simulate --devices``)."""

BufferLayers = Collection[int] | Mapping[int, Collection[Hashable]]
"""Layers holding buffers their forward may update: a collection of layers (each holding
buffers of its own) or a mapping from each such layer to the ids of its buffers."""


def roundpipe_schedule(plan: Plan, workers: int, microbatches: int, *,
                       side_inputs: bool = False,
                       buffer_layers: BufferLayers = (),
                       training: bool = True, tail_barrier: bool = False,
                       prefetch: int = 1) -> Schedule:
    """Generate the RoundPipe schedule of one training call.

    ``side_inputs``: the model has per-microbatch side inputs, uploaded once per
    microbatch per worker (``UZ`` actions). ``buffer_layers``: layers with buffers that
    their forward may update, or a mapping from each such layer to the ids of the
    buffers it holds (two layers naming one id hold one buffer; a plain collection: each
    layer's buffers are its own); the forward and tail stages holding them download
    buffers (``DB``), and a later stage holding one of those buffers uploads it only
    after the last such download (module docstring).
    ``tail_barrier``: the first fused-tail action waits until every microbatch's tail
    input has reached host memory (for losses that need whole-batch statistics).
    ``prefetch``: how many jobs ahead of its compute a worker's weight upload may run
    (1: the next stage's weights load while the current stage computes; deeper
    prefetch holds more stages' weights, see :func:`prefetch_depth`).
    """
    if not training:
        if workers < 1 or microbatches < 1:
            raise ScheduleError(f"workers={workers} and microbatches={microbatches} "
                                "must be >= 1")
        # Evaluation: forward stages only, the tail's layers run as one more forward
        # stage, nothing is checkpointed and no buffer update is kept.
        gen = _Generator(plan, workers, microbatches, side_inputs, (), prefetch)
        gen.jobs = plan.eval_jobs()
        gen.checkpoints = frozenset()
        for j, stage in enumerate(gen.jobs):
            gen.job(j, stage)
        return Schedule(plan, workers, microbatches, tuple(gen.out), "roundpipe-eval")
    return Schedule(plan, workers, microbatches,
                    roundpipe_call(plan, workers, microbatches, 0, side_inputs=side_inputs,
                                   buffer_layers=buffer_layers, tail_barrier=tail_barrier,
                                   prefetch=prefetch), "roundpipe")


def roundpipe_call(plan: Plan, workers: int, microbatches: int, call: int, *,
                   reads: int | None = None, whole_step: bool = False,
                   ties: Collection[Collection[int]] = (), side_inputs: bool = False,
                   buffer_layers: BufferLayers = (), tail_barrier: bool = False,
                   prefetch: int = 1, grad_window: int | None = None,
                   frozen: Collection[int] = (),
                   rows_first: Collection[int] = ()) -> tuple[Action, ...]:
    """The actions of training call ``call`` in a sequence of overlapping calls.

    Call ``c``'s job ``j`` runs on worker ``(c * jobs + j) % workers``: the round-robin
    continues across calls, so call ``c``'s forward stages start on the workers that
    call ``c - 1``'s draining backward frees. A weight upload waits (on the host) for
    the free of the job ``prefetch + 1`` turns back on its worker, of whichever call.
    ``reads``: the earlier call whose optimizer update this call's weights must include
    (``None``: none): a stage's weight upload waits for the hand-off (``O``) of every
    stage of call ``reads`` that updates a layer it holds (``ties``: groups of layers
    sharing parameters, e.g. a tied embedding and head), or of every stage with
    ``whole_step`` (an update that needs the whole call's gradients, e.g. clipping to
    a global norm). ``grad_window``: gradient downloads wait for the hand-off that
    many gradient jobs back (module docstring; ``None``: they do not wait).
    ``frozen``: layers holding weights the optimizer never updates; a stage holding any
    of them splits its gated upload into ``UW`` (frozen part, not gated on ``reads``)
    and ``UT`` (trained part, gated). ``rows_first``: layers holding an embedding table
    that forward stages move by the rows a call looks up (per-stage steps only, not
    with ``whole_step``): a backward stage holding nothing else first steps the rows
    the next call looks up (``OR``, host lane, before its ``O``), and a forward stage
    that reads such a stage's update only through those tables waits for its ``OR``
    instead of its ``O``. Call 0 without ``reads`` or ``grad_window`` is
    :func:`roundpipe_schedule`'s call.
    """
    counts = (workers, microbatches, call)
    if any(isinstance(v, bool) or not isinstance(v, int) for v in counts) or \
            not (1 <= workers <= MAX_WORKERS and 1 <= microbatches <= MAX_MICROBATCHES
                 and call >= 0):
        raise ScheduleError(f"workers={workers!r} and microbatches={microbatches!r} must be "
                            f"ints in [1, {MAX_WORKERS:,}] and [1, {MAX_MICROBATCHES:,}], "
                            f"call={call!r} an int >= 0")
    if reads is not None and not 0 <= reads < call:
        raise ScheduleError(f"call {call} cannot read the update of call {reads}: only "
                            "of an earlier call")
    if plan.tail_jobs > 1 and tail_barrier:
        raise ScheduleError(f"the tail is split into {plan.tail_jobs} jobs, but a loss "
                            "with whole-batch context (tail_context) needs one tail job: "
                            "use a plan with tail_jobs=1")
    if plan.tail_jobs > 1 and set(plan.tail.layers) & set(buffer_layers):
        raise ScheduleError(f"the tail is split into {plan.tail_jobs} jobs, but its layers "
                            "update buffers in their forward (each job would keep its own "
                            "update): use a plan with tail_jobs=1")
    if grad_window is not None and (not isinstance(grad_window, int) or grad_window < 1):
        raise ScheduleError(f"grad_window={grad_window!r} must be an int >= 1 or None")
    rows = frozenset(rows_first)
    if rows and whole_step:
        raise ScheduleError(f"rows_first={sorted(rows)} needs per-stage steps, but "
                            "whole_step=True steps the whole model at the last hand-off: "
                            "pass one of them")
    gen = _Generator(plan, workers, microbatches, side_inputs, buffer_layers, prefetch)
    gen.grad_window = grad_window
    gen.rows_first = rows
    gen.start_call(call)
    gen.tail_barrier = tail_barrier and plan.tail.start > 0
    updaters = [s for s in gen.jobs if s.kind is not StageKind.FORWARD]
    frozen_set = frozenset(frozen)
    tied: dict[int, set[int]] = {}
    for group in ties:
        for l in group:
            tied.setdefault(l, set()).update(group)
    for j, stage in enumerate(gen.jobs):
        reads_keys = []
        if reads is not None:
            touched = set(stage.layers).union(*(tied.get(l, ()) for l in stage.layers))
            forward = stage.kind is StageKind.FORWARD
            reads_keys = [action_key(K.OPTIMIZER_ROWS if forward and gen.steps_rows(u)
                                     and touched & set(u.layers) <= rows
                                     else K.OPTIMIZER, u.name, call=reads)
                          for u in updaters if whole_step or touched & set(u.layers)]
        gen.job(j, stage, weight_deps=reads_keys,
                split=bool(reads_keys) and not frozen_set.isdisjoint(stage.layers))
    return tuple(gen.out)


def roundpipe_stale_schedule(plan: Plan, workers: int, microbatches: int, *,
                             calls: int = 4, staleness: int = 1,
                             side_inputs: bool = False, whole_step: bool = False,
                             ties: Collection[Collection[int]] = (),
                             prefetch: int = 1, bound_grads: bool = True,
                             frozen: Collection[int] = (),
                             rows_first: Collection[int] = (),
                             tail_barrier: bool = False) -> Schedule:
    """``calls`` overlapping training calls (:func:`roundpipe_call`), each a step of an
    optimizer ``staleness`` steps stale: call ``c`` reads the update of call
    ``c - 1 - staleness`` (``staleness=0`` is the exact optimizer: the next call reads
    this call's update). The runtime runs exactly these calls for
    ``optimizer_mode="stale"`` (staleness 1) and ``"overlap"`` (staleness 0), with
    ``whole_step`` when it clips to a global norm, and with ``bound_grads``: a
    gradient window of ``prefetch + 2`` jobs (:func:`grad_window`), and ``frozen``
    (:func:`roundpipe_call`) the layers holding frozen weights; ``rows_first``
    (:func:`roundpipe_call`: embedding tables moved by rows) applies to the exact
    optimizer's per-stage steps (``staleness=0`` without ``whole_step``) and is ignored
    otherwise. ``tail_barrier`` (:func:`roundpipe_schedule`): each call's tail waits for
    every microbatch of that call (a loss over whole-batch statistics, as the Hugging
    Face adapter's MoE load-balancing loss). A simulator reports the steady state
    between the first and the last call.
    """
    if calls < 1 or staleness < 0:
        raise ScheduleError(f"calls={calls} must be >= 1 and staleness={staleness} >= 0")
    rows = rows_first if staleness == 0 and not whole_step else ()
    actions: list[Action] = []
    for c in range(calls):
        older = c - 1 - staleness
        actions += roundpipe_call(plan, workers, microbatches, c,
                                  reads=older if older >= 0 else None,
                                  whole_step=whole_step, ties=ties,
                                  side_inputs=side_inputs, prefetch=prefetch,
                                  grad_window=grad_window(prefetch) if bound_grads else None,
                                  frozen=frozen, rows_first=rows,
                                  tail_barrier=tail_barrier)
    return Schedule(plan, workers, microbatches, tuple(actions), "roundpipe-stale")


def grad_window(prefetch: int) -> int:
    """The gradient window of overlapping calls (:func:`roundpipe_call`) with weight
    prefetch ``prefetch``: ``prefetch + 2`` jobs, so the host holds at most that many
    stages' weight gradients, what the planner counts
    (:func:`rotapipe.plan.host_memory`, layout ``"lean"``). A narrower window would
    stall downloads more often: simulated on Qwen3-1.7B (8x RTX 4090, 16 microbatches,
    exact overlapped optimizer at 5e9 parameters/s) the step takes 787 ms without a
    window, 792 ms with 3 jobs, 802 ms with 2 and 944 ms with 1."""
    return prefetch + 2


def prefetch_depth(plan: Plan, workers: int, resident: Mapping[str, int], budget: int,
                   max_depth: int = 4) -> int:
    """The deepest weight prefetch (<= ``max_depth``, at least 1) at which every
    worker's resident stages fit ``budget`` bytes: with depth ``d`` a worker holds the
    stage it computes plus the next ``d`` jobs' stages. ``resident`` gives each stage's
    device bytes while it is held (weights, plus weight gradients for stages that run
    backward); ``budget`` is what the worker can give to them (its memory less one
    microbatch's working set)."""
    if max_depth < 1:
        raise ScheduleError(f"max_depth={max_depth} must be >= 1")
    sizes = [resident[s.name] for s in plan.jobs()]
    best = 1
    for d in range(2, max_depth + 1):
        # Any d + 1 consecutive jobs of one worker: indices g, g + W, ..., g + d * W.
        worst = max(sum(sizes[g + i * workers] for i in range(d + 1)
                        if g + i * workers < len(sizes)) for g in range(len(sizes)))
        if worst > budget:
            break
        best = d
    return best


def _buffers_of(buffer_layers: BufferLayers) -> dict[int, frozenset]:
    """Layer -> the ids of the buffers it holds (a plain collection: the layer itself)."""
    if isinstance(buffer_layers, Mapping):
        return {l: frozenset(ids) for l, ids in buffer_layers.items() if ids}
    return {l: frozenset([l]) for l in buffer_layers}


class _Generator:
    def __init__(self, plan, workers, mbs, side, buffer_layers, prefetch=1):
        if not isinstance(prefetch, int) or prefetch < 1:
            raise ScheduleError(f"prefetch={prefetch!r} must be an int >= 1")
        self.prefetch = prefetch
        self.plan, self.W, self.M = plan, workers, mbs
        self.side, self.buffers_of = side, _buffers_of(buffer_layers)
        self.jobs = plan.jobs()
        self.checkpoints = plan.checkpoint_boundaries()
        self.out: list[Action] = []
        self.updaters = [s for s in self.jobs if s.kind is not StageKind.FORWARD]
        self.grad_window: int | None = None
        self.rows_first: frozenset[int] = frozenset()
        self.call = 0
        self.start_call(0)

    def start_call(self, call: int) -> None:
        self.call = call
        self.side_key: dict[tuple[int, int], str] = {}   # (worker, mb) -> UZ key
        self.act_producer: dict[int, str] = {}           # boundary -> forward stage name
        self.buffer_dl: dict[Hashable, str] = {}         # buffer id -> last DB key
        self.tail_barrier = False

    def key(self, kind, stage_name, mb=None, at=None, call=None):
        return action_key(kind, stage_name, mb, at, self.call if call is None else call)

    def emit(self, kind, worker, stage, mb=None, at=None, deps=(), host_deps=()):
        a = Action(kind, worker, stage.name, mb, at, tuple(deps), tuple(host_deps),
                   self.call)
        self.out.append(a)
        return a.key

    def job(self, j: int, s: Stage, weight_deps=(), split: bool = False) -> None:
        """Emit job ``j`` of the call: its weights' upload waits (on the host) for
        ``weight_deps`` (hand-offs) and for room; with ``split`` only its trained part
        (``UT``) waits for the hand-offs (module docstring)."""
        g = self.call * len(self.jobs) + j          # job index over all calls
        w = g % self.W
        room = []
        back = (self.prefetch + 1) * self.W     # the job whose free makes room
        if g >= back:
            call2, j2 = divmod(g - back, len(self.jobs))
            room.append(self.key(K.FREE, self.jobs[j2].name, call=call2))
        # The buffers it holds come as the last earlier stage holding them left them.
        buffers = frozenset().union(*(self.buffers_of.get(l, ()) for l in s.layers))
        up_deps = sorted({self.buffer_dl[b] for b in buffers if b in self.buffer_dl})
        if split:
            uw = self.emit(K.UPLOAD_WEIGHTS, w, s, deps=up_deps, host_deps=room)
            uw = self.emit(K.UPLOAD_TRAINED, w, s, deps=[uw], host_deps=weight_deps)
        else:
            uw = self.emit(K.UPLOAD_WEIGHTS, w, s, deps=up_deps,
                           host_deps=list(weight_deps) + room)
        compute_keys: list[str] = []
        last_dg = None
        mbs = self.plan.tail_microbatches(s.index, self.M) if s.kind is StageKind.TAIL \
            else range(self.M)
        for i, m in enumerate(mbs):
            ins = [uw] + self.inputs(w, s, m, i, compute_keys)
            if s.kind is StageKind.FORWARD:
                compute_keys.append(self.emit(K.FORWARD, w, s, m, deps=ins))
                for b in range(s.start + 1, s.stop + 1):
                    if b == s.stop or b in self.checkpoints:
                        self.act_producer[b] = s.name
                        self.emit(K.DOWNLOAD_ACT, w, s, m, b, deps=[compute_keys[-1]])
            elif s.kind is StageKind.TAIL:
                barrier = []
                if i == 0 and self.tail_barrier:
                    # Host deps: the barrier's body reads every microbatch's tail input
                    # in host memory with CPU code, which a stream wait does not order
                    # (on CUDA the body runs once the action is issued).
                    producer = self.act_producer[s.start]
                    barrier = [self.key(K.DOWNLOAD_ACT, producer, k, s.start)
                               for k in range(self.M)]
                hold = self.grad_hold(g, w) if i == 0 else []
                compute_keys.append(self.emit(K.FUSED, w, s, m, deps=ins + hold,
                                              host_deps=barrier))
                last_dg = self.emit(K.DOWNLOAD_GRAD, w, s, m, s.start, deps=[compute_keys[-1]])
            else:
                r = self.emit(K.RECOMPUTE, w, s, m, deps=[k for k in ins if not k.startswith("UG:")])
                ug = [k for k in ins if k.startswith("UG:")]
                hold = self.grad_hold(g, w) if i == 0 else []
                compute_keys.append(self.emit(K.BACKWARD, w, s, m, deps=[r] + ug + hold))
                if s.start > 0:
                    last_dg = self.emit(K.DOWNLOAD_GRAD, w, s, m, s.start,
                                        deps=[compute_keys[-1]])
        self.emit(K.FREE, w, s)
        last = compute_keys[-1]
        if s.kind is not StageKind.BACKWARD and buffers:
            db = self.emit(K.DOWNLOAD_BUFFERS, w, s, deps=[last])
            for b in buffers:
                self.buffer_dl[b] = db
        if s.kind is not StageKind.FORWARD:
            # The weight gradients become ready with the last input gradient; the
            # critical one goes first (the links would let a started chunk finish).
            dw = self.emit(K.DOWNLOAD_WGRAD, w, s, deps=[last] + ([last_dg] if last_dg else []),
                           host_deps=self.grad_gate(j))
            if self.steps_rows(s):
                dw = self.emit(K.OPTIMIZER_ROWS, HOST, s, host_deps=[dw])
            self.emit(K.OPTIMIZER, HOST, s, host_deps=[dw])

    def steps_rows(self, s: Stage) -> bool:
        """Whether stage ``s`` steps the rows the next call looks up first (``OR``):
        a gradient job holding only embedding tables that move by rows."""
        return s.kind is not StageKind.FORWARD and bool(self.rows_first) and \
            set(s.layers) <= self.rows_first

    def grad_hold(self, g: int, w: int) -> list[str]:
        """The weight-gradient download the first backward of job ``g`` (over calls) on
        worker ``w`` waits for: that of the gradient job before the previous one on the
        same worker (none if there is no such job)."""
        seen = 0
        for g2 in range(g - self.W, -1, -self.W):
            call2, j2 = divmod(g2, len(self.jobs))
            if self.jobs[j2].kind is not StageKind.FORWARD:
                seen += 1
                if seen == 2:
                    return [self.key(K.DOWNLOAD_WGRAD, self.jobs[j2].name, call=call2)]
        return []

    def grad_gate(self, j: int) -> list[str]:
        """The hand-off the weight-gradient download of job ``j`` waits for: the
        gradient job ``grad_window`` back, counted over calls (none without a window)."""
        if self.grad_window is None:
            return []
        n = len(self.updaters)
        i = self.call * n + j - (len(self.jobs) - n) - self.grad_window
        if i < 0:
            return []
        call, k = divmod(i, n)
        return [self.key(K.OPTIMIZER, self.updaters[k].name, call=call)]

    def inputs(self, w: int, s: Stage, m: int, i: int, compute_keys: list[str]) -> list[str]:
        """Emit the uploads the ``i``-th compute action of a job (stage, microbatch
        ``m``) reads; return their keys."""
        keys = []
        # Bound device memory: the upload of an input waits until the job's compute
        # INPUT_DEPTH inputs back has finished with its own input.
        host_deps = [compute_keys[i - INPUT_DEPTH]] if i >= INPUT_DEPTH else []
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
            deeper = self.deeper_stage(s, m)
            keys.append(self.emit(K.UPLOAD_GRAD, w, s, m, s.stop,
                                  deps=[self.key(K.DOWNLOAD_GRAD, deeper.name, m, s.stop)],
                                  host_deps=host_deps))
        return keys

    def deeper_stage(self, s: Stage, m: int) -> Stage:
        """The stage whose backward of microbatch ``m`` gives ``s`` its output gradient."""
        if s.stop == self.plan.tail.start:
            return self.plan.tail_for(m, self.M)
        return self.plan.backward[s.index + 1]
