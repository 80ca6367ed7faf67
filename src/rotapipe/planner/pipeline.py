"""How a :class:`rotapipe.RoundPipe` gets its plan: the planner's choice from costs the
runtime knows, an explicit plan validated and kept, or the even partition the user
asked for; and (``partition="refine"``, the default on CUDA) re-planning from measured
stage times.

The rule (docs/planning.md, "The runtime's plan"):

1. ``RoundPipe(plan=...)``: validated (it covers the model's layers; each stage's
   weights fit the worker budget, checked by the pipeline) and kept as given.
2. ``partition="even"``, or ``forward_stages`` / ``backward_stages`` set: the even
   partition with those counts (the defaults of :class:`~rotapipe.PipeConfig`).
3. Otherwise the planner (:func:`rotapipe.planner.choose_plan`) on
   :func:`work_costs` of each layer's per-token arithmetic (the FLOP model of the
   Hugging Face config when the adapter attached it, else the estimate of
   :mod:`rotapipe.model.work`; the timed emulation's costs when set), at the
   pipeline's worker count, microbatch count, recompute grain, ``tail_layers`` and
   worker budget (a CUDA device's memory when ``device_memory`` is unset); with
   ``optimizer_mode="stale"`` for the steady state of overlapping calls (as
   ``rotapipe plan --stale``), otherwise for one exact call. It splits
   the fused tail into several jobs (``Plan.tail_jobs``) only with a timed emulation's
   costs, which time the transfers a split adds, and never with ``tail_context`` or
   buffers. The first plan sees weights only; before the first call (and any call
   with a larger microbatch) :meth:`PipePlanner.fit_call` measures the activations on
   fake tensors and plans again if the plan has no room for them. If the memory bound
   (a sufficient condition) fits no plan, the plan of one-layer stages is used with a
   warning; if not even the fused tail can fit, the call is refused.
4. ``partition="auto"`` on CUDA workers runs as ``"refine"`` (:attr:`PipePlanner.mode`)
   unless the run may be data parallel (``data_parallel.enabled=True``, or unset with
   a ``torch.distributed`` group of more than one rank): ranks must keep one plan.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import replace

import torch
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

from ..config import OptimizerMode, PartitionMode, PipeConfig
from ..errors import ConfigError, DeviceOutOfMemoryError, PlanError
from ..model.work import estimate_work
from ..plan import LayerCost, ModelCosts, Plan, Stage, even_plan
from ..plan.costs import LayerWork
from ..plan.partitioner import Direction, Footprint
from ..schedule import ActionKind as K
from ..schedule.memory import format_bytes
from .activations import Activations, measure_activations, with_activations
from .autoplan import PlannerConfig, choose_plan, device_need
from .measured import MeasuredCosts, Pass, PlanRefiner

__all__ = ["work_costs", "parameter_costs", "emulation_costs", "stage_samples",
           "may_be_data_parallel", "PipePlanner", "RUNTIME_EXHAUSTIVE",
           "NOMINAL_FLOPS_PER_BYTE"]

log = logging.getLogger(__name__)

FALLBACK = "one-layer stages (the planner's memory bound fits no plan)"
""":attr:`PipePlanner.source` when no plan passes the planner's bound."""

_FIX = ("raise device_memory, or lower the activations of a microbatch (more microbatches, "
        "shorter sequences)")

RUNTIME_EXHAUSTIVE = 400
"""Plan-space size up to which the runtime's first plan is exact for one call at a
time (6 layers: 10 ms to 1.7 s on this project's 2-core machine, the slowest with one
worker; overlapping calls: 4 layers, ``autoplan._STALE_EXHAUSTIVE``); larger models,
and every re-plan of ``partition="refine"``, take the ranked candidates (see
:class:`PlannerConfig`)."""

_MS_PER_FLOP = 1e-9
"""A nominal 1 TFLOP/s: without a hardware profile only the ratios between layers
matter to the planner (no transfer is timed)."""

NOMINAL_FLOPS_PER_BYTE = 100.0
"""FLOPs a nominal device computes in the time it moves one byte of its memory (an RTX
4090: 165 TFLOP/s over 1 TB/s; an H100 PCIe: 756 over 2 TB/s): prices memory-bound
work (embedding lookups, :attr:`LayerWork.memory_bytes`) against matmuls."""


