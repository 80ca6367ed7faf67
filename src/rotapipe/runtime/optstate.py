"""Optimizer state between steps: fp32, bf16 or 8-bit (``PipeConfig.optimizer_state_dtype``).

The host optimizer steps the user's ``torch.optim`` optimizer on fp32 masters; its
per-parameter state (Adam's ``exp_avg`` / ``exp_avg_sq``, SGD's ``momentum_buffer``)
is as large as the masters, twice over for Adam: 8 of the 16 host bytes per trained
parameter. :class:`StatePrecision` keeps it smaller between steps:

- ``fp32``: nothing changes (exact).
- ``bf16``: each state tensor of a parameter's shape is kept in bfloat16. Around a
  step it is widened to fp32 (exactly), the optimizer's own kernel steps in fp32, and
  the result is rounded back to the nearest bf16. The fp32 copies exist only for the
  parameters being stepped: a whole step goes in groups of at most
  :data:`GROUP_ELEMENTS` elements (stepping a subset of the parameters is exact for
  per-parameter optimizers: docs/optimizer.md), widened into fp32 room kept between
  steps (fresh allocations every step cost more than the copies), so the extra memory
  is one group's fp32 state, not the model's. An approximation: the moments lose
  their low 16 mantissa bits after every step.
- ``int8``: the optimizer itself keeps 8-bit blockwise state (a bitsandbytes 8-bit
  optimizer, e.g. ``bitsandbytes.optim.AdamW8bit``, whose CPU kernel runs here);
  this class only checks that it is one.

A step is taken through :meth:`StatePrecision.step` everywhere the host optimizer
steps (``sync``, ``overlap``'s per-stage steps and its redo, ``stale``); undo
snapshots copy the state as it is kept (bf16: half the bytes).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import StateDtype
from ..errors import ConfigError
from .host import own_step

GROUP_ELEMENTS = 1 << 22
"""bf16 state: a whole step widens at most this many parameter elements' state to
fp32 at once (one parameter larger than it is a group of its own)."""

_BF16_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
"""Optimizers whose state is per parameter, element by element, and whose step reads
and writes it only in fp32 arithmetic: rounding it between steps is well defined."""


def is_8bit(optimizer) -> bool:
    """Whether ``optimizer`` is a bitsandbytes optimizer keeping 8-bit state."""
    args = getattr(optimizer, "args", None)
    return type(optimizer).__module__.startswith("bitsandbytes.") \
        and getattr(args, "optim_bits", 32) == 8


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in ``optimizer.state`` (its moments, step counters and,
    for an 8-bit optimizer, the block scales and code books)."""
    return sum(v.numel() * v.element_size() for st in optimizer.state.values()
               for v in st.values() if isinstance(v, torch.Tensor))


