"""The action vocabulary of a schedule, its text form, and the grid printer.

A schedule is plain data: one ordered list of actions per worker (plus one for the
host), each action naming the stage, microbatch and layer boundary it works on and the
actions it depends on. The executor (``rotapipe.runtime``) does exactly what the lists
say; the validator dry-runs them. Within one worker, actions of the same *lane* run in
list order; different lanes of a worker (its compute, weight-upload, activation-upload
and download streams) run concurrently, ordered only by dependencies.

Two families of schedules share the vocabulary. RoundPipe's (``roundpipe.py``) uploads
every stage's weights, recomputes backward stages from host checkpoints and dispatches
stage jobs round-robin. The baselines (``bound.py``: GPipe, 1F1B, interleaved 1F1B,
looped BFS) bind stages to devices: weights stay resident (no ``UW``; with
``offload_optimizer=True`` one ``UW`` per chunk and call, as a host optimizer needs), a
forward keeps its autograd graph on the device (``FK``) for the backward that uses it
(``BK``), and a boundary between two devices is a download to the host and an upload
from it (consumer GPUs have no peer-to-peer). A schedule may span several calls (RoundPipe with the stale
optimizer overlaps them): every action then carries its call number.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field

from ..errors import ScheduleError
from ..plan import Plan

HOST = -1
"""Worker id of the host lane (gradient hand-off to the optimizer)."""


class Lane(str, enum.Enum):
    """The stream an action runs on. Uploads and downloads use separate streams so the
    PCIe link runs in both directions at once; weights get their own upload stream so
    a prefetch never sits in front of a critical activation upload; weight-gradient
    downloads get their own download stream so that they never sit in front of a
    critical activation or input-gradient download. The trained part of a split weight
    upload (``UT``, waiting for the optimizer) has a stream of its own, so the frozen
    prefetches behind it on the weights stream never wait for the optimizer. Lanes of
    one direction share a copy engine, which serves copies in arrival order; the
    runtime's gated weight chunks let the critical lanes' copies go first
    (``rotapipe.runtime.transfer``)."""

    COMPUTE = "compute"
    WEIGHTS = "weights"
    TRAINED = "trained"
    UPLOAD = "upload"
    DOWNLOAD = "download"
    GRADS = "grads"
    HOST = "host"


class ActionKind(str, enum.Enum):
    """What an action does. The value is its code in the text form."""

    UPLOAD_WEIGHTS = "UW"    # host weights + buffers of a stage -> device
    UPLOAD_TRAINED = "UT"    # the trained part of a stage whose UW moved its frozen part
    UPLOAD_SIDE = "UZ"       # a microbatch's side inputs (masks, rotary tables) -> device
    UPLOAD_ACT = "UA"        # activation at a layer boundary (and labels, for the tail)
    UPLOAD_GRAD = "UG"       # gradient w.r.t. a stage's output -> device
    FORWARD = "F"            # forward of a forward stage, no autograd graph kept
    FUSED = "FT"             # fused tail: forward + loss + backward, no recompute
    RECOMPUTE = "R"          # re-run a backward stage's forward from its checkpoint
    BACKWARD = "B"           # backward of a backward stage
    FORWARD_KEEP = "FK"      # forward keeping its autograd graph on the device (bound
                             # stages; for the tail also the loss): no recompute later
    BACKWARD_KEPT = "BK"     # backward through the graph the stage's FK kept (frees it)
    FREE = "X"               # drop a stage's weights from the device
    DOWNLOAD_ACT = "DA"      # activation at a layer boundary -> host (checkpoint/input)
    DOWNLOAD_GRAD = "DG"     # gradient w.r.t. a stage's input (+ loss, tail) -> host
    DOWNLOAD_BUFFERS = "DB"  # buffers updated in forward -> host
    DOWNLOAD_WGRAD = "DW"    # a stage's weight gradients -> host
    OPTIMIZER = "O"          # hand a stage's layer gradients to the optimizer (host)
    OPTIMIZER_ROWS = "OR"    # step first the embedding rows the next call looks up (host)

    @property
    def lane(self) -> Lane:
        return _LANES[self]

    @property
    def verb(self) -> str:
        """What the action does, in words (errors and stall reports)."""
        return _VERBS[self]


_LANES = {
    ActionKind.UPLOAD_WEIGHTS: Lane.WEIGHTS, ActionKind.UPLOAD_TRAINED: Lane.TRAINED,
    ActionKind.UPLOAD_SIDE: Lane.UPLOAD, ActionKind.UPLOAD_ACT: Lane.UPLOAD,
    ActionKind.UPLOAD_GRAD: Lane.UPLOAD,
    ActionKind.FORWARD: Lane.COMPUTE, ActionKind.FUSED: Lane.COMPUTE,
    ActionKind.RECOMPUTE: Lane.COMPUTE, ActionKind.BACKWARD: Lane.COMPUTE,
    ActionKind.FORWARD_KEEP: Lane.COMPUTE, ActionKind.BACKWARD_KEPT: Lane.COMPUTE,
    ActionKind.FREE: Lane.COMPUTE,
    ActionKind.DOWNLOAD_ACT: Lane.DOWNLOAD, ActionKind.DOWNLOAD_GRAD: Lane.DOWNLOAD,
    ActionKind.DOWNLOAD_BUFFERS: Lane.DOWNLOAD, ActionKind.DOWNLOAD_WGRAD: Lane.GRADS,
    ActionKind.OPTIMIZER: Lane.HOST, ActionKind.OPTIMIZER_ROWS: Lane.HOST,
}
_VERBS = {
    ActionKind.UPLOAD_WEIGHTS: "weight upload",
    ActionKind.UPLOAD_TRAINED: "trained-weight upload",
    ActionKind.UPLOAD_SIDE: "side-input upload", ActionKind.UPLOAD_ACT: "activation upload",
    ActionKind.UPLOAD_GRAD: "gradient upload", ActionKind.FORWARD: "forward",
    ActionKind.FUSED: "fused forward+loss+backward", ActionKind.RECOMPUTE: "recompute",
    ActionKind.BACKWARD: "backward", ActionKind.FREE: "weight free",
    ActionKind.FORWARD_KEEP: "forward (keeping its graph)",
    ActionKind.BACKWARD_KEPT: "backward (through the kept graph)",
    ActionKind.DOWNLOAD_ACT: "activation download",
    ActionKind.DOWNLOAD_GRAD: "gradient download",
    ActionKind.DOWNLOAD_BUFFERS: "buffer download",
    ActionKind.DOWNLOAD_WGRAD: "weight-gradient download",
    ActionKind.OPTIMIZER: "gradient hand-off to the optimizer",
    ActionKind.OPTIMIZER_ROWS: "optimizer step of the next call's embedding rows",
}
COMPUTE_PASSES = frozenset({ActionKind.FORWARD, ActionKind.FORWARD_KEEP, ActionKind.FUSED,
                            ActionKind.RECOMPUTE, ActionKind.BACKWARD,
                            ActionKind.BACKWARD_KEPT})
"""Action kinds that do model math (a device's busy time; ``X`` is on the compute lane
but takes none)."""

CHUNKED = frozenset({ActionKind.UPLOAD_WEIGHTS, ActionKind.UPLOAD_TRAINED,
                     ActionKind.DOWNLOAD_WGRAD})
"""Copies that move in gated chunks (``rotapipe.runtime.transfer``) and yield their link
to the critical copies between chunks."""

CRITICAL = frozenset({ActionKind.UPLOAD_ACT, ActionKind.UPLOAD_GRAD, ActionKind.UPLOAD_SIDE,
                      ActionKind.DOWNLOAD_ACT, ActionKind.DOWNLOAD_GRAD,
                      ActionKind.DOWNLOAD_BUFFERS})
"""Copies on the critical path: chunked copies yield the link to them."""

LINK_PRIORITY = {Lane.UPLOAD: 0, Lane.TRAINED: 1, Lane.WEIGHTS: 2, Lane.DOWNLOAD: 0,
                 Lane.GRADS: 1}
"""Order of the lanes that share a link (lower first): activations and gradients, then
the trained part of a split weight upload (``UT``: its stage waits for it once the
optimizer is done), then weights; activations and input gradients before weight
gradients."""


def stage_map(plan: Plan) -> dict:
    """``{stage name: Stage}`` of every stage a schedule of ``plan`` may name: the
    training jobs (tail jobs included) and the evaluation call's stages."""
    return {s.name: s for s in plan.jobs() + plan.eval_jobs()}


