"""Baseline schedules that bind stages to devices: GPipe, 1F1B, interleaved 1F1B, looped BFS.

A *bound* plan cuts the model into chunks: the forward stages ``F0..Fk-2`` and the tail
``T`` in order, with backward stage ``Bi`` covering the same layers as ``Fi`` (see
:func:`rotapipe.plan.bound_plan`). Chunk ``c`` lives on device ``c % devices`` for the
whole call: its weights stay resident (no ``UW``/``X``), the usual Megatron-style setup.

Each generator first writes, per device, the order of its compute passes as
``(pass, chunk, microbatch)`` triples (the part that differs between GPipe, 1F1B, ...);
one lowering pass (:func:`_lower`) then turns them into actions and adds the transfers:

- without recompute (the default) a forward keeps its autograd graph (``FK``) and the
  backward runs through it (``BK``); with ``recompute=True`` a forward keeps only its
  input on the device (``F``) and the backward re-runs it (``R``, then ``B``). The tail
  (last chunk, with the loss) is never recomputed: ``FK:T`` then ``BK:T``.
- a boundary between chunks on different devices is a download to the host and an
  upload to the next device (``DA``/``UA`` forward, ``DG``/``UG`` backward): consumer
  GPUs have no peer-to-peer copies. Chunks on the same device hand over directly.
- the upload lane fetches inputs in compute order, at most ``INPUT_DEPTH`` compute
  passes ahead (an upload waits for the compute that many passes back).
"""

from __future__ import annotations

import enum

from ..errors import ScheduleError
from ..plan import Plan
from .actions import Action, ActionKind as K, Schedule, action_key

__all__ = ["gpipe_schedule", "one_f_one_b_schedule", "interleaved_1f1b_schedule",
           "looped_bfs_schedule", "Pass"]

INPUT_DEPTH = 2
"""Compute passes a device's upload lane may run ahead of its compute lane."""


class Pass(str, enum.Enum):
    """One microbatch through one chunk, forward or backward."""

    FORWARD = "f"
    BACKWARD = "b"


Op = tuple[Pass, int, int]   # (pass, chunk, microbatch)


def gpipe_schedule(plan: Plan, devices: int, microbatches: int, *,
                   recompute: bool = False) -> Schedule:
    """GPipe: every device runs all its forwards, then all its backwards (one chunk
    per device)."""
    _check(plan, devices, microbatches, per_device=1)
    M = microbatches
    orders = [[(Pass.FORWARD, d, m) for m in range(M)] + [(Pass.BACKWARD, d, m) for m in range(M)]
              for d in range(devices)]
    return _lower(plan, devices, M, orders, recompute, "gpipe")


def one_f_one_b_schedule(plan: Plan, devices: int, microbatches: int, *,
                         recompute: bool = False) -> Schedule:
    """1F1B (PipeDream-flush): device ``d`` runs ``devices - 1 - d`` warm-up forwards,
    then alternates one forward and one backward, then drains the backwards. At most
    ``devices - d`` microbatches' activations are alive on device ``d``."""
    _check(plan, devices, microbatches, per_device=1)
    M, orders = microbatches, []
    for d in range(devices):
        warm = min(devices - 1 - d, M)
        ops = [(Pass.FORWARD, d, m) for m in range(warm)]
        for i in range(M - warm):
            ops += [(Pass.FORWARD, d, warm + i), (Pass.BACKWARD, d, i)]
        ops += [(Pass.BACKWARD, d, m) for m in range(M - warm, M)]
        orders.append(ops)
    return _lower(plan, devices, M, orders, recompute, "1f1b")


