"""Checks of what callers hand a RoundPipe: constructor arguments, an optimizer and its
scheduler, a state dict, a pipeline state. Each raises before anything changes, with a
message naming the argument, what it got and the fix."""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable, Mapping

import torch

from ..config import PipeConfig
from ..errors import CheckpointError, ConfigError, InputError

__all__ = ["kind", "check_arguments", "check_layers", "check_optimizer_step",
           "check_scheduler", "check_state", "check_pipeline_state", "ModelWatch",
           "OptimizerParams"]


def kind(value) -> str:
    """How an error names a value of the wrong kind: a class as 'the class X'."""
    if value is None:
        return "None"
    if isinstance(value, type):
        return f"the class {value.__name__}"
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def check_arguments(loss_fn, config, optimizer, **fns) -> None:
    """The constructor's arguments: ``loss_fn`` callable, ``config`` a
    :class:`PipeConfig` (or ``None``), ``optimizer`` an optimizer or a factory of one,
    each of ``fns`` (``side_inputs``, ``loss_weight``, ``tail_context``) callable or
    ``None``."""
    if not callable(loss_fn):
        raise ConfigError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if config is not None and not isinstance(config, PipeConfig):
        raise ConfigError(f"config must be a rotapipe.PipeConfig, got {kind(config)}: "
                          "build one, e.g. config=rotapipe.PipeConfig(microbatches=4)")
    for name, fn in fns.items():
        if fn is not None and not callable(fn):
            raise ConfigError(f"{name} must be callable (or None), got {kind(fn)}")
    # A loss over the whole batch (a wrapped MoE model's load balancing) says so.
    why = getattr(loss_fn, "tail_context_needed", None)
    if why and fns.get("tail_context") is None:
        raise ConfigError(why)
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer) \
            and (not callable(optimizer) or isinstance(optimizer, type)
                 and not issubclass(optimizer, torch.optim.Optimizer)):
        raise ConfigError(f"optimizer must be a torch.optim.Optimizer or a callable "
                          f"params -> Optimizer, got {kind(optimizer)}: e.g. "
                          "optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4)")


# Dtypes a trained parameter may have: its fp32 master holds any of them exactly.
_MASTER_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_layers(layerset) -> None:
    """The wrapped layers' trained parameters, before the pipeline changes anything:
    each must widen exactly into an fp32 master (the host converts it in place), none
    may get a sparse gradient (the workers move dense weight gradients only), and none
    may have a gradient hook (it would never run on the workers' copies); every layer
    must copy into a worker's shell (:meth:`~rotapipe.model.LayerSet.check_copies`)."""
    for name, p in zip(layerset.param_names, layerset.params):
        if isinstance(p, torch.nn.parameter.UninitializedTensorMixin):
            raise ConfigError(f"parameter {name} is not initialized yet (a lazy module, "
                              "e.g. nn.LazyLinear): run the model once on a sample batch "
                              "before wrapping it, so that its shapes are known")
        if p.requires_grad and p.dtype not in _MASTER_DTYPES:
            fix = ("convert it with .float() before wrapping, or freeze it "
                   "(requires_grad_(False))")
            if p.dtype.is_complex:
                why = "narrowing it would drop its imaginary part"
            else:
                why = "the pipeline would train it in float32, less precisely than it is"
            raise ConfigError(
                f"parameter {name} is {p.dtype}: rotapipe keeps an fp32 master of every "
                f"trained parameter and computes in PipeConfig.precision (float32, "
                f"bfloat16 or float16), so {why}. Trained parameters must be float32, "
                f"bfloat16 or float16: {fix}")
        hook = _grad_hook(p)
        if hook is not None:
            raise ConfigError(_grad_hook_refusal(name, hook, later=False))
    _check_no_shared_memory(layerset)
    for i, layer in enumerate(layerset.layers):
        for mod_name, mod in layer.named_modules():
            if isinstance(mod, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and \
                    mod.sparse and mod.weight.requires_grad:
                where = f"{i}.{mod_name}" if mod_name else str(i)
                raise ConfigError(
                    f"layer {where} ({type(mod).__name__}) has sparse=True: its weight "
                    "would get a sparse gradient, and rotapipe moves dense weight "
                    "gradients only. Build it with sparse=False (the dense gradient "
                    "trains the same), or freeze its weight")
            for attr, value in vars(mod).items():
                if isinstance(value, torch.Generator):
                    where = f"{i}.{mod_name}" if mod_name else str(i)
                    raise ConfigError(
                        f"layer {where} ({type(mod).__name__}) holds a torch.Generator "
                        f"({attr}): each worker would draw from its own copy, and a "
                        "backward stage's recompute would draw other numbers than the "
                        "forward did. Draw from the default generator instead (no "
                        "generator= argument): rotapipe seeds it per call, microbatch "
                        "and layer, so the numbers are reproducible and the recompute "
                        "draws the same ones")
    layerset.check_copies()


def _check_no_shared_memory(layerset) -> None:
    """Refuse a trained parameter whose memory overlaps another parameter's (one made
    as a view of the other): plain PyTorch's optimizer step on one changes the other,
    but the pipeline's fp32 masters and compute copies are tensors of their own."""
    spans: dict[int, list[tuple[int, int, int]]] = {}     # storage -> byte ranges
    for pid, p in enumerate(layerset.params):
        if p.numel() == 0 or p.layout is not torch.strided or p.is_meta:
            continue
        try:
            ptr = p.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):    # a tensor subclass without one
            continue
        start = p.storage_offset()
        end = start + sum((n - 1) * abs(s) for n, s in zip(p.shape, p.stride())) + 1
        spans.setdefault(ptr, []).append((start * p.element_size(),
                                          end * p.element_size(), pid))
    params, names = layerset.params, layerset.param_names
    for group in spans.values():
        group.sort()
        end, members = -1, []            # the run of overlapping ranges so far
        for start, stop, b in group:
            if start >= end:
                end, members = stop, [b]
                continue
            other = next((a for a in members if params[a].requires_grad), members[0])
            if params[b].requires_grad or params[other].requires_grad:
                raise ConfigError(
                    f"parameters {names[other]} and {names[b]} share memory (one is a "
                    "view of the other): the pipeline keeps a separate master of each "
                    "trained parameter, so an update of one would not change the other "
                    "as in plain PyTorch. Make them one parameter (and compute the other "
                    "from it in forward), or independent ones (nn.Parameter(t.clone()))")
            end, members = max(end, stop), members + [b]


