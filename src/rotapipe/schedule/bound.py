"""Baseline schedules that bind stages to devices: GPipe, 1F1B, interleaved 1F1B, looped BFS.

A *bound* plan cuts the model into chunks: the forward stages ``F0..Fk-2`` and the tail
``T`` in order, with backward stage ``Bi`` covering the same layers as ``Fi`` (see
:func:`rotapipe.plan.bound_plan`). Chunk ``c`` lives on device ``c % devices`` for the
whole call: its weights stay resident (no ``UW``/``X``), the usual Megatron-style setup.
With ``offload_optimizer=True`` the master weights and the optimizer live in host memory
instead (as in ZeRO-Offload, and as the rotapipe runtime keeps them): each call uploads
every chunk's weights at its start and hands its weight gradients back after its last
backward (see :func:`_lower`). Every chunk of a device stays resident for the whole call,
except in :func:`mobius_schedule` (looped BFS with ``swap=True``), which swaps each
chunk's weights in for its forwards and again for its backwards, as Mobius does.

Each generator first writes, per device, the order of its compute passes as
``(pass, chunk, microbatch)`` triples (the part that differs between GPipe, 1F1B, ...);
one lowering pass (:func:`_lower`) then turns them into actions and adds the transfers:

- without recompute (the default) a forward keeps its autograd graph (``FK``) and the
  backward runs through it (``BK``); with ``recompute=True`` a forward keeps only its
  input on the device (``F``) and the backward re-runs it (``R``, then ``B``). The tail
  (last chunk, with the loss) is never recomputed: ``FK:T`` then ``BK:T``. The
  recompute may run ahead of the gradient (``"ahead"``, ours) or wait for it
  (``"after-grad"``, the paper's baselines); see :class:`~rotapipe.plan.balance.Recompute`.
- a boundary between chunks on different devices is a download to the host and an
  upload to the next device (``DA``/``UA`` forward, ``DG``/``UG`` backward): consumer
  GPUs have no peer-to-peer copies. Chunks on the same device hand over directly.
- the upload lane fetches inputs in compute order, at most ``INPUT_DEPTH`` compute
  passes ahead (an upload waits for the compute that many passes back).
- with ``offload_optimizer=True``, per chunk: a weight upload ``UW`` first on the
  weights lane, a weight-gradient download ``DW`` and the host hand-off ``O`` after the
  chunk's last backward, a free ``X`` at the end. A chunk's weights are uploaded once,
  under its backward stage's name (``UW:Bc``, ``UW:T``): ``FK:Fc`` computes with them
  (:func:`rotapipe.schedule.routes.weight_stages`). The tail always downloads its loss
  (``DG:T``), and the options ``side_inputs`` (``UZ`` once per device and microbatch)
  and ``buffer_layers`` (``DB`` after a chunk's last forward) give the runtime what
  RoundPipe's schedule gives it.
  The tail's input always goes through host memory then (its upload brings the labels),
  also from a chunk on the same device.
- a buffer held by several chunks (``buffer_layers`` as a mapping from layer to buffer
  ids, as :func:`~rotapipe.schedule.roundpipe_schedule` takes it: PEFT VeRA's
  projections, a counter two layers update) passes from holder to holder in program
  order, as in RoundPipe's schedule: the action bringing a later chunk's buffers (its
  weight upload, or without ``offload_optimizer`` its forwards) waits for the ``DB`` of
  the last earlier chunk holding them, so that chunk's forwards start only once the
  earlier one's have run every microbatch. Each chunk otherwise uploads the call's first
  value and the last ``DB`` overwrites the others' updates. An order that cannot wait so
  (1F1B with more microbatches than its warm-up) is refused, naming the buffer.
- with ``swap=True`` (looped BFS only, with ``offload_optimizer`` and ``recompute``), a
  device instead uploads a chunk's weights at the start of each *phase* (its run of
  forwards: ``UW:Fc``; its run of backwards: ``UW:Bc``; the tail's forwards and
  backwards are one phase, ``UW:T``) and frees them at its end (``X``, after ``DW`` for
  a backward phase). Phase ``k``'s upload waits on the host for phase ``k - 2``'s free:
  at most two chunks' weights are resident, the running one and the prefetched next.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass

from ..errors import ScheduleError
from ..plan import Plan
from ..plan.balance import Recompute
from ..plan.partition import INPUT_DEPTH
from .actions import HOST, Action, ActionKind as K, Schedule, action_key
from .roundpipe import BufferLayers, _buffers_of
from .validate import _dry_run

__all__ = ["gpipe_schedule", "one_f_one_b_schedule", "interleaved_1f1b_schedule",
           "looped_bfs_schedule", "mobius_schedule", "Pass"]

class Pass(str, enum.Enum):
    """One microbatch through one chunk, forward or backward."""

    FORWARD = "f"
    BACKWARD = "b"


Op = tuple[Pass, int, int]   # (pass, chunk, microbatch)


def gpipe_schedule(plan: Plan, devices: int, microbatches: int, *,
                   recompute: Recompute | str | bool = False,
                   offload_optimizer: bool = False,
                   side_inputs: bool = False,
                   buffer_layers: BufferLayers = ()) -> Schedule:
    """GPipe: every device runs all its forwards, then all its backwards (one chunk
    per device).

    Options (the same for every generator of this module):

    - ``recompute``: forwards keep only their input (``F``); the backward re-runs
      them (``R``, ``B``). The tail is never recomputed. ``True`` or ``"ahead"``
      (ours): a recompute may run before its output gradient arrives;
      ``"after-grad"`` (the paper's baselines): it waits for the gradient
      (:class:`~rotapipe.plan.balance.Recompute`). Build the plan with the same
      ``recompute`` so that :func:`~rotapipe.plan.bound_plan` prices it.
    - ``offload_optimizer``: master weights and optimizer state live in host memory
      (ZeRO-Offload; what :class:`rotapipe.RoundPipe` runs): each chunk's weights are
      uploaded at the start of the call (``UW:Bc``), its weight gradients downloaded
      after its last backward (``DW``) and handed to the host optimizer (``O``), its
      weights freed at the end (``X``); the tail downloads every microbatch's loss.
      The weights of a device's chunks stay resident for the whole call (no swapping).
      Off (the default): weights and optimizer stay on the device, as in Megatron.
    - ``side_inputs``: the model has per-microbatch side inputs, uploaded once per
      device and microbatch (``UZ``).
    - ``buffer_layers``: layers whose forward updates buffers, or a mapping from each
      such layer to the ids of the buffers it holds (two layers naming one id hold one
      buffer; in the runtime ``{l: pipe.layerset.layer_buffers[l] for l in
      pipe.layerset.buffer_layers()}``); a chunk holding one downloads its buffers
      after microbatch ``M - 1``'s forward (``DB``), and a later chunk holding one of
      those buffers brings it only after that download (module docstring). Not with
      ``recompute``, which would update them twice.
    """
    _check(plan, devices, microbatches, per_device=1)
    M = microbatches
    orders = [[(Pass.FORWARD, d, m) for m in range(M)] + [(Pass.BACKWARD, d, m) for m in range(M)]
              for d in range(devices)]
    return _lower(plan, devices, M, orders, recompute, "gpipe",
                  _Options(offload_optimizer, side_inputs, _held(buffer_layers)))


def one_f_one_b_schedule(plan: Plan, devices: int, microbatches: int, *,
                         recompute: Recompute | str | bool = False,
                         offload_optimizer: bool = False,
                         side_inputs: bool = False,
                         buffer_layers: BufferLayers = ()) -> Schedule:
    """1F1B (PipeDream-flush): device ``d`` runs ``devices - 1 - d`` warm-up forwards,
    then alternates one forward and one backward, then drains the backwards. At most
    ``devices - d`` microbatches' activations are alive on device ``d``. Options as
    :func:`gpipe_schedule`."""
    _check(plan, devices, microbatches, per_device=1)
    M, orders = microbatches, []
    for d in range(devices):
        warm = min(devices - 1 - d, M)
        ops = [(Pass.FORWARD, d, m) for m in range(warm)]
        for i in range(M - warm):
            ops += [(Pass.FORWARD, d, warm + i), (Pass.BACKWARD, d, i)]
        ops += [(Pass.BACKWARD, d, m) for m in range(M - warm, M)]
        orders.append(ops)
    return _lower(plan, devices, M, orders, recompute, "1f1b",
                  _Options(offload_optimizer, side_inputs, _held(buffer_layers)))


def interleaved_1f1b_schedule(plan: Plan, devices: int, microbatches: int, *,
                              recompute: Recompute | str | bool = False,
                              offload_optimizer: bool = False,
                              side_inputs: bool = False,
                              buffer_layers: BufferLayers = ()) -> Schedule:
    """Interleaved 1F1B (Megatron-LM): each device holds ``v = chunks / devices``
    chunks (virtual stages) ``d, d + devices, ...``. Microbatches go in rounds: a
    round runs through local chunk 0, then chunk 1, ...; backwards go through the
    chunks in reverse. Device ``d`` warms up with ``(v - 1) * g + 2 * (devices - 1 - d)``
    forwards (``g``: the first round's size), then alternates one forward and one
    backward. Megatron's rounds hold ``devices`` microbatches and need ``devices`` to
    divide the microbatch count; here there are ``microbatches // devices`` rounds (at
    least one) of near-equal size, which is the same when it divides and keeps the
    bubble at ``(p - 1) / (v * m + p - 1)`` for any ``m >= p``. Options as
    :func:`gpipe_schedule`."""
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
    return _lower(plan, p, M, orders, recompute, "interleaved-1f1b",
                  _Options(offload_optimizer, side_inputs, _held(buffer_layers)))


def looped_bfs_schedule(plan: Plan, devices: int, microbatches: int, *,
                        recompute: Recompute | str | bool = False,
                        offload_optimizer: bool = False,
                        side_inputs: bool = False,
                        buffer_layers: BufferLayers = (), swap: bool = False) -> Schedule:
    """Looped BFS (breadth-first pipeline): chunks placed as in interleaved 1F1B, but
    each device runs every microbatch through its first chunk, then its second, ...,
    then the backwards chunk by chunk in reverse (microbatches in reverse too). Options
    as :func:`gpipe_schedule`; ``swap``: see :func:`mobius_schedule`."""
    v = _check(plan, devices, microbatches, per_device=None)
    M, p = microbatches, devices
    tail = v * p - 1
    orders = []
    for d in range(p):
        if not swap:
            ops = [(Pass.FORWARD, i * p + d, m) for i in range(v) for m in range(M)]
            ops += [(Pass.BACKWARD, i * p + d, m) for i in reversed(range(v))
                    for m in reversed(range(M))]
        else:
            # Mobius: the tail runs each microbatch's forward and backward back to back
            # (one graph alive, not M), and backwards go in microbatch order, so the
            # tail's first gradient feeds the next chunk at once (recompute keeps no
            # graph whose order would matter).
            ops = [(Pass.FORWARD, i * p + d, m) for i in range(v) for m in range(M)
                   if i * p + d != tail]
            ops += [(pas, tail, m) for m in range(M)
                    for pas in (Pass.FORWARD, Pass.BACKWARD) if d == tail % p]
            ops += [(Pass.BACKWARD, i * p + d, m) for i in reversed(range(v))
                    for m in range(M) if i * p + d != tail]
        orders.append(ops)
    return _lower(plan, p, M, orders, recompute, "mobius" if swap else "looped-bfs",
                  _Options(offload_optimizer, side_inputs, _held(buffer_layers), swap))


def mobius_schedule(plan: Plan, devices: int, microbatches: int, *,
                    recompute: Recompute | str | bool = Recompute.AHEAD,
                    side_inputs: bool = False,
                    buffer_layers: BufferLayers = ()) -> Schedule:
    """Mobius: the model in host memory, more chunks than devices (``v`` per device,
    placed as in looped BFS), and each chunk's weights swapped in from host memory for
    its forwards and again for its backwards, the next chunk's upload prefetched while
    the current one computes, so a device holds at most two chunks' weights. Forwards
    keep only their input and the backward recomputes; the tail runs each
    microbatch's forward and backward back to back (one graph alive), and backwards
    go in microbatch order. The same as ``looped_bfs_schedule(..., recompute=True,
    offload_optimizer=True, swap=True)``; build the plan with
    ``bound_plan(..., devices * v, devices=devices, recompute=True)``. ``recompute``:
    ``"ahead"`` (default) or ``"after-grad"``, as for :func:`gpipe_schedule`; it
    cannot be off."""
    if Recompute.of(recompute) is Recompute.OFF:
        raise ScheduleError("Mobius recomputes every chunk but the tail: use "
                            "recompute='ahead' or 'after-grad'")
    return looped_bfs_schedule(plan, devices, microbatches, recompute=recompute,
                               offload_optimizer=True, side_inputs=side_inputs,
                               buffer_layers=buffer_layers, swap=True)


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


def _held(buffer_layers: BufferLayers) -> tuple[tuple[int, frozenset[Hashable]], ...]:
    """``buffer_layers`` as sorted (layer, buffer ids) pairs (a plain collection: each
    layer's buffers are its own)."""
    return tuple(sorted(_buffers_of(buffer_layers).items()))


@dataclass(frozen=True)
class _Options:
    """What a runtime that keeps the model in host memory needs (module docstring)."""

    offload_optimizer: bool = False
    side_inputs: bool = False
    buffer_layers: tuple[tuple[int, frozenset[Hashable]], ...] = ()
    """(layer, ids of the buffers it holds) for each layer holding buffers."""
    swap: bool = False


def _lower(plan: Plan, devices: int, microbatches: int, orders: list[list[Op]],
           recompute: Recompute | str | bool, name: str,
           opts: _Options = _Options()) -> Schedule:
    """Turn per-device compute orders into actions with transfers (module docstring)."""
    mode = Recompute.of(recompute)
    recompute = mode is not Recompute.OFF
    fwd_stages = plan.forward + (plan.tail,)
    bwd_stages = plan.backward + (plan.tail,)
    last = len(fwd_stages) - 1
    held = dict(opts.buffer_layers)
    redone = sorted(l for s in plan.forward for l in s.layers if l in held)
    if recompute and redone:
        raise ScheduleError(f"recompute=True re-runs the forward of layers {redone}, whose "
                            "forward updates buffers, on the same device buffers: the update "
                            "would count twice; use recompute=False")
    if opts.swap and not (recompute and opts.offload_optimizer):
        raise ScheduleError("swap=True swaps chunk weights in from host memory between "
                            "the forwards and the backwards: it needs recompute=True and "
                            "offload_optimizer=True (mobius_schedule sets both)")

    def dev(c: int) -> int:
        return c % devices

    def crosses(c: int) -> bool:
        """Whether the boundary into chunk ``c`` goes through host memory: between
        devices, and into the tail when the runtime needs its upload (the labels)."""
        return dev(c - 1) != dev(c) or (opts.offload_optimizer and c == last)

    def fwd_key(c: int, m: int) -> str:
        kind = K.FORWARD if recompute and c < last else K.FORWARD_KEEP
        return action_key(kind, fwd_stages[c].name, m)

    def bwd_key(c: int, m: int) -> str:
        kind = K.BACKWARD if recompute and c < last else K.BACKWARD_KEPT
        return action_key(kind, bwd_stages[c].name, m)

    passed = _passed_buffers(fwd_stages, held)
    out: list[Action] = []
    hand_offs: list[tuple[int, Action]] = []   # (chunk, O action) for the host lane
    for d, ops in enumerate(orders):
        computes: list[str] = []     # this device's compute keys, in order
        # Per chunk: its weights' upload, and the index of its last backward op.
        uw: dict[int, tuple[str, ...]] = {}
        final_bwd = {c: i for i, (pas, c, _) in enumerate(ops) if pas is Pass.BACKWARD}
        if opts.offload_optimizer and not opts.swap:
            for c in sorted(final_bwd):
                out.append(Action(K.UPLOAD_WEIGHTS, d, bwd_stages[c].name,
                                  deps=passed.get(c, ())))
                uw[c] = (out[-1].key,)
        swap = _Swap(ops, last, name, d, passed) if opts.swap else None
        side: dict[int, str] = {}    # microbatch -> its side-input upload on this device
        for i, (pas, c, m) in enumerate(ops):
            ahead = [computes[i - INPUT_DEPTH]] if i >= INPUT_DEPTH else []
            extra = swap.upload(i, out, fwd_stages, bwd_stages) if swap else uw.get(c, ())
            if opts.side_inputs:
                if m not in side:
                    out.append(Action(K.UPLOAD_SIDE, d, fwd_stages[c].name, m))
                    side[m] = out[-1].key
                extra += (side[m],)
            if pas is Pass.FORWARD:
                s = fwd_stages[c]
                if c == 0 or crosses(c):
                    src = [action_key(K.DOWNLOAD_ACT, fwd_stages[c - 1].name, m, s.start)] \
                        if c > 0 else []
                    a = Action(K.UPLOAD_ACT, d, s.name, m, s.start, tuple(src), tuple(ahead))
                    out.append(a)
                    inp = a.key
                else:
                    inp = fwd_key(c - 1, m)
                kind = K.FORWARD if recompute and c < last else K.FORWARD_KEEP
                # Without a weight upload, the forward itself waits for the buffers.
                brought = () if opts.offload_optimizer else passed.get(c, ())
                out.append(Action(kind, d, s.name, m, deps=(inp,) + extra + brought))
                computes.append(out[-1].key)
                if c < last and crosses(c + 1):
                    out.append(Action(K.DOWNLOAD_ACT, d, s.name, m, s.stop, (out[-1].key,)))
                if m == microbatches - 1 and any(l in held for l in s.layers):
                    # The runtime keeps the updated buffers after the last microbatch.
                    out.append(Action(K.DOWNLOAD_BUFFERS, d, s.name, deps=(computes[-1],)))
            else:
                s = bwd_stages[c]
                grad: tuple[str, ...] = ()
                if c < last and crosses(c + 1):
                    src = action_key(K.DOWNLOAD_GRAD, bwd_stages[c + 1].name, m, s.stop)
                    a = Action(K.UPLOAD_GRAD, d, s.name, m, s.stop, (src,), tuple(ahead))
                    out.append(a)
                    grad = (a.key,)
                elif c < last:
                    grad = (bwd_key(c + 1, m),)
                if recompute and c < last:
                    # The recompute reads the forward's input, kept on this device.
                    if c == 0 or crosses(c):
                        inp = action_key(K.UPLOAD_ACT, fwd_stages[c].name, m, s.start)
                    else:
                        inp = fwd_key(c - 1, m)
                    # Ours may recompute ahead of the gradient; the paper's waits for it.
                    wait = grad if mode is Recompute.AFTER_GRAD else ()
                    out.append(Action(K.RECOMPUTE, d, s.name, m,
                                      deps=(inp, fwd_key(c, m)) + wait + extra))
                    out.append(Action(K.BACKWARD, d, s.name, m, deps=(out[-1].key,) + grad))
                else:
                    out.append(Action(K.BACKWARD_KEPT, d, s.name, m,
                                      deps=(fwd_key(c, m),) + grad + extra))
                computes.append(out[-1].key)
                if c > 0 and crosses(c) or opts.offload_optimizer and c == last:
                    # (The tail's download also brings its loss to the host.)
                    out.append(Action(K.DOWNLOAD_GRAD, d, s.name, m, s.start, (out[-1].key,)))
                if opts.offload_optimizer and i == final_bwd[c]:
                    # After the input gradient that became ready with it: the critical
                    # copy must not lose the link to the weight gradients (transfer.py).
                    dg = (out[-1].key,) if out[-1].kind is K.DOWNLOAD_GRAD else ()
                    out.append(Action(K.DOWNLOAD_WGRAD, d, s.name, deps=(computes[-1],) + dg))
                    hand_offs.append((c, Action(K.OPTIMIZER, HOST, s.name,
                                                host_deps=(out[-1].key,))))
            if swap:
                swap.free(i, out)
        out += [Action(K.FREE, d, bwd_stages[c].name) for c in uw]
    # Deeper chunks finish their backward first: the host takes their gradients first.
    out += [o for _, o in sorted(hand_offs, key=lambda x: -x[0])]
    schedule = Schedule(plan, devices, microbatches, tuple(out), name)
    if passed:
        _check_passing(schedule, fwd_stages, held)
    return schedule


def _passed_buffers(fwd_stages, held: dict[int, frozenset]) -> dict[int, tuple[str, ...]]:
    """Chunk -> the buffer downloads (``DB``) it must wait for: per buffer it holds, that
    of the last earlier chunk holding it (module docstring). Empty when no buffer is held
    by two chunks."""
    last_db: dict[Hashable, str] = {}
    out: dict[int, tuple[str, ...]] = {}
    for c, s in enumerate(fwd_stages):
        ids = frozenset().union(*(held.get(l, ()) for l in s.layers))
        waits = sorted({last_db[b] for b in ids if b in last_db})
        if waits:
            out[c] = tuple(waits)
        for b in ids:
            last_db[b] = action_key(K.DOWNLOAD_BUFFERS, s.name)
    return out


def _check_passing(schedule: Schedule, fwd_stages, held: dict[int, frozenset]) -> None:
    """Refuse a compute order in which a chunk holding a shared buffer cannot wait for
    the earlier holder's last forward (it would deadlock), naming the buffer."""
    try:
        _dry_run(schedule)
    except ScheduleError:
        pass
    else:
        return
    holders: dict[Hashable, list[str]] = {}
    for s in fwd_stages:
        for b in sorted(frozenset().union(*(held.get(l, ()) for l in s.layers)), key=str):
            holders.setdefault(b, []).append(f"{s.name} (layers {s.start}-{s.stop - 1})")
    shared = "; ".join(f"buffer {b!r}: {', '.join(h)}" for b, h in holders.items()
                       if len(h) > 1)
    raise ScheduleError(
        f"{schedule.name} cannot pass a buffer from chunk to chunk: {shared} hold one "
        "buffer their forward may update, so a later holder's forwards must wait until "
        "the earlier one has run its forward for every microbatch, and this compute "
        f"order ({schedule.workers} devices, {schedule.microbatches} microbatches) needs "
        "a later holder's forward first (it would deadlock). Use gpipe_schedule or "
        "looped_bfs_schedule, or a plan that puts those layers in one chunk")


class _Swap:
    """``swap=True`` on one device: the phases of its compute order (a chunk's run of
    forwards, its run of backwards; the tail's are one), each with its own weight upload
    and free (module docstring)."""

    def __init__(self, ops: list[Op], last: int, name: str, device: int,
                 passed: dict[int, tuple[str, ...]]):
        self.last, self.passed = last, passed
        self.phases: list[tuple[Pass, int]] = []
        self.final: dict[tuple[Pass, int], int] = {}     # phase -> index of its last op
        for i, (pas, c, _) in enumerate(ops):
            ph = self._phase(pas, c)
            if not self.phases or self.phases[-1] != ph:
                if ph in self.final:
                    raise ScheduleError(
                        f"swap=True needs each chunk's forwards, and its backwards, to run "
                        f"back to back on a device, but {name} interleaves chunk {c}'s on "
                        f"device {device}: use looped_bfs_schedule (mobius_schedule)")
                self.phases.append(ph)
            self.final[ph] = i
        self.ops, self.device = ops, device
        self.uw: dict[tuple[Pass, int], str] = {}
        self.names: dict[tuple[Pass, int], str] = {}
        self.x: list[str] = []       # the frees, in phase order

    def _phase(self, pas: Pass, c: int) -> tuple[Pass, int]:
        return (Pass.BACKWARD if c == self.last else pas, c)

    def upload(self, i: int, out: list[Action], fwd_stages, bwd_stages) -> tuple[str, ...]:
        """The upload op ``i`` computes with (emitted at its phase's first op)."""
        pas, c, _ = self.ops[i]
        ph = self._phase(pas, c)
        if ph not in self.uw:
            k = len(self.uw)
            # Room for it: the free of the phase two back (the running one stays).
            room = (self.x[k - 2],) if k >= 2 else ()
            stage = (fwd_stages if ph[0] is Pass.FORWARD else bwd_stages)[c]
            # A forward phase (or the tail's) brings the buffers earlier chunks passed on.
            brought = self.passed.get(c, ()) if ph[0] is Pass.FORWARD or c == self.last \
                else ()
            out.append(Action(K.UPLOAD_WEIGHTS, self.device, stage.name, deps=brought,
                              host_deps=room))
            self.uw[ph], self.names[ph] = out[-1].key, stage.name
        return (self.uw[ph],)

    def free(self, i: int, out: list[Action]) -> None:
        """After op ``i`` (and its downloads): free its phase's weights if it was the last."""
        pas, c, _ = self.ops[i]
        ph = self._phase(pas, c)
        if self.final[ph] == i:
            out.append(Action(K.FREE, self.device, self.names[ph]))
            self.x.append(out[-1].key)