def interleaved_1f1b_schedule(plan: Plan, devices: int, microbatches: int, *,
                              recompute: bool = False) -> Schedule:
    """Interleaved 1F1B (Megatron-LM): each device holds ``v = chunks / devices``
    chunks (virtual stages) ``d, d + devices, ...``. Microbatches go in rounds: a
    round runs through local chunk 0, then chunk 1, ...; backwards go through the
    chunks in reverse. Device ``d`` warms up with ``(v - 1) * g + 2 * (devices - 1 - d)``
    forwards (``g``: the first round's size), then alternates one forward and one
    backward. Megatron's rounds hold ``devices`` microbatches and need ``devices`` to
    divide the microbatch count; here there are ``microbatches // devices`` rounds (at
    least one) of near-equal size, which is the same when it divides and keeps the
    bubble at ``(p - 1) / (v * m + p - 1)`` for any ``m >= p``."""
    v = _check(plan, devices, microbatches, per_device=None)
    M, p = microbatches, devices
    rounds = max(1, M // p)
    sizes = [M // rounds + (1 if r < M % rounds else 0) for r in range(rounds)]
    starts = [sum(sizes[:r]) for r in range(rounds)]
    groups = [range(a, a + n) for a, n in zip(starts, sizes)]
    fwd = [(i, m) for grp in groups for i in range(v) for m in grp]
    bwd = [(v - 1 - i, m) for grp in groups for i in range(v) for m in grp]
    orders = []
    for d in range(p):
        warm = min((v - 1) * sizes[0] + 2 * (p - 1 - d), M * v)
        ops = [(Pass.FORWARD, i * p + d, m) for i, m in fwd[:warm]]
        for (fi, fm), (bi, bm) in zip(fwd[warm:], bwd):
            ops += [(Pass.FORWARD, fi * p + d, fm), (Pass.BACKWARD, bi * p + d, bm)]
        ops += [(Pass.BACKWARD, i * p + d, m) for i, m in bwd[M * v - warm:]]
        orders.append(ops)
    return _lower(plan, p, M, orders, recompute, "interleaved-1f1b")


def looped_bfs_schedule(plan: Plan, devices: int, microbatches: int, *,
                        recompute: bool = False) -> Schedule:
    """Looped BFS (breadth-first pipeline): chunks placed as in interleaved 1F1B, but
    each device runs every microbatch through its first chunk, then its second, ...,
    then the backwards chunk by chunk in reverse (microbatches in reverse too)."""
    v = _check(plan, devices, microbatches, per_device=None)
    M, p = microbatches, devices
    orders = []
    for d in range(p):
        ops = [(Pass.FORWARD, i * p + d, m) for i in range(v) for m in range(M)]
        ops += [(Pass.BACKWARD, i * p + d, m) for i in reversed(range(v))
                for m in reversed(range(M))]
        orders.append(ops)
    return _lower(plan, p, M, orders, recompute, "looped-bfs")


def _check(plan: Plan, devices: int, microbatches: int, per_device: int | None) -> int:
    if devices < 1 or microbatches < 1:
        raise ScheduleError(f"devices={devices} and microbatches={microbatches} must be >= 1")
    chunks = len(plan.forward) + 1
    if [(s.start, s.stop) for s in plan.forward] != [(s.start, s.stop) for s in plan.backward]:
        raise ScheduleError(f"plan {plan.to_text()} is not bound: backward stage Bi must "
                            "cover the same layers as forward stage Fi (use bound_plan)")
    if per_device is not None and chunks != devices * per_device:
        raise ScheduleError(f"the plan has {chunks} chunks (forward stages + tail) but "
                            f"{devices} devices x {per_device} chunk(s) each are needed: "
                            f"build it with bound_plan(..., {devices * per_device})")
    if chunks % devices:
        raise ScheduleError(f"the plan has {chunks} chunks, not a multiple of the "
                            f"{devices} devices: use {devices} x v chunks")
    return chunks // devices


def _lower(plan: Plan, devices: int, microbatches: int, orders: list[list[Op]],
           recompute: bool, name: str) -> Schedule:
    """Turn per-device compute orders into actions with transfers (module docstring)."""
    fwd_stages = plan.forward + (plan.tail,)
    bwd_stages = plan.backward + (plan.tail,)
    last = len(fwd_stages) - 1

    def dev(c: int) -> int:
        return c % devices

    def fwd_key(c: int, m: int) -> str:
        kind = K.FORWARD if recompute and c < last else K.FORWARD_KEEP
        return action_key(kind, fwd_stages[c].name, m)

    def bwd_key(c: int, m: int) -> str:
        kind = K.BACKWARD if recompute and c < last else K.BACKWARD_KEPT
        return action_key(kind, bwd_stages[c].name, m)

    out: list[Action] = []
    for d, ops in enumerate(orders):
        computes: list[str] = []     # this device's compute keys, in order
        for i, (pas, c, m) in enumerate(ops):
            ahead = [computes[i - INPUT_DEPTH]] if i >= INPUT_DEPTH else []
            if pas is Pass.FORWARD:
                s = fwd_stages[c]
                if c == 0 or dev(c - 1) != d:
                    src = [action_key(K.DOWNLOAD_ACT, fwd_stages[c - 1].name, m, s.start)] \
                        if c > 0 else []
                    a = Action(K.UPLOAD_ACT, d, s.name, m, s.start, tuple(src), tuple(ahead))
                    out.append(a)
                    inp = a.key
                else:
                    inp = fwd_key(c - 1, m)
                kind = K.FORWARD if recompute and c < last else K.FORWARD_KEEP
                out.append(Action(kind, d, s.name, m, deps=(inp,)))
                computes.append(out[-1].key)
                if c < last and dev(c + 1) != d:
                    out.append(Action(K.DOWNLOAD_ACT, d, s.name, m, s.stop, (out[-1].key,)))
            else:
                s = bwd_stages[c]
                grad: tuple[str, ...] = ()
                if c < last and dev(c + 1) != d:
                    src = action_key(K.DOWNLOAD_GRAD, bwd_stages[c + 1].name, m, s.stop)
                    a = Action(K.UPLOAD_GRAD, d, s.name, m, s.stop, (src,), tuple(ahead))
                    out.append(a)
                    grad = (a.key,)
                elif c < last:
                    grad = (bwd_key(c + 1, m),)
                if recompute and c < last:
                    # The recompute reads the forward's input, kept on this device.
                    if c == 0 or dev(c - 1) != d:
                        inp = action_key(K.UPLOAD_ACT, fwd_stages[c].name, m, s.start)
                    else:
                        inp = fwd_key(c - 1, m)
                    out.append(Action(K.RECOMPUTE, d, s.name, m,
                                      deps=(inp, fwd_key(c, m))))
                    out.append(Action(K.BACKWARD, d, s.name, m, deps=(out[-1].key,) + grad))
                else:
                    out.append(Action(K.BACKWARD_KEPT, d, s.name, m,
                                      deps=(fwd_key(c, m),) + grad))
                computes.append(out[-1].key)
                if c > 0 and dev(c - 1) != d:
                    out.append(Action(K.DOWNLOAD_GRAD, d, s.name, m, s.start, (out[-1].key,)))
    return Schedule(plan, devices, microbatches, tuple(out), name)