@dataclass(frozen=True)
class Action:
    """One step of a worker's list.

    ``deps`` are actions whose effect this one reads: the stream waits on their events
    (no host thread blocks). ``host_deps`` must have *completed* before this action is
    even issued: they guard memory reuse (an upload allocates only after the free it
    replaces has run) and host-side work (the optimizer reads downloaded gradients).
    ``call`` numbers the call an action belongs to in a schedule spanning several
    (0 otherwise).
    """

    kind: ActionKind
    worker: int
    stage: str
    mb: int | None = None
    at: int | None = None
    deps: tuple[str, ...] = field(default=(), compare=False)
    host_deps: tuple[str, ...] = field(default=(), compare=False)
    call: int = 0

    @functools.cached_property
    def key(self) -> str:
        """Unique name of the action, e.g. ``F:F1:m0``, ``DA:F0:m2@3``, or ``F:F1:m0/c2``
        (call 2 of a multi-call schedule)."""
        return action_key(self.kind, self.stage, self.mb, self.at, self.call)

    @property
    def lane(self) -> Lane:
        return self.kind.lane

    def to_line(self) -> str:
        who = "host" if self.worker == HOST else f"w{self.worker}"
        line = f"{who} {self.key}"
        if self.deps:
            line += " <- " + " ".join(self.deps)
        if self.host_deps:
            line += " <~ " + " ".join(self.host_deps)
        return line

    @classmethod
    def from_line(cls, line: str) -> Action:
        host_part = ""
        if " <~ " in line:
            line, host_part = line.split(" <~ ", 1)
        dep_part = ""
        if " <- " in line:
            line, dep_part = line.split(" <- ", 1)
        try:
            who, key = line.split()
            worker = HOST if who == "host" else int(who.removeprefix("w"))
            key, _, call = key.partition("/c")
            kind, stage, mb, at = parse_key(key)
            call = int(call) if call else 0
        except ValueError:
            raise ScheduleError(f"cannot parse action line {line!r}: expected "
                                "'w<N> KIND:STAGE[:m<MB>][@<LAYER>][/c<CALL>] [<- deps] "
                                "[<~ deps]'") from None
        return cls(kind, worker, stage, mb, at, tuple(dep_part.split()),
                   tuple(host_part.split()), call)