def work_costs(works: Sequence[LayerWork], weight_bytes: Sequence[int]) -> ModelCosts:
    """Costs the runtime knows without a hardware profile, from each layer's per-token
    arithmetic: forward time from ``forward_flops`` plus ``memory_bytes`` at
    :data:`NOMINAL_FLOPS_PER_BYTE`, backward from ``backward_flops`` plus twice the
    bytes, recompute once the forward, weights of ``weight_bytes`` (the real
    parameters'); per token of a nominal 1 TFLOP/s device. No transfer times and no
    activation bytes: tokens per microbatch are unknown before the first call."""
    if len(works) != len(weight_bytes):
        raise ConfigError(f"{len(works)} layer estimates for {len(weight_bytes)} layers")
    layers = []
    for i, (w, b) in enumerate(zip(works, weight_bytes)):
        moved = NOMINAL_FLOPS_PER_BYTE * w.memory_bytes
        f = (w.forward_flops + moved) * _MS_PER_FLOP
        layers.append(LayerCost(f"layer{i}", f, (w.backward_flops + 2 * moved) * _MS_PER_FLOP,
                                f, weight_bytes=int(b)))
    return ModelCosts(tuple(layers), 1)


def parameter_costs(params: Sequence[int], weight_bytes: Sequence[int]) -> ModelCosts:
    """Costs from parameter counts alone (the runtime's rule before :func:`work_costs`;
    kept for comparisons): each layer's forward time proportional to its parameters
    (plus one, so that a parameter-free layer is not free), backward twice and
    recompute once the forward, weights of ``weight_bytes``; no transfer times and no
    activation bytes."""
    if len(params) != len(weight_bytes):
        raise ConfigError(f"{len(params)} parameter counts for {len(weight_bytes)} layers")
    layers = []
    for i, (n, w) in enumerate(zip(params, weight_bytes)):
        f = 2 * (n + 1) * _MS_PER_FLOP
        layers.append(LayerCost(f"layer{i}", f, 2 * f, f, weight_bytes=int(w)))
    return ModelCosts(tuple(layers), 1)


def emulation_costs(emulated: ModelCosts, weight_bytes: Sequence[int]) -> ModelCosts:
    """A timed emulation's times with the real (stand-in) layers' weight bytes."""
    return replace(emulated, layers=tuple(replace(l, weight_bytes=int(w))
                                          for l, w in zip(emulated.layers, weight_bytes)))


