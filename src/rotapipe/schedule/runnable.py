"""What the runtime needs of a schedule beyond soundness: it keeps the model in host
memory, so a schedule must move the weights, gradients, losses, side inputs and buffers
between the host and the workers, and pass each shared buffer on in program order."""

from __future__ import annotations

from ..errors import ScheduleError
from ..plan import StageKind
from .actions import ActionKind as K, Lane, Schedule, action_key
from .roundpipe import BufferLayers, _buffers_of
from .routes import weight_stages

__all__ = ["check_runnable"]


def check_runnable(schedule: Schedule, *, side_inputs: bool = False,
                   buffer_layers: BufferLayers = (), tail_context: bool = False) -> None:
    """Raise :class:`ScheduleError` unless ``schedule`` moves what the runtime keeps in host
    memory: each compute's weights uploaded on its worker, every trained stage's weight
    gradients downloaded and handed to the optimizer, every tail loss downloaded, side
    inputs uploaded, and updated buffers downloaded, each passed on in program order
    (:func:`_check_buffer_order`). ``buffer_layers``: the layers holding buffers, or a
    mapping from each to the ids of its buffers (as :func:`roundpipe_schedule` takes it).
    A whole-batch loss context needs RoundPipe's fused tail (its first action waits for
    every microbatch's input)."""
    held = _buffers_of(buffer_layers)
    side, buffer_layers = side_inputs, frozenset(held)
    twins = weight_stages(schedule)
    stages = {x.name: x for x in schedule.plan.jobs() + schedule.plan.eval_jobs()}
    keys = {a.key for a in schedule.actions}
    uploaded = {(a.worker, a.stage, a.call) for a in schedule.actions
                if a.kind is K.UPLOAD_WEIGHTS}
    side_at = {(a.worker, a.mb, a.call) for a in schedule.actions if a.kind is K.UPLOAD_SIDE}
    training = not schedule.name.endswith("-eval")
    hint = ("; the bound generators (gpipe_schedule, one_f_one_b_schedule, ...) add them "
            "with offload_optimizer=True")

    def fail(a, what):
        raise ScheduleError(f"schedule {schedule.name}: {a.key} on worker {a.worker} {what}")

    for a in schedule.actions:
        if a.lane is not Lane.COMPUTE or a.kind is K.FREE:
            continue
        s, w = stages[a.stage], twins.get(a.stage, a.stage)
        if (a.worker, w, a.call) not in uploaded:
            elsewhere = sorted(x for x, st, c in uploaded if (st, c) == (w, a.call))
            if elsewhere:
                fail(a, f"reads the weights of UW:{w}, which uploads them to worker "
                     f"{elsewhere[0]}: a compute reads weights uploaded on its own worker")
            fail(a, f"has no upload of its weights (UW:{w}); this pipeline keeps the "
                 "weights in host memory" + hint)
        if side and (a.worker, a.mb, a.call) not in side_at:
            fail(a, f"has no upload of microbatch {a.mb}'s side inputs (UZ): generate the "
                 "schedule with side_inputs=True")
        if not training:
            continue
        if a.kind in (K.BACKWARD, K.BACKWARD_KEPT, K.FUSED) and not (
                action_key(K.DOWNLOAD_WGRAD, a.stage, call=a.call) in keys
                and action_key(K.OPTIMIZER, a.stage, call=a.call) in keys):
            fail(a, f"runs a backward whose weight gradients are never downloaded and "
                 f"handed to the optimizer (DW:{a.stage}, O:{a.stage})" + hint)
        tail = s.kind is StageKind.TAIL
        if tail_context and a.kind is K.FORWARD_KEEP and tail:
            fail(a, "computes the loss before every microbatch's tail input is in host "
                 "memory, which tail_context needs: run RoundPipe's own schedule")
        if tail and a.kind in (K.FORWARD_KEEP, K.FUSED) and \
                action_key(K.DOWNLOAD_GRAD, s.name, a.mb, s.start, a.call) not in keys:
            fail(a, f"computes a loss that is never downloaded (DG:{s.name}:m{a.mb})" + hint)
        layers = sorted(buffer_layers & set(s.layers))
        if layers and a.kind in (K.FORWARD, K.FORWARD_KEEP, K.FUSED) and \
                action_key(K.DOWNLOAD_BUFFERS, s.name, call=a.call) not in keys:
            fail(a, f"updates the buffers of layers {layers} but never downloads them "
                 f"(DB:{s.name}): generate the schedule with "
                 f"buffer_layers={_hint(held)}")
    if training and held:
        _check_buffer_order(schedule, held, twins)


def _hint(held: dict) -> str:
    """``buffer_layers`` as a generator should be given it: the plain layer list when no
    buffer is shared, else the mapping to buffer ids."""
    ids = [b for l in held for b in held[l]]
    if len(ids) == len(set(ids)):
        return str(sorted(held))
    return "{" + ", ".join(f"{l}: {sorted(ids, key=str)}" for l, ids in sorted(held.items())) + "}"


_READS_BUFFERS = (K.FORWARD, K.FORWARD_KEEP, K.FUSED, K.RECOMPUTE)
"""Computes that read a stage's buffers as uploaded (``B`` and ``BK`` backpropagate
through the graph their recompute or kept forward made)."""


def _check_buffer_order(schedule: Schedule, held: dict, twins: dict[str, str]) -> None:
    """Each buffer passes from holder to holder in program order (``F0..Fk``, the tail,
    then the backward stages, deepest first): the weight upload a compute reads a
    buffer from must follow the ``DB`` of every stage before it in that order that
    holds the buffer and downloads it. Without that wait the upload takes the call's
    first value, or races with the download (``rotapipe.schedule.roundpipe`` module
    docstring). Schedules of the generators, given the buffer ids, pass."""
    jobs = schedule.plan.jobs()
    order = {s.name: i for i, s in enumerate(jobs)}
    ids_of = {s.name: frozenset().union(*(held.get(l, ()) for l in s.layers)) for s in jobs}
    by_key = schedule.by_key()
    writers = [a for a in schedule.actions if a.kind is K.DOWNLOAD_BUFFERS]
    before = None
    for a in schedule.actions:
        if a.kind not in _READS_BUFFERS or not ids_of.get(a.stage):
            continue
        uw = action_key(K.UPLOAD_WEIGHTS, twins.get(a.stage, a.stage), call=a.call)
        if uw not in by_key or by_key[uw].worker != a.worker:
            continue            # (a missing upload is refused above)
        for db in writers:
            shared = sorted(ids_of[a.stage] & ids_of.get(db.stage, frozenset()), key=str)
            if db.call != a.call or db.stage == a.stage or not shared or \
                    order.get(db.stage, len(jobs)) > order[a.stage]:
                continue
            if before is None:
                from .validate import _dry_run, _happens_before   # (validate imports us)
                rounds = _dry_run(schedule)
                before = _happens_before(schedule, sorted(rounds, key=rounds.__getitem__))
            if not before[uw] >> before["#"][db.key] & 1:
                raise ScheduleError(
                    f"schedule {schedule.name}: {a.key} on worker {a.worker} reads buffers "
                    f"{shared} (ids), which {db.stage} updates and downloads before it in "
                    f"program order, but its weight upload {uw} does not wait for {db.key}: "
                    f"it would upload the call's first value, or race with the download. "
                    f"Make {uw} depend on {db.key}, or generate the schedule with "
                    f"buffer_layers={_hint(held)}")