def _grad_hook(p: torch.Tensor) -> str | None:
    """How a trained parameter's gradient is hooked (``None``: it is not)."""
    if not p.requires_grad:
        return None      # never gets a gradient: its hooks never run, as in plain PyTorch
    if p._backward_hooks:
        return "register_hook"
    if getattr(p, "_post_accumulate_grad_hooks", None):
        return "register_post_accumulate_grad_hook"
    return None


def _grad_hook_refusal(name: str, hook: str, later: bool) -> str:
    when = " since the pipeline was built" if later else ""
    return (f"parameter {name} has a gradient hook ({hook}){when}: the workers compute "
            "with copies of the weights, so it would never run and the weight would train "
            "without it. Change the gradient after forward_backward instead (e.g. "
            "p.grad.mul_(mask) before pipe.step(), with optimizer_mode 'sync'), or "
            "remove the hook (handle.remove())")


def _required_args(fn, skip: int = 0) -> list[str]:
    """The positional parameters ``fn`` needs (after the first ``skip``); none when
    it has no signature (a builtin: let it run)."""
    try:
        params = list(inspect.signature(fn).parameters.values())[skip:]
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.default is p.empty
            and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def check_optimizer_step(optimizer) -> None:
    """Refuse an optimizer whose ``step()`` needs a closure (``LBFGS``): the pipeline
    steps it with none, on its own thread, after the gradients are in; and one with
    ``capturable=True`` over host parameters, which torch refuses to step."""
    # The class's method, less ``self`` (an instance may hold a patched step).
    needed = _required_args(type(optimizer).step, skip=1)
    if needed:
        raise ConfigError(
            f"{type(optimizer).__name__}.step() needs {', '.join(needed)} (it re-evaluates "
            "the loss itself), and the pipeline steps the optimizer once per step with "
            "none: use an optimizer that steps from the gradients alone (SGD, Adam, "
            "AdamW, ...)")
    for i, group in enumerate(optimizer.param_groups):
        if group.get("capturable") and any(p.device.type == "cpu" for p in group["params"]):
            # torch refuses it at the first step, which then failed the call (in sync
            # reported as partly stepped, though nothing had changed).
            raise ConfigError(
                f"{type(optimizer).__name__} has capturable=True (param group {i}), which "
                "torch.optim runs only on accelerator parameters, and the pipeline's "
                "optimizer steps the fp32 masters in host (CPU) memory: build it with "
                "capturable=False (fused=True is the fast choice on the CPU)")