def action_key(kind: ActionKind, stage: str, mb: int | None = None, at: int | None = None,
               call: int = 0) -> str:
    """The key :attr:`Action.key` gives an action with these fields."""
    k = f"{kind.value}:{stage}"
    if mb is not None:
        k += f":m{mb}"
    if at is not None:
        k += f"@{at}"
    if call:
        k += f"/c{call}"
    return k


def parse_key(key: str) -> tuple[ActionKind, str, int | None, int | None]:
    """Kind, stage, microbatch and layer boundary of a key without a call suffix."""
    at = None
    if "@" in key:
        key, at_s = key.split("@")
        at = int(at_s)
    parts = key.split(":")
    kind = ActionKind(parts[0])
    stage = parts[1]
    mb = int(parts[2].removeprefix("m")) if len(parts) > 2 else None
    if len(parts) > 3:
        raise ValueError(key)
    return kind, stage, mb, at


@dataclass(frozen=True)
class Schedule:
    """Per-worker ordered action lists for one call (or several overlapping calls),
    plus the plan they execute. ``name`` says which generator made it (``roundpipe``,
    ``1f1b``, ...); a name ending in ``-eval`` marks an evaluation call."""

    plan: Plan
    workers: int
    microbatches: int
    actions: tuple[Action, ...]
    name: str = "roundpipe"

    @functools.cached_property
    def calls(self) -> int:
        """How many calls the schedule spans (1 unless calls overlap)."""
        return 1 + max((a.call for a in self.actions), default=0)

    def worker_actions(self, worker: int) -> tuple[Action, ...]:
        """The ordered list of one worker (``HOST`` for the host lane)."""
        return tuple(a for a in self.actions if a.worker == worker)

    def by_key(self) -> dict[str, Action]:
        return {a.key: a for a in self.actions}

    def to_text(self) -> str:
        """Text form; :meth:`from_text` reads it back into an equal schedule."""
        head = [f"# rotapipe schedule {self.name}", f"workers {self.workers}",
                f"microbatches {self.microbatches}", f"plan {self.plan.to_text()}"]
        return "\n".join(head + [a.to_line() for a in self.actions]) + "\n"

    @classmethod
    def from_text(cls, text: str) -> Schedule:
        name, workers, mbs, plan, actions = "roundpipe", None, None, None, []
        for raw in text.splitlines():
            line = raw.strip()
            if not line:
                continue
            if line.startswith("#"):
                if line.startswith("# rotapipe schedule "):
                    name = line.removeprefix("# rotapipe schedule ").strip()
                continue
            word, _, rest = line.partition(" ")
            if word == "workers":
                workers = int(rest)
            elif word == "microbatches":
                mbs = int(rest)
            elif word == "plan":
                plan = Plan.from_text(rest)
            else:
                actions.append(Action.from_line(line))
        if workers is None or mbs is None or plan is None:
            raise ScheduleError("schedule text needs 'workers', 'microbatches' and 'plan' "
                                "header lines")
        return cls(plan, workers, mbs, tuple(actions), name)

    def grid(self, mark: str | None = None, context: int | None = None) -> str:
        """The per-worker lists side by side, one column per worker plus the host.

        ``mark`` (an action key) is shown as ``>>key<<``; with ``context`` only rows
        within that distance of the marked row are printed.
        """
        cols = list(range(self.workers)) + [HOST]
        lists = [[a.key for a in self.worker_actions(w)] for w in cols]
        names = [f"w{w}" if w != HOST else "host" for w in cols]
        rows = max((len(col) for col in lists), default=0)
        mark_row = None
        for col in lists:
            for i, key in enumerate(col):
                if key == mark:
                    col[i] = f">>{key}<<"
                    mark_row = i
        width = max([len(k) for col in lists for k in col] + [4]) + 2
        lines = ["row  " + "".join(n.ljust(width) for n in names)]
        lo, hi = 0, rows
        if context is not None and mark_row is not None:
            lo, hi = max(0, mark_row - context), min(rows, mark_row + context + 1)
        if lo > 0:
            lines.append(f"...  ({lo} rows above)")
        for r in range(lo, hi):
            cells = [col[r] if r < len(col) else "" for col in lists]
            lines.append(f"{r:<4} " + "".join(c.ljust(width) for c in cells).rstrip())
        if hi < rows:
            lines.append(f"...  ({rows - hi} rows below)")
        return "\n".join(lines)