class PipePlanner:
    """The plan of one pipeline: chooses it, and with ``partition="refine"`` refines it
    from the stage times of training calls (:meth:`observe`)."""

    def __init__(self, config: PipeConfig, workers: int, costs: ModelCosts,
                 grad_bytes: Sequence[int], budget: int | None, *,
                 refine_calls: int = 8, split_tail: bool = False,
                 auto_refine: bool = False):
        self.config, self.workers = config, workers
        self.mode = PartitionMode.REFINE if auto_refine and \
            config.partition is PartitionMode.AUTO else config.partition
        """The partition mode in effect: ``config.partition``, except that ``"auto"``
        runs as ``"refine"`` when ``auto_refine`` (CUDA workers, not data parallel)."""
        self.tail_jobs = (1, 2, 3, 4) if split_tail else (1,)
        """Tail job counts the planner may use (``Plan.tail_jobs``)."""
        self.base = costs
        self.grad_bytes = tuple(int(g) for g in grad_bytes)
        self.budget = budget
        n = len(costs.layers)
        # The tail keeps all its activations (unknown before the first call): its length
        # is the user's (config.tail_layers), the planner cuts the layers before it.
        self.tail_layers = min(config.tail_layers, n - 1) if n > 1 else None
        self.explicit_counts = (config.forward_stages is not None
                                or config.backward_stages is not None)
        self.refiner: PlanRefiner | None = None
        self.measured: MeasuredCosts | None = None
        self.refine_calls = refine_calls
        """Training calls after which refinement stops even if timings still move."""
        self.source = ""
        """How the plan was made: ``"explicit"``, ``"even"``, ``"planner"`` or
        :data:`FALLBACK`."""
        self.activations: Activations | None = None
        """Device bytes of the largest microbatch measured so far (:meth:`fit_call`)."""
        self.reserve = 0
        """Bytes of the worker budget held beside a stage's working set
        (:attr:`Activations.reserve`: side inputs, labels, outputs still downloading)."""
        self._shapes: list[tuple] = []       # the microbatch shapes measured (or tried)

    @classmethod
    def for_pipeline(cls, config: PipeConfig, layerset, devices: Sequence,
                     tail_context: bool) -> PipePlanner:
        """The planner of a pipeline: per-layer costs from each layer's arithmetic
        (:func:`work_costs` of :func:`rotapipe.model.estimate_work`; times from a timed
        emulation when set), weight-gradient bytes of trainable layers, the worker
        budget (90% of a CUDA device's memory when ``device_memory`` is unset), and
        measured refinement by default on CUDA unless the run may be data parallel."""
        dtype = config.precision.compute_dtype
        nbytes = dtype.itemsize
        params, weights, grads = [], [], []
        for pids in layerset.layer_params:
            ps = [layerset.params[p] for p in pids]
            params.append(sum(p.numel() for p in ps))
            # A tensor the model keeps in fp32 takes 4 bytes whatever the compute dtype.
            size = [p.numel() * (layerset.compute_dtype(pid, dtype).itemsize
                                 if p.is_floating_point() else p.element_size())
                    for pid, p in zip(pids, ps)]
            weights.append(sum(size))
            grads.append(sum(b for b, p in zip(size, ps) if p.requires_grad))
        costs = work_costs(estimate_work(layerset.layers, nbytes), weights)
        em = config.emulation
        if em is not None and len(em.costs.layers) == len(params):
            costs = emulation_costs(em.costs, weights)
        budgets = [d.budget for d in devices if d.budget is not None]
        if not budgets and devices and devices[0].torch_device.type == "cuda":
            # leave room for the CUDA context and fragmentation
            budgets = [int(0.9 * torch.cuda.get_device_properties(d.torch_device).total_memory)
                       for d in devices]
        # A split tail needs transfer times to be judged (the head's weights go to
        # several workers): only with a timed emulation's costs, and never with a
        # whole-batch loss context or buffers (each tail job would keep its own).
        split = em is not None and not tail_context and not layerset.buffer_layers()
        cuda = bool(devices) and devices[0].torch_device.type == "cuda"
        return cls(config, len(devices), costs, grads, min(budgets) if budgets else None,
                   split_tail=split, auto_refine=cuda and not may_be_data_parallel(config))

    # -- the first plan -------------------------------------------------------------
    def initial(self, plan: Plan | None) -> Plan:
        """The plan to build the pipeline with (see the module docstring)."""
        n = len(self.base.layers)
        if plan is not None:
            if not isinstance(plan, Plan):
                raise ConfigError(f"plan={plan!r} is not a rotapipe.plan.Plan: build one "
                                  "with Plan.from_text(...) or even_plan(...), or leave "
                                  "plan=None for the planner")
            if plan.num_layers != n:
                raise ConfigError(f"the plan covers {plan.num_layers} layers but the model "
                                  f"has {n}: build the plan for {n} layers")
            self.source = "explicit"
            return plan
        mode = self.mode
        if mode is PartitionMode.EVEN or self.explicit_counts:
            self.source = "even"
            return self._even()
        try:
            chosen = self._choose(self.base)
        except PlanError:
            self.source = FALLBACK
            return self._no_fit(self._footprint(self.base), 0, "its weights",
                                "raise device_memory, or lower the weights' bytes (a "
                                "lower-precision compute dtype, LoRA)")
        self.source = "planner"
        if mode is PartitionMode.REFINE:
            self.measured = MeasuredCosts(n)
            # Re-plans take the ranked candidates: they run in the caller's thread
            # between calls, where the exact search of a small model costs 0.2-1.7 s
            # a time (one worker: its bounds prune little) for a step within 2.5% of it
            # (docs/planning.md, "Measured costs and refinement").
            self.refiner = PlanRefiner(lambda c: self._choose(c, exhaustive=0), self.base,
                                       chosen)
        return chosen

    def _even(self) -> Plan:
        c, n, w = self.config, len(self.base.layers), self.workers
        nf = c.forward_stages or 2 * w
        return even_plan(n, nf, c.backward_stages or 3 * nf, min(c.tail_layers or 1, n))

    def _finest(self) -> Plan:
        """One-layer stages before the user's tail: the least device memory a plan
        can need (each stage holds the fewest weights and activations)."""
        n = len(self.base.layers)
        body = n - (self.tail_layers or 1) if n > 1 else 0
        return even_plan(n, body, body, n - body) if body else even_plan(n, 1, 1, n)

    def _footprint(self, costs: ModelCosts) -> Footprint:
        return Footprint.of(costs, self.config.microbatches, self.config.grain,
                            self.grad_bytes, self.config.prefetch)

    def _choose(self, costs: ModelCosts, exhaustive: int = RUNTIME_EXHAUSTIVE) -> Plan:
        memory = self.budget - self.reserve if self.budget is not None else 2 ** 62
        if memory < 1:         # what a worker keeps beside its stages fills the budget
            raise PlanError(f"the worker budget of {format_bytes(self.budget)} holds no "
                            f"more than the {format_bytes(self.reserve)} a worker keeps "
                            "beside its stages (side inputs, labels, outputs in flight)")
        cfg = PlannerConfig(self.workers, memory, (self.config.microbatches,),
                            grains=(self.config.grain,), exhaustive=exhaustive,
                            grad_bytes=self.grad_bytes, tail_layers=self.tail_layers,
                            tail_jobs=self.tail_jobs, prefetch=self.config.prefetch,
                            stale=self.config.optimizer_mode is OptimizerMode.STALE)
        return choose_plan(lambda m: costs, cfg).plan

    # -- room for activations -------------------------------------------------------
    def fit_call(self, plan: Plan, layerset, inputs, labels, microbatches: int, dtype,
                 side=None, loss_fn=None, training: bool = True) -> Plan | None:
        """Before a call of ``inputs`` and ``labels`` (``None`` when evaluating) in
        ``microbatches`` on the planner's ``plan`` (an evaluation: ``training=False``,
        nothing kept for a backward): measure the activations of a
        microbatch (:func:`measure_activations`, on the first, the largest) unless one
        at least as large in every dimension was measured before, and return a plan
        with room for them if ``plan`` has none by the planner's bound (``None``: keep
        it). The first plan saw weights only: tokens per microbatch are unknown before
        the first call. See :meth:`check_layers` and :meth:`_no_fit` when no plan fits."""
        if self.source not in ("planner", FALLBACK) or self.budget is None:
            return None
        try:            # views: a call whose shapes were measured costs no copy
            mbs = _split(inputs, microbatches)
            lbs = None if labels is None else _split(labels, microbatches)
        except Exception:  # noqa: BLE001 - the call itself names what is wrong
            return None
        shapes = _shapes((mbs[0], None if lbs is None else lbs[0]))
        if shapes is None or any(_within(shapes, seen) for seen in self._shapes):
            return None
        try:
            mbs = [tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and
                            t.is_floating_point() else t, m) for m in mbs]
            if side is not None and hasattr(side, "for_batch"):
                side = side.for_batch(mbs)
            acts = measure_activations(layerset, mbs[0], None if lbs is None else lbs[0],
                                       dtype, len(mbs), side, loss_fn, training)
        except Exception as exc:  # noqa: BLE001 - advisory: the call reports its own errors
            self._shapes.append(shapes)
            log.warning("could not measure the activations of a microbatch on fake "
                        "tensors (%s: %s); the plan keeps the room it has", type(exc).__name__,
                        exc)
            return None
        if self.activations is not None:
            acts = self.activations.merge(acts)
        costs = with_activations(self.base, acts)
        fp = self._footprint(costs)
        if device_need(plan, fp) + acts.reserve <= self.budget:
            new = None
        else:
            self.check_layers(fp, acts)          # raises when no plan can fit
            try:
                self.reserve, new = acts.reserve, None
                new, self.source = self._choose(costs), "planner"
            except PlanError:
                new = self._no_fit(fp, acts.reserve, "this call's activations", _FIX)
                self.source, new = FALLBACK, None if new == plan else new
        self._shapes.append(shapes)
        self.activations, self.reserve, self.base = acts, acts.reserve, costs
        if self.refiner is not None:          # its re-plans leave the room too
            self.refiner.base, self.refiner.plan = costs, new or plan
            self.refiner.frozen |= self.source == FALLBACK    # nothing to re-plan to
        return new

    def check_layers(self, fp: Footprint, acts: Activations) -> None:
        """Raise :class:`DeviceOutOfMemoryError` (before any work) if a layer before the
        tail (its weights and the activations its backward keeps) or the fused tail
        (its weights and every activation it keeps), with a microbatch's side inputs,
        exceeds the budget: every plan holds them on one worker at once, so none fits."""
        n = len(fp.costs.layers)
        body = n - (self.tail_layers or 1) if n > 1 else 0
        runs = [(i, i + 1) for i in range(body)] + [(body, n)]
        needs = [fp.resident(Direction.FORWARD, a, b) + acts.side_bytes + sum(
            l.saved_bytes for l in fp.costs.layers[a:b]) for a, b in runs]
        (a, b), need = max(zip(runs, needs), key=lambda r: r[1])
        if need > self.budget:
            what = f"the fused tail [{a}:{b}]" if b == n else f"layer {a}"
            raise DeviceOutOfMemoryError(
                f"no plan fits the worker budget of {format_bytes(self.budget)}: {what} "
                f"alone needs {format_bytes(need)} with this call's microbatches "
                f"({format_bytes(acts.input_bytes)} of input each): its weights and the "
                f"activations its backward keeps. Fix: {_FIX} (to at least "
                f"{format_bytes(need)})")

    def _no_fit(self, fp: Footprint, reserve: int, what: str, fix: str) -> Plan:
        """No plan passes the planner's bound with ``what``. The bound is sufficient,
        not necessary (it puts the largest stage beside every stage: a run can fit
        well within it), so the pipeline runs the plan of one-layer stages, the least
        device memory, with a warning naming the budget, the need and the fix."""
        finest = self._finest()
        need = device_need(finest, fp) + reserve
        log.warning("no plan fits the worker budget of %s with %s by the planner's bound "
                    "(sufficient, not necessary): running the plan of one-layer stages, "
                    "%s, which needs up to %s by it, and may run out of device memory. "
                    "Fix: %s (to %s)", format_bytes(self.budget), what, finest.to_text(),
                    format_bytes(need), fix, format_bytes(need))
        return finest

    # -- refinement -----------------------------------------------------------------
    @property
    def refining(self) -> bool:
        return self.refiner is not None and not self.refiner.frozen

    def observe(self, spans: Iterable[tuple], stages: dict[str, Stage], calls: int,
                ) -> Plan | None:
        """Record one training call's compute spans (``(action, start_s, end_s)``, as
        :attr:`rotapipe.runtime.executor.Executor.last_spans`) and return a new plan if
        the refiner changed it (``None``: keep the current one). A stage's time is
        spread over its layers in proportion to their current estimate."""
        if not self.refining:
            return None
        estimate = self.measured.apply(self.base)
        for sample in stage_samples(spans, stages, estimate):
            self.measured.record(*sample)
        old = self.refiner.plan
        new = self.refiner.update(self.measured)
        if calls >= self.refine_calls:
            self.refiner.frozen = True
        return new if new != old else None


