"""Mixture-of-experts: routers found from the model's own metadata, routing recorded in
forward and replayed in recompute, and the load-balancing loss carried through the
pipeline.

**Routers.** Hugging Face MoE models declare the module whose output is the router
logits in ``_can_record_outputs["router_logits"]`` (a class, or an ``OutputRecorder``
with the output index); every submodule of a decoder block of that class is a router.

**Replay.** A router picks experts with ``torch.topk``. The first run of a layer for a
microbatch (the forward stage, or the fused tail) records the indices every ``topk``
inside the router returns, in a :class:`RoutingLog` that belongs to that microbatch's
side inputs; later runs (recompute at stage or layer grain) return the recorded indices
and gather the matching values, so the experts a recompute uses are the forward's, even
if a recomputed logit differed in the last bit. On CUDA the indices are copied to pinned
host memory behind an event in forward; recompute only waits on that (long completed)
event and uploads them: no device-to-host synchronisation in recompute.

**Load-balancing loss** (``load_balancing_loss_func`` of Mixtral, Qwen2/3-MoE, OLMoE:
Switch Transformer eqs. 4-6). Hugging Face concatenates the router logits of all layers:

    aux = E * sum_e (T_e / R) * (P_e / R)

with ``T_e`` the (mask-weighted) top-k assignments to expert e summed over all layers,
``P_e`` the routing probabilities summed likewise, ``R`` the counted rows over all layers.
That is not a sum of per-layer terms, but the sums are: each MoE layer adds its ``T``,
``P`` and ``R`` to three accumulators that travel with the hidden states through the
pipeline (``P`` keeps its autograd graph, ``T`` and ``R`` are counts), and the loss
function evaluates the formula in the tail. Gradients flow back through ``P`` by the
pipeline's ordinary activation gradients. With several microbatches the pipeline's
``tail_context`` (``CausalLMLoss.batch_context``) sums T and R over every microbatch
before the fused tail runs, and each microbatch adds ``E * sum_e (T_e / R) * (P_e / R)``
with its own P, unweighted: the sum is Hugging Face's whole-batch loss, exactly.

**Which loss** (:func:`moe_spec`): on when the config asks for router logits (or
``wrap_hf(moe_aux_loss=True)``), and only for a model whose ``load_balancing_loss_func``
computes that formula (:func:`check_aux_formula`); otherwise refused at wrap time.
"""

from __future__ import annotations

import logging
import sys
import threading
from dataclasses import dataclass

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .errors import AdapterError

