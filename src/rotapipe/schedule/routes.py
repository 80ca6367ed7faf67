"""Where the runtime routes each action's data: which weights a stage computes with, and
how bound schedules hand data over on one device. Read from the schedule alone, so
the validator, the memory model and the runtime's kernels agree."""

from __future__ import annotations

from dataclasses import dataclass

from .actions import ActionKind as K, Schedule

__all__ = ["Routes", "weight_stages"]


def weight_stages(schedule: Schedule) -> dict[str, str]:
    """``{forward stage: stage whose weight upload it computes with}`` for forward stages
    without a ``UW`` of their own: a bound schedule with ``offload_optimizer=True``
    uploads chunk ``c`` once, as ``UW:Bc``, and ``FK:Fc`` (or ``F:Fc``) uses those
    weights (the same device tensors, so ``BK:Bc`` backpropagates into them)."""
    uploaded = {a.stage for a in schedule.actions if a.kind is K.UPLOAD_WEIGHTS}
    twins = {}
    for f in schedule.plan.forward:
        if f.name in uploaded:
            continue
        for b in schedule.plan.backward:
            if (b.start, b.stop) == (f.start, f.stop) and b.name in uploaded:
                twins[f.name] = b.name
                break
    return twins


@dataclass(frozen=True)
class Routes:
    """Where the runtime routes each action's data in one schedule (the runtime builds
    it once per schedule; ``runtime/kernels.py`` reads it):

    - ``downloads[(stage, mb)]``: the boundaries a forward keeps for ``DA`` downloads;
    - ``weights_of``: :func:`weight_stages`;
    - bound schedules hand over on one device: ``act_to[key]`` the stages that read a
      forward's output as their input (the next chunk's forward or recompute);
      ``also_input[(stage, mb)]`` the stages that also read an uploaded input (a
      recompute of the same layers); ``grad_to[key]`` the shallower stage that reads a
      backward's input gradient;
    - ``last_pass``: the keys of each stage's last forward and last backward (in list
      order), which keep buffers and weight gradients;
    - ``split``: ``(stage, call)`` of the weight uploads split in two (a ``UT`` moves
      the trained part, so the ``UW`` moves the frozen part only).
    """

    downloads: dict
    weights_of: dict
    act_to: dict
    also_input: dict
    grad_to: dict
    last_pass: frozenset
    split: frozenset = frozenset()

    @classmethod
    def of(cls, schedule: Schedule, stages: dict) -> Routes:
        """The routes of ``schedule``; ``stages``: stage name -> Stage of its plan."""
        downloads: dict[tuple[str, int], set[int]] = {}
        for act in schedule.actions:
            if act.kind is K.DOWNLOAD_ACT:
                downloads.setdefault((act.stage, act.mb), set()).add(act.at)
        last: dict[tuple, str] = {}
        act_to: dict[str, list[str]] = {}
        also_input: dict[tuple[str, int], list[str]] = {}
        grad_to: dict[str, str] = {}
        by_key = schedule.by_key()
        for act in schedule.actions:
            s = stages.get(act.stage)
            if act.kind in (K.FORWARD, K.FORWARD_KEEP, K.RECOMPUTE):
                last[("f", act.stage, act.call)] = act.key
                for p in (by_key[d] for d in act.deps if d in by_key):
                    if p.kind is K.UPLOAD_ACT and p.at == s.start and p.stage != act.stage:
                        also_input.setdefault((p.stage, act.mb), []).append(act.stage)
                    elif p.kind in (K.FORWARD, K.FORWARD_KEEP) and \
                            stages[p.stage].stop == s.start:
                        act_to.setdefault(p.key, []).append(act.stage)
            elif act.kind in (K.BACKWARD, K.BACKWARD_KEPT, K.FUSED):
                last[("b", act.stage, act.call)] = act.key
                for p in (by_key[d] for d in act.deps if d in by_key):
                    if p.kind in (K.BACKWARD, K.BACKWARD_KEPT) and \
                            stages[p.stage].start == s.stop:
                        grad_to[p.key] = act.stage
        split = frozenset((a.stage, a.call) for a in schedule.actions
                          if a.kind is K.UPLOAD_TRAINED)
        return cls(downloads, weight_stages(schedule), act_to, also_input, grad_to,
                   frozenset(last.values()), split)