def _split(tree, parts: int) -> list:
    """``tree``'s microbatches as the runtime cuts them (tensors split along dim 0)."""
    leaves, spec = tree_flatten(tree)
    chunks = [torch.tensor_split(t, parts) if isinstance(t, torch.Tensor) else [t] * parts
              for t in leaves]
    return [tree_unflatten([c[m] for c in chunks], spec) for m in range(parts)]


def _shapes(tree) -> tuple | None:
    """The shapes of a microbatch's tensors (``None``: it has none)."""
    shapes = tuple(tuple(t.shape) for t in tree_leaves(tree) if isinstance(t, torch.Tensor))
    return shapes or None


def _within(shapes: tuple, seen: tuple) -> bool:
    """Whether every tensor of ``shapes`` is at most as large as ``seen``'s, dimension
    by dimension (its activations then fit wherever those did)."""
    return len(shapes) == len(seen) and all(
        len(a) == len(b) and all(x <= y for x, y in zip(a, b)) for a, b in zip(shapes, seen))


def may_be_data_parallel(config: PipeConfig) -> bool:
    """Whether the pipeline may turn data parallelism on (see
    :class:`~rotapipe.DataParallelConfig`): asked for, or left to auto with an
    initialized ``torch.distributed`` default group of more than one rank (a smaller
    group passed to the pipeline is not known here: the answer errs towards yes)."""
    enabled = config.data_parallel.enabled
    if enabled is not None:
        return enabled
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def stage_samples(spans: Iterable[tuple], stages: dict[str, Stage], estimate: ModelCosts,
                  ) -> Iterable[tuple[int, Pass, float]]:
    """``(layer, pass, ms)`` samples of one call's compute spans: forward (``F``),
    recompute (``R``), backward (``B``) and the fused tail (``FT``, split into its
    forward and backward by the estimate)."""
    for action, start, end in spans:
        kind = action.kind
        if kind not in (K.FORWARD, K.RECOMPUTE, K.BACKWARD, K.FUSED):
            continue
        stage = stages.get(action.stage)
        if stage is None:
            continue
        ms = (end - start) * 1e3
        layers = estimate.layers[stage.start:stage.stop]
        parts = {K.FORWARD: [(Pass.FORWARD, l.forward_ms) for l in layers],
                 K.RECOMPUTE: [(Pass.RECOMPUTE, l.recompute_ms) for l in layers],
                 K.BACKWARD: [(Pass.BACKWARD, l.backward_ms) for l in layers],
                 K.FUSED: [(p, t) for l in layers for p, t in
                           ((Pass.FORWARD, l.forward_ms), (Pass.BACKWARD, l.backward_ms))]}[kind]
        total = sum(t for _, t in parts)
        for i, (p, t) in enumerate(parts):
            layer = stage.start + (i // 2 if kind is K.FUSED else i)
            yield layer, p, ms * (t / total if total > 0 else 1 / len(parts))