__all__ = ["MoESpec", "RoutingLog", "RouterTap", "router_class", "find_routers",
           "aux_zero", "aux_add", "aux_loss", "warn_eager_experts", "moe_spec",
           "check_aux_formula"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MoESpec:
    """What the load-balancing loss needs (no spec: the loss is off)."""

    num_experts: int
    top_k: int
    coef: float
    """``router_aux_loss_coef``: the loss is ``cross_entropy + coef * aux``."""


def router_class(model: nn.Module) -> tuple[type, int] | None:
    """``(router module class, index of the logits in its output)`` from the
    ``_can_record_outputs`` metadata of the model or, where the causal LM does not
    declare it, of the first submodule that does and whose router class the model
    holds (Llama 4 and GLM-4.5V declare it on their inner text model only); ``None``
    for a dense model."""
    classes = {type(m) for m in model.modules()}
    for m in model.modules():
        spec = (getattr(m, "_can_record_outputs", None) or {}).get("router_logits")
        if spec is None:
            continue
        cls = spec if isinstance(spec, type) else getattr(spec, "target_class", None)
        if cls is not None and any(issubclass(c, cls) for c in classes):
            return cls, 0 if isinstance(spec, type) else int(getattr(spec, "index", 0) or 0)
    return None


def find_routers(block: nn.Module,
                 router: tuple[type, int] | None) -> tuple[tuple[str, int], ...]:
    """``(path inside block, logits index)`` of every router submodule of ``block``."""
    if router is None:
        return ()
    cls, index = router
    return tuple((name, index) for name, m in block.named_modules()
                 if name and isinstance(m, cls))


def warn_eager_experts(model: nn.Module) -> bool:
    """Warn when the model's experts run one at a time (``transformers``' "eager"
    experts: a ``nonzero`` and several ``.item()`` per expert, each a host sync on CUDA,
    in every forward and recompute). Returns whether it warned."""
    impl = getattr(getattr(model, "config", None), "_experts_implementation", None)
    if impl != "eager":
        return False
    # A family whose experts do not dispatch on the setting (Llama 4's run as batched
    # matmuls) reads "eager" too, and set_experts_implementation refuses it.
    can_set = getattr(type(model), "_can_set_experts_implementation", None)
    if can_set is not None and not can_set():
        return False
    logger.warning("%s runs its MoE experts with the 'eager' implementation: a loop over "
                   "experts with host syncs per expert in every forward and recompute "
                   "(tests/test_gpt_oss.py counts them); call "
                   "model.set_experts_implementation('grouped_mm') before wrapping",
                   type(model).__name__)
    return True


class RoutingLog:
    """The expert choices of one microbatch of one call, keyed by (layer, router, n-th
    topk). Lives in the side inputs; shared (by reference) by every worker."""

    def __init__(self):
        self._saved: dict[tuple, tuple[torch.Tensor, object]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._saved)

    def record(self, key: tuple, indices: torch.Tensor) -> None:
        if indices.device.type == "cuda":
            host = torch.empty(indices.shape, dtype=indices.dtype, pin_memory=True)
            host.copy_(indices, non_blocking=True)
            event = torch.cuda.Event()
            event.record()   # on the current (the worker's compute) stream
            entry = (host, event)
        else:
            entry = (indices, None)
        with self._lock:
            self._saved.setdefault(key, entry)

    def replay(self, key: tuple, device: torch.device) -> torch.Tensor | None:
        with self._lock:
            entry = self._saved.get(key)
        if entry is None:
            return None
        t, event = entry
        if event is not None:
            event.synchronize()   # the forward's copy, finished long before
            return t.to(device, non_blocking=True)
        return t if t.device == device else t.to(device)


class _TopkTape(TorchFunctionMode):
    """Inside one router call: record ``topk`` indices, or replay recorded ones."""

    def __init__(self, log: RoutingLog, key: tuple):
        super().__init__()
        self.log, self.key, self.n = log, key, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.topk and func is not torch.Tensor.topk:
            return func(*args, **kwargs)
        key = (*self.key, self.n)
        self.n += 1
        x = args[0]
        saved = self.log.replay(key, x.device)
        if saved is None:
            out = func(*args, **kwargs)
            self.log.record(key, out[1])
            return out
        dim = kwargs.get("dim", args[2] if len(args) > 2 else -1)
        return torch.return_types.topk((x.gather(dim, saved), saved))


class RouterTap:
    """Context manager around one decoder block call: routes every router's ``topk``
    through the routing log and keeps each router's logits (for the auxiliary loss).

    It overrides ``forward`` on the router *instance* of a worker's shell (one thread
    uses a shell at a time), and restores it on exit.
    """

    def __init__(self, block: nn.Module, routers, log: RoutingLog | None, layer: int):
        self.block, self.routers, self.log, self.layer = block, routers, log, layer
        self.logits: list[torch.Tensor] = []

    def __enter__(self):
        self._patched = []
        for path, index in self.routers:
            m = self.block.get_submodule(path)
            m.forward = self._wrap(m, path, index)
            self._patched.append(m)
        return self

    def __exit__(self, *exc):
        for m in self._patched:
            del m.forward

    def _wrap(self, module: nn.Module, path: str, index: int):
        forward = type(module).forward

        def routed(*args, **kwargs):
            if self.log is None:
                out = forward(module, *args, **kwargs)
            else:
                with _TopkTape(self.log, (self.layer, path)):
                    out = forward(module, *args, **kwargs)
            self.logits.append(out[index] if isinstance(out, (tuple, list)) else out)
            return out
        return routed


# -- load-balancing loss accumulators --------------------------------------------------
# (tokens [E], probs [E], rows [1]) in fp32: the three sums of load_balancing_loss_func.

def aux_zero(num_experts: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    z = torch.zeros(num_experts, dtype=torch.float32, device=device)
    return z, z.clone(), torch.zeros(1, dtype=torch.float32, device=device)


def aux_add(acc, logits: torch.Tensor, mask: torch.Tensor | None, spec: MoESpec):
    """Add one router's sums for one microbatch (``logits`` [rows, E], ``mask`` the
    flattened attention mask [rows] or ``None``), exactly as Hugging Face does."""
    tokens, probs, rows = acc
    weights = torch.softmax(logits, dim=-1)
    with torch.no_grad():
        _, selected = torch.topk(weights, spec.top_k, dim=-1)
        if mask is None:
            counts = torch.histc(selected.reshape(-1).to(torch.float32),
                                 bins=spec.num_experts, min=0, max=spec.num_experts)
            n = torch.full((1,), float(weights.shape[0]), device=weights.device)
        else:
            m = mask.to(device=weights.device, dtype=torch.float32)
            counts = torch.zeros(spec.num_experts, dtype=torch.float32,
                                 device=weights.device).scatter_add_(
                0, selected.reshape(-1), m.repeat_interleave(spec.top_k))
            n = m.sum().reshape(1)
    if mask is None:
        p = weights.float().sum(dim=0)
    else:
        p = (weights.float() * m.unsqueeze(-1)).sum(dim=0)
    return tokens + counts, probs + p, rows + n


def aux_loss(acc, spec: MoESpec) -> torch.Tensor:
    """``load_balancing_loss_func`` from the accumulated sums."""
    tokens, probs, rows = acc
    tokens_per_expert = tokens / rows
    prob_per_expert = probs / rows
    return torch.sum(tokens_per_expert * prob_per_expert.unsqueeze(0)) * spec.num_experts


# -- which load-balancing loss ------------------------------------------------------
def moe_spec(base: nn.Module, config, enabled: bool | None,
             routed: bool) -> MoESpec | None:
    """The load-balancing loss a wrapped model trains with (``None``: none).
    ``enabled``: ``wrap_hf``'s ``moe_aux_loss`` (``None``: as the model's forward does);
    ``routed``: whether routers were found in its blocks. The model's
    ``load_balancing_loss_func`` must be the formula the pipeline carries
    (:func:`check_aux_formula`)."""
    if enabled and not routed:
        raise AdapterError(f"moe_aux_loss=True, but no MoE router was found in "
                           f"{type(base).__name__}'s decoder blocks (routers are found from "
                           "the model's _can_record_outputs['router_logits']): a model "
                           "without routers has no load-balancing loss; drop moe_aux_loss")
    if not routed:
        return None
    if enabled is None:
        # As the model's forward: the loss when the config asks for router logits and
        # the family has a load-balancing loss (DeepSeek-V3 balances without one).
        enabled = bool(getattr(config, "output_router_logits", False)) and \
            _aux_function(base) is not None
    if not enabled:
        return None

    def pick(*names):
        # The model's own attribute first: it is what its forward reads (JetMoE keeps
        # ``aux_loss_coef``, DBRX copies its ffn_config's weight), and a config may
        # carry the other family's name too.
        for obj in (base, config):
            for name in names:
                v = getattr(obj, name, None)
                if v is not None:
                    return v
        raise AdapterError(f"MoE auxiliary loss: none of {names} found on the model or "
                           "its config; pass moe_aux_loss=False to train without it")

    spec = MoESpec(int(pick("num_experts", "num_local_experts")),
                   int(pick("num_experts_per_tok", "top_k")),
                   float(pick("router_aux_loss_coef", "aux_loss_coef")))
    check_aux_formula(base, spec)
    return spec


def check_aux_formula(base: nn.Module, spec: MoESpec) -> None:
    """The model's ``load_balancing_loss_func`` must be the Switch formula we carry
    through the pipeline; checked on random logits with a padding mask."""
    fn = _aux_function(base)
    if fn is None:
        raise AdapterError(f"{type(base).__name__} enables a router auxiliary loss but its "
                           "module has no load_balancing_loss_func: pass moe_aux_loss=False")
    g = torch.Generator().manual_seed(0)
    layers = [torch.randn(6, spec.num_experts, generator=g) for _ in range(3)]
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    acc = aux_zero(spec.num_experts, torch.device("cpu"))
    for logits in layers:
        acc = aux_add(acc, logits, mask.reshape(-1), spec)
    refuse = (f"{type(base).__name__}'s load_balancing_loss_func is not the "
              "Switch-Transformer formula rotapipe carries through the pipeline")
    fix = "pass wrap_hf(model, moe_aux_loss=False) to train without that loss"
    try:        # Doge's takes other arguments (num_keys) and fails on these
        want = torch.as_tensor(fn(tuple(layers), spec.num_experts, spec.top_k, mask))
    except Exception as exc:    # noqa: BLE001 - any failure says it is another formula
        raise AdapterError(f"{refuse} (called as fn(router_logits, num_experts, top_k, "
                           f"attention_mask) it failed: {type(exc).__name__}: {exc}): "
                           f"{fix}") from exc
    if want.shape != () or not torch.allclose(aux_loss(acc, spec), want, rtol=1e-5,
                                              atol=1e-7):
        raise AdapterError(f"{refuse}: {fix}")


def _aux_function(base):
    return getattr(sys.modules.get(type(base).__module__), "load_balancing_loss_func", None)