class OptimizerParams:
    """The parameters the attached optimizer holds, validated. ``attach_optimizer``
    refuses one that is not a trainable parameter of the pipeline (the pipeline would
    never give it a gradient, or never carry its update to the workers); so does every
    later step when ``param_groups`` changed since (``add_param_group``, a group's
    ``params`` replaced or removed): per step a tuple of the parameters' ids is
    compared, the check itself runs only when it changed. ``ours``: what the optimizer
    may hold (:meth:`RoundPipe.parameters`); ``names``: every parameter of the model by
    id, ``(name, trained by the pipeline)``, to name one; ``states``: the
    :class:`~rotapipe.runtime.optstate.StatePrecision` to re-check a group against."""

    def __init__(self, ours: Iterable[torch.Tensor], names: Mapping[int, tuple[str, bool]],
                 states=None):
        self.ours = frozenset(id(p) for p in ours)
        self.names, self.states = names, states
        self.seen: tuple[int, ...] | None = None

    def check(self, optimizer) -> None:
        ids = tuple(id(p) for g in optimizer.param_groups for p in g["params"])
        if ids == self.seen:
            return
        later = self.seen is not None
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in self.ours:
                    raise ConfigError(self._refused(p, later))
        if self.states is not None:
            self.states.check(optimizer)
        self.seen = ids

    def _refused(self, p, later: bool) -> str:
        name, trained = self.names.get(id(p), (None, False))
        if name is None:
            what = ("the optimizer holds a parameter that is not a trainable parameter of "
                    f"the wrapped layers (shape {tuple(p.shape)}): the pipeline would never "
                    "give it a gradient")
        elif not trained:
            what = (f"the optimizer holds parameter {name}, which was frozen when the "
                    "pipeline was built: the pipeline keeps no trainable master for it and "
                    "never trains it (unfreezing it later does not change that). Set "
                    "requires_grad before wrapping (build a new RoundPipe), or leave it "
                    "out of the optimizer")
        else:
            what = (f"the optimizer holds parameter {name} itself, but a sharded pipeline "
                    "steps this rank's fp32 pieces of it (pipe.parameters())")
        if later:
            return (f"{what}. Its parameter group was added or changed after "
                    "attach_optimizer (add_param_group, or a group's params replaced); "
                    "nothing was stepped: remove it from the optimizer, or build the "
                    "optimizer over pipe.parameters() (param groups are fine) and attach "
                    "it again")
        return f"{what}: build it over pipe.parameters()"


def check_scheduler(scheduler) -> None:
    """Refuse a scheduler whose ``step()`` needs arguments (``ReduceLROnPlateau``
    takes the metric): the pipeline steps it after each optimizer step with none."""
    step = getattr(scheduler, "step", None)
    if not callable(step):
        raise ConfigError(f"the scheduler ({type(scheduler).__name__}) has no step() "
                          "method: pass a torch.optim.lr_scheduler over the optimizer")
    needed = _required_args(step)
    if needed:
        raise ConfigError(
            f"{type(scheduler).__name__}.step() needs {', '.join(needed)}, and the pipeline "
            "steps the scheduler after each optimizer step with no arguments: step it "
            "yourself after pipe.step() (after pipe.flush() with optimizer_mode 'overlap' "
            "or 'stale'), and leave it out of attach_optimizer")


def check_state(own: dict[str, torch.Tensor], state, strict: bool) -> None:
    """A state dict to load into ``own`` (the container's ``state_dict(keep_vars=True)``):
    keys (with ``strict``: none missing, none unexpected), shapes, dtype kinds and dense
    layouts; one :class:`ConfigError` naming every offending key."""
    if not isinstance(state, dict):
        raise ConfigError(f"load_state_dict takes a dict of tensors (as state_dict() "
                          f"returns), got {type(state).__name__}")
    problems = []
    if strict:
        problems += [f"missing key {k!r}" for k in own if k not in state]
        problems += [f"unexpected key {k!r}" for k in state if k not in own]
    for k, v in state.items():
        if k not in own:
            continue
        mine = own[k]
        if not isinstance(v, torch.Tensor):
            problems.append(f"{k!r} is a {type(v).__name__}, not a tensor")
        elif v.shape != mine.shape:
            problems.append(f"{k!r} has shape {tuple(v.shape)}, the model's is "
                            f"{tuple(mine.shape)}")
        elif v.is_floating_point() != mine.is_floating_point():
            problems.append(f"{k!r} has dtype {v.dtype}, the model's is {mine.dtype}")
        elif v.layout is not torch.strided or v.is_meta:
            problems.append(f"{k!r} is a {'meta' if v.is_meta else str(v.layout)} "
                            "tensor, which holds no dense values: pass dense "
                            "tensors (.to_dense(), or load real weights)")
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more"
                                          if len(problems) > 8 else "")
        raise ConfigError(f"load_state_dict: {shown}. Nothing was loaded: pass "
                          "a state_dict of this model (strict=False skips missing "
                          "and unexpected keys)")