class StatePrecision:
    """Keeps an optimizer's state in ``dtype`` between steps (module docstring)."""

    def __init__(self, dtype: StateDtype | str = StateDtype.FP32):
        self.dtype = StateDtype(dtype)
        self._scratch = torch.empty(0)
        """fp32 room the state of one group is widened into, kept between steps (at
        most twice :data:`GROUP_ELEMENTS` elements): fresh allocations each step would
        cost more than the copies (page faults)."""
        self._kept: list[tuple[dict, str, torch.Tensor]] = []

    def check(self, optimizer) -> None:
        """Raise :class:`ConfigError` when the setting cannot apply to ``optimizer``."""
        name = f"{type(optimizer).__module__}.{type(optimizer).__name__}"
        setting = f"PipeConfig(optimizer_state_dtype={self.dtype.value!r})"
        if self.dtype is StateDtype.INT8:
            if not is_8bit(optimizer):
                raise ConfigError(
                    f"{setting} needs an optimizer that keeps 8-bit state, got {name}: "
                    "build bitsandbytes.optim.AdamW8bit(pipe.parameters(), ...) (pip "
                    "install 'rotapipe[qlora]'), or use optimizer_state_dtype='bf16' "
                    "with torch.optim.AdamW")
            return
        if is_8bit(optimizer):
            raise ConfigError(
                f"{name} keeps 8-bit optimizer state, but {setting} says otherwise: set "
                "optimizer_state_dtype='int8' (recorded in checkpoints), or use "
                "torch.optim.AdamW")
        if self.dtype is StateDtype.BF16 and not isinstance(optimizer, _BF16_OPTIMIZERS):
            raise ConfigError(
                f"{setting} applies to torch.optim Adam, AdamW and SGD (per-parameter "
                f"state, stepped in fp32), got {name}: use optimizer_state_dtype='fp32' "
                "with this optimizer")
        if self.dtype is StateDtype.BF16:
            for group in optimizer.param_groups:
                if group.get("capturable") or group.get("differentiable"):
                    raise ConfigError(f"{setting} does not support capturable or "
                                      "differentiable optimizers: turn those options off")

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Check ``optimizer``; bring the state it already has (loaded from a checkpoint,
        or kept by a pipeline it drove before) to this precision: bf16 narrows it, and
        again after every ``load_state_dict`` (which casts state to the parameters'
        dtype) while this is the optimizer's latest precision; fp32 widens moments an
        earlier bf16 pipeline narrowed (exactly: its step would fail on them)."""
        self.check(optimizer)
        optimizer._rotapipe_precision = self        # what the load hook follows
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if self.dtype is StateDtype.FP32:
            for p in params:
                st, keys = self._moments(optimizer, p)
                for k in keys:
                    if st[k].dtype == torch.bfloat16:
                        st[k] = st[k].to(torch.float32)
        if self.dtype is not StateDtype.BF16:
            return
        self._narrow(optimizer, params)
        if not getattr(optimizer, "_rotapipe_bf16_hook", False):
            optimizer.register_load_state_dict_post_hook(_narrow_loaded)
            optimizer._rotapipe_bf16_hook = True

    def step(self, optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> None:
        """``optimizer.step()`` over ``params`` (those of them with a ``.grad``; the
        caller leaves every other parameter's ``.grad`` unset), keeping the state in
        this precision between steps. Marked as the pipeline's own step
        (:func:`~rotapipe.runtime.host.own_step`): the caller writes the compute copies
        back."""
        with own_step():
            self._step_all(optimizer, params)

    def _step_all(self, optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> None:
        if self.dtype is not StateDtype.BF16:
            optimizer.step()
            return
        params = [p for p in params if p.grad is not None]
        groups = _groups(params)
        if len(groups) <= 1:
            self._step(optimizer, params)
            return
        # One group at a time: only its parameters hold a .grad, so torch.optim steps
        # only them (and widens only their state).
        grads = [p.grad for p in params]
        try:
            for p in params:
                p.grad = None
            for group in groups:
                for i, p in group:
                    p.grad = grads[i]
                self._step(optimizer, [p for _, p in group])
                for _, p in group:
                    p.grad = None
        finally:
            for p, g in zip(params, grads):
                p.grad = g

    def _step(self, optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> None:
        self._widen(optimizer, params)
        try:
            optimizer.step()
        finally:
            self._narrow(optimizer, params)

    @staticmethod
    def _moments(optimizer, p: nn.Parameter):
        """The keys of ``p``'s state tensors shaped like ``p`` (not the step count)."""
        st = optimizer.state.get(p)
        if not st:
            return st, []
        return st, [k for k, v in st.items() if k != "step" and isinstance(v, torch.Tensor)
                    and v.is_floating_point() and v.shape == p.shape]

    def _widen(self, optimizer, params) -> None:
        todo = []
        for p in params:
            st, keys = self._moments(optimizer, p)
            todo += [(st, k) for k in keys if st[k].dtype == torch.bfloat16]
        need = sum(st[k].numel() for st, k in todo)
        room = need <= 2 * GROUP_ELEMENTS
        if room and self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.float32)
        off = 0
        for st, k in todo:
            narrow = st[k]
            if room:          # exact: bf16 -> fp32, into the kept room
                wide = self._scratch[off:off + narrow.numel()].view(narrow.shape)
                wide.copy_(narrow)
                off += narrow.numel()
                self._kept.append((st, k, narrow))
            else:
                wide = narrow.to(torch.float32)
            st[k] = wide

    def _narrow(self, optimizer, params) -> None:
        # Back into the bf16 tensors the state had (round to nearest even, as .to()).
        for st, k, narrow in self._kept:
            narrow.copy_(st[k])
            st[k] = narrow
        self._kept.clear()
        for p in params:      # new state (the first step) or state too large for room
            st, keys = self._moments(optimizer, p)
            for k in keys:
                if st[k].dtype != torch.bfloat16:
                    st[k] = st[k].to(torch.bfloat16)


def _narrow_loaded(optimizer: torch.optim.Optimizer) -> None:
    """``load_state_dict`` post-hook: narrow the loaded state when the optimizer's
    latest precision (:meth:`StatePrecision.attach`) is bf16."""
    owner = getattr(optimizer, "_rotapipe_precision", None)
    if owner is not None and owner.dtype is StateDtype.BF16:
        owner._narrow(optimizer, [p for g in optimizer.param_groups for p in g["params"]])


def _groups(params: list[nn.Parameter]) -> list[list[tuple[int, nn.Parameter]]]:
    """Consecutive runs of ``params`` (with their indices) of at most
    :data:`GROUP_ELEMENTS` elements each (a larger parameter alone)."""
    groups, cur, n = [], [], 0
    for i, p in enumerate(params):
        if cur and n + p.numel() > GROUP_ELEMENTS:
            groups.append(cur)
            cur, n = [], 0
        cur.append((i, p))
        n += p.numel()
    if cur:
        groups.append(cur)
    return groups


def bnb_optimizer(algorithm: str, params, *, lr: float, betas: tuple[float, float],
                  weight_decay: float):
    """bitsandbytes' 8-bit optimizer for ``algorithm`` (``"adamw"``: ``AdamW8bit``;
    ``"sgd"``: ``SGD8bit`` with momentum ``betas[0]``), what ``rotapipe train
    --optimizer-state int8`` steps with. Its state is blockwise 8-bit (blocks of 256
    elements with an fp32 scale each; parameters under 4,096 elements keep fp32 state,
    bitsandbytes' ``min_8bit_size``)."""
    try:
        import bitsandbytes as bnb
    except ImportError as e:
        raise ConfigError("optimizer_state_dtype='int8' uses bitsandbytes' 8-bit "
                          "optimizers: pip install 'rotapipe[qlora]' (bitsandbytes), or "
                          "use optimizer_state_dtype='bf16'") from e
    if algorithm == "sgd":
        return bnb.optim.SGD8bit(params, lr=lr, momentum=betas[0],
                                 weight_decay=weight_decay)
    return bnb.optim.AdamW8bit(params, lr=lr, betas=betas, weight_decay=weight_decay)
