"""The plan as plain data (stages over layer ranges) and the even partitioner."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..errors import PlanError


INPUT_DEPTH = 2
"""Microbatch inputs a worker may hold on the device ahead of the compute that consumes
them. The schedule generators (:mod:`rotapipe.schedule`) bound their input uploads by
it and the partitioner's memory bound (:mod:`rotapipe.plan.partitioner`) counts it;
it lives here, below both."""


class StageKind(str, enum.Enum):
    """Forward stage, fused tail stage, or backward stage; the value is the name prefix."""

    FORWARD = "F"
    TAIL = "T"
    BACKWARD = "B"


@dataclass(frozen=True)
class Stage:
    """A run of consecutive layers ``[start, stop)`` executed as one job on a worker."""

    kind: StageKind
    index: int
    start: int
    stop: int

    @property
    def name(self) -> str:
        """Short name used in schedules: ``F0``, ``F1``..., ``T``, ``B0``, ``B1``...
        (a tail split over several jobs: ``T``, ``T1``, ``T2``...)."""
        if self.kind is StageKind.TAIL and self.index == 0:
            return "T"
        return f"{self.kind.value}{self.index}"

    @property
    def layers(self) -> range:
        return range(self.start, self.stop)

    def __str__(self) -> str:
        return f"{self.name}[{self.start}:{self.stop}]"


@dataclass(frozen=True)
class Plan:
    """Forward stages, fused tail and backward stages of one model.

    Forward stages cover ``[0, tail.start)`` in order; the tail covers
    ``[tail.start, num_layers)``; backward stages cover ``[0, tail.start)`` in order and
    are planned independently of the forward stages (usually smaller). The execution
    order of one step is ``F0 .. Fk-1, T, Bj-1 .. B0``: :meth:`jobs` gives it.
    """

    num_layers: int
    forward: tuple[Stage, ...]
    tail: Stage
    backward: tuple[Stage, ...]
    tail_jobs: int = 1
    """Jobs the fused tail is split into, each on its own worker for a share of the
    microbatches (dealt in turn: microbatch ``m`` goes to job ``m % tail_jobs``). The
    tail is the heaviest stage of models with a large vocabulary; splitting it is data
    parallelism inside the pipeline."""

    def __post_init__(self):
        n = self.num_layers
        whole = [self.num_layers] + [v for s in (*self.forward, self.tail, *self.backward)
                                     for v in (s.index, s.start, s.stop)]
        if any(isinstance(v, bool) or not isinstance(v, int) for v in whole):
            raise PlanError(f"a plan counts layers in ints: num_layers={n!r}, stages "
                            f"{[str(s) for s in (*self.forward, self.tail, *self.backward)]}")
        if n < 1:
            raise PlanError("a plan needs at least one layer")
        if not isinstance(self.tail_jobs, int) or self.tail_jobs < 1:
            raise PlanError(f"tail_jobs={self.tail_jobs!r} must be an int >= 1")
        t = self.tail
        if t.kind is not StageKind.TAIL or t.stop != n or not 0 <= t.start < n:
            raise PlanError(f"the tail must be a TAIL stage ending at layer {n}, got {t}")
        for kind, stages in ((StageKind.FORWARD, self.forward),
                             (StageKind.BACKWARD, self.backward)):
            pos = 0
            for i, s in enumerate(stages):
                if s.kind is not kind or s.index != i or s.start != pos or s.stop <= s.start:
                    raise PlanError(f"{kind.name.lower()} stage {i} is {s}: stages must "
                                    f"be numbered 0.., contiguous and non-empty from layer 0")
                pos = s.stop
            if pos != t.start:
                raise PlanError(f"{kind.name.lower()} stages end at layer {pos} but the "
                                f"tail starts at layer {t.start}")

    def jobs(self) -> tuple[Stage, ...]:
        """Stage jobs in execution order: forward stages, the tail (its jobs), backward
        stages deepest first. Job ``j`` runs on worker ``j % workers`` (round-robin)."""
        return self.forward + self.tails() + tuple(reversed(self.backward))

    def tails(self) -> tuple[Stage, ...]:
        """The tail's jobs: ``T`` (index 0), then ``T1``, ``T2``... over the same layers."""
        t = self.tail
        return tuple(Stage(StageKind.TAIL, i, t.start, t.stop) for i in range(self.tail_jobs))

    def tail_microbatches(self, index: int, microbatches: int) -> range:
        """The microbatches tail job ``index`` runs: every ``tail_jobs``-th from
        ``index`` on. Dealt in turn, the first microbatches out of the forward stages
        start on every tail job at once, and the first gradients back reach the
        backward stages a tail job's microbatch apart, not a whole share apart."""
        k = self.tail_jobs
        if microbatches < k:
            raise PlanError(f"the tail is split into {k} jobs but a call has only "
                            f"{microbatches} microbatches: use at least {k} microbatches "
                            "or fewer tail jobs")
        return range(index, microbatches, k)

    def tail_for(self, mb: int, microbatches: int) -> Stage:
        """The tail job that runs microbatch ``mb``."""
        for t in self.tails():
            if mb in self.tail_microbatches(t.index, microbatches):
                return t
        raise PlanError(f"microbatch {mb} is outside 0..{microbatches - 1}")

    def eval_jobs(self) -> tuple[Stage, ...]:
        """Stage jobs of an evaluation call: the forward stages, then the tail's layers
        as one more forward stage (no loss, no backward)."""
        return self.forward + (Stage(StageKind.FORWARD, len(self.forward),
                                     self.tail.start, self.tail.stop),)

    def stage(self, name: str) -> Stage:
        for s in self.jobs():
            if s.name == name:
                return s
        raise PlanError(f"no stage named {name!r} in plan {self}")

    def checkpoint_boundaries(self) -> frozenset[int]:
        """Layer indices whose input activation is kept in host memory: every backward
        stage start and the tail start (forward stages download them)."""
        return frozenset(s.start for s in self.backward) | {self.tail.start}

    def to_text(self) -> str:
        """E.g. ``F0[0:2] T[2:3] B0[0:1] B1[1:2]``; a split tail reads ``T[2:3]x2``."""
        tail = str(self.tail) + (f"x{self.tail_jobs}" if self.tail_jobs > 1 else "")
        return " ".join([str(s) for s in self.forward] + [tail] +
                        [str(s) for s in self.backward])

    @classmethod
    def from_text(cls, text: str) -> Plan:
        """Parse the form :meth:`to_text` writes, e.g. ``F0[0:2] T[2:3] B0[0:1] B1[1:2]``."""
        fwd, bwd, tail, tail_jobs = [], [], None, 1
        for tok in text.split():
            if tok.startswith("T[") and "]x" in tok:
                tok, _, jobs = tok.partition("]x")
                tok += "]"
                if not jobs.isdigit():
                    raise PlanError(f"cannot parse the tail's job count in {tok}x{jobs}: "
                                    "write T[start:stop]xN")
                tail_jobs = int(jobs)
            try:
                name, rng = tok.rstrip("]").split("[")
                start, stop = (int(v) for v in rng.split(":"))
            except ValueError:
                raise PlanError(f"cannot parse stage {tok!r}: write NAME[start:stop]") from None
            if name == "T":
                tail = Stage(StageKind.TAIL, 0, start, stop)
            elif name[:1] in ("F", "B") and name[1:].isdigit():
                kind = StageKind(name[0])
                (fwd if kind is StageKind.FORWARD else bwd).append(
                    Stage(kind, int(name[1:]), start, stop))
            else:
                raise PlanError(f"unknown stage name {name!r} in {tok!r}")
        if tail is None:
            raise PlanError(f"plan text {text!r} has no tail stage T[start:stop]")
        return cls(tail.stop, tuple(fwd), tail, tuple(bwd), tail_jobs)