def check_pipeline_state(state) -> tuple[int, int, float, int, bool]:
    """``(calls, evals, scale, good_steps, dynamic)`` of a
    :meth:`RoundPipe.pipeline_state` dict, checked: counts are ints >= 0 (training calls
    number from 0; evaluation uses -1, -2, ...), the scale a finite float > 0,
    ``dynamic`` (whether the scale was dynamic; absent in older states: ``True``) a
    bool."""
    fix = "pass what pipe.pipeline_state() returned (the checkpoint is damaged otherwise)"
    if not isinstance(state, dict):
        raise CheckpointError(f"load_pipeline_state takes a dict, got {kind(state)}: {fix}")
    scaler = state.get("scaler")
    if not isinstance(scaler, dict):
        raise CheckpointError(f"the pipeline state's 'scaler' is "
                              f"{'missing' if scaler is None else kind(scaler)}, not a "
                              f"dict: {fix}")
    out = []
    for where, key in ((state, "calls"), (state, "evals"), (scaler, "good_steps")):
        v = where.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise CheckpointError(f"the pipeline state's {key!r} is "
                                  f"{'missing' if v is None else repr(v)}: it must be an "
                                  f"int >= 0; {fix}")
        out.append(v)
    scale = scaler.get("scale")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or \
            not math.isfinite(scale) or scale <= 0:
        raise CheckpointError(f"the pipeline state's scaler 'scale' is {scale!r}: it must "
                              f"be a finite number > 0; {fix}")
    dynamic = scaler.get("dynamic", True)
    if not isinstance(dynamic, bool):
        raise CheckpointError(f"the pipeline state's scaler 'dynamic' is {dynamic!r}: it "
                              f"must be True or False; {fix}")
    return out[0], out[1], float(scale), out[2], dynamic


class ModelWatch:
    """What a pipeline took from the wrapped model when it was built: each submodule and
    parameter object where it sat, with the parameter's storage, dtype and whether it
    trained. The workers run copies of the layers taken then and the host keeps these
    very tensors, so a parameter replaced since (``layer.weight = nn.Parameter(...)``,
    ``.data = ...``, ``.set_()``, ``.half()``, a swapped submodule) or unfrozen would
    be silently ignored: :meth:`check` refuses the next call instead (a flat pass over
    the recorded slots, no module traversal), as it does a gradient hook registered
    on a trained parameter since. Freezing a parameter is followed (it
    gets no gradient), and so are values edited in place."""

    def __init__(self, container: torch.nn.Module):
        self.modules = [(parent, name, child, f"{prefix}{'.' if prefix else ''}{name}")
                        for prefix, parent in container.named_modules(remove_duplicate=False)
                        for name, child in parent._modules.items() if child is not None]
        self.params = [(module, name, p, p.data_ptr(), p.dtype, p.requires_grad,
                        f"{prefix}{'.' if prefix else ''}{name}")
                       for prefix, module in container.named_modules(remove_duplicate=False)
                       for name, p in module._parameters.items() if p is not None]

    def check(self) -> None:
        fix = ("the pipeline keeps the tensors it wrapped and runs copies of the layers "
               "taken when it was built, so the change would be ignored. Change values in "
               "place instead (under torch.no_grad(), or pipe.load_state_dict()), or "
               "build a new RoundPipe over the changed model")
        for parent, name, child, where in self.modules:
            if parent._modules.get(name) is not child:
                raise InputError(f"submodule {where} was replaced or removed after the "
                                 f"pipeline was built: {fix}")
        for module, name, p, ptr, dtype, trained, where in self.params:
            q = module._parameters.get(name)
            if q is p and q.data_ptr() == ptr and q.dtype == dtype and \
                    (trained or not q.requires_grad):
                hook = _grad_hook(q)
                if hook is not None:
                    raise InputError(_grad_hook_refusal(where, hook, later=True))
                continue
            if q is None:
                why = "is gone from the model"
            elif q is not p:
                why = "was replaced by another tensor (a new nn.Parameter)"
            elif q.dtype != dtype:
                why = f"was converted from {dtype} to {q.dtype} (.half(), .to())"
            elif q.data_ptr() != ptr:
                why = "got new storage (.data = ..., .set_(), a module conversion)"
            else:
                raise InputError(
                    f"parameter {where} was frozen when the pipeline was built and has "
                    "requires_grad=True now: the pipeline keeps frozen weights without "
                    "a trainable master and never trains them. Set requires_grad "
                    "before wrapping (build a new RoundPipe)")
            raise InputError(f"parameter {where} {why} after the pipeline was built: {fix}")