def _split(start: int, stop: int, parts: int) -> list[tuple[int, int]]:
    if parts == 0:   # every layer is in the fused tail (e.g. a one-layer model)
        return []
    n = stop - start
    bounds = [start + (n * i) // parts for i in range(parts + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(parts)]


def even_plan(num_layers: int, forward_stages: int, backward_stages: int,
              tail_layers: int = 1) -> Plan:
    """Split ``num_layers`` evenly: the last ``tail_layers`` form the fused tail, the
    rest are cut into ``forward_stages`` and, independently, ``backward_stages``
    stages (each capped at one layer per stage)."""
    if num_layers < 1:
        raise PlanError("the model has zero layers: give at least one layer")
    if tail_layers > num_layers:
        raise PlanError(f"tail_layers={tail_layers} exceeds the {num_layers} layers of "
                        "the model: lower tail_layers")
    body = num_layers - tail_layers
    nf = min(forward_stages, body)
    nb = min(backward_stages, body)
    fwd = tuple(Stage(StageKind.FORWARD, i, a, b) for i, (a, b) in enumerate(_split(0, body, nf)))
    bwd = tuple(Stage(StageKind.BACKWARD, i, a, b) for i, (a, b) in enumerate(_split(0, body, nb)))
    return Plan(num_layers, fwd, Stage(StageKind.TAIL, 0, body, num_layers), bwd)
