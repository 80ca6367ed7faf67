"""Side inputs of a Hugging Face decoder: what the model's own forward hands each block.

Decoder blocks of ``transformers`` 5.x take their attention mask (built by the model's
mask helpers: causal, sliding-window, padding, per layer type), rotary ``cos``/``sin``
(per layer type for Gemma 3) and position ids from the model's forward. Rather than
re-implementing that per family, :class:`SideInputs` runs the model's *own* forward on
the host, once per microbatch, with each decoder block replaced by a stub that records
the arguments it receives, and stops at the last block (so the final norm and anything
after it never run). Embeddings are not computed: a zero-stride placeholder of the right
shape and dtype stands in for them. A stub returns what the real block returns (the
hidden states, or a tuple with the hidden states first: some models' forwards unpack
``outputs[0]``); :meth:`SideInputs.learn_returns` runs the first real block of each
class once, at wrap time, to find out. Dropout in the forward (on the embeddings) is an
identity in the probe, whatever the model's mode: it draws no random numbers in the
caller's thread, and each call is recorded (:class:`DropoutCall`) for the wrap-time
checks, which give it to the embedding layer.

The recorded arguments are de-duplicated by identity (one mask tensor serves every
full-attention layer) into a tuple of tensors plus a per-layer :class:`Layout` that says
which tensor goes to which argument. That pair is the side input the pipeline uploads
once per microbatch per worker; :class:`~rotapipe.adapters.layers.DecoderLayer` ``i``
rebuilds its own arguments from it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..errors import InputError
from .errors import AdapterError
from .moe import RoutingLog

__all__ = ["SideInputs", "Layout", "DropoutCall", "unpack_inputs", "check_shapes",
           "token_ids_refusal", "shallow_clone", "eval_mode"]


def shallow_clone(module: nn.Module, replace: dict[str, nn.Module]) -> nn.Module:
    """A copy of ``module`` sharing every submodule, parameter and attribute, with the
    direct children named in ``replace`` swapped (``module`` itself is untouched)."""
    clone = object.__new__(type(module))
    clone.__dict__.update(module.__dict__)
    clone._modules = {**module._modules, **replace}
    return clone


@contextmanager
def eval_mode(*roots: nn.Module) -> Iterator[None]:
    """Every module under ``roots`` in eval mode (dropout off) inside the block; each
    gets its own training flag back after, also when the block raises. The wrap-time
    checks compare forwards that would otherwise draw different dropout masks."""
    flags: dict[int, tuple[nn.Module, bool]] = {}
    for root in roots:
        for m in root.modules():
            flags.setdefault(id(m), (m, m.training))
    try:
        for m, _ in flags.values():
            m.training = False
        yield
    finally:
        for m, training in flags.values():
            m.training = training


def token_ids(inputs) -> torch.Tensor:
    """The token ids of a microbatch's inputs (what the embedding looks up), checked to
    be integers (the pipeline calls this in the caller's thread, before a call)."""
    ids = unpack_inputs(inputs)[0]
    _check_ids(ids)
    return ids


def _check_ids(ids) -> None:
    if isinstance(ids, torch.Tensor) and (ids.is_floating_point() or ids.is_complex()
                                          or ids.dtype is torch.bool):
        raise InputError(f"input_ids are {ids.dtype}: a wrapped Hugging Face model takes "
                         "integer token ids (the embedding looks them up): pass "
                         "input_ids.long()")


def unpack_inputs(inputs) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(input_ids, attention_mask, position_ids)`` from a tensor of ids or a dict."""
    if isinstance(inputs, torch.Tensor):
        return inputs, None, None
    if isinstance(inputs, dict) and "inputs_embeds" in inputs:
        raise AdapterError("inputs hold inputs_embeds: a wrapped Hugging Face model "
                           "takes token ids, since its layer 0 is the embedding (which "
                           "trains); pass input_ids instead")
    if isinstance(inputs, dict) and "input_ids" in inputs:
        unknown = set(inputs) - {"input_ids", "attention_mask", "position_ids"}
        if unknown:
            raise AdapterError(f"inputs hold {sorted(unknown)}: a wrapped Hugging Face "
                               "model takes input_ids, attention_mask and position_ids "
                               "(pass labels separately)")
        return inputs["input_ids"], inputs.get("attention_mask"), inputs.get("position_ids")
    raise AdapterError(f"inputs are a {type(inputs).__name__}: pass a tensor of token ids "
                       "or a dict with input_ids (and optionally attention_mask, "
                       "position_ids)")


def token_ids_refusal(name: str) -> str:
    """Why a forward that hands its decoder layers the token ids cannot be pipelined."""
    return (f"{name}.forward hands its decoder layers the token ids (input_ids, e.g. "
            "for hash routing of experts): rotapipe computes the layers' side inputs "
            "from the embeddings, so a layer would get input_ids=None and compute "
            "another function; build the layers yourself and pass them to "
            "rotapipe.RoundPipe")


def check_shapes(microbatches: list) -> None:
    """Raise :class:`InputError` unless the inputs of a call hold ``input_ids`` shaped
    ``[batch, seq]`` and an ``attention_mask`` and ``position_ids`` (when given) of the
    same shape (or a 4-D ``[batch, 1, seq, seq]`` mask, which transformers takes as it
    is). The side inputs run in the caller's thread before the call starts; on a worker
    a wrong shape fails deep inside a decoder block. The message gives the shapes of the
    whole batch the microbatches (split along dim 0) came from."""
    parts = [unpack_inputs(x) for x in microbatches]
    for p in parts:
        _check_ids(p[0])
    names = ("input_ids", "attention_mask", "position_ids")
    ids, mask, pos = (_batch_shape(name, [p[i] for p in parts])
                      for i, name in enumerate(names))
    if len(ids) != 2:
        raise InputError(f"input_ids have shape {list(ids)}: a wrapped Hugging Face model "
                         "takes token ids shaped [batch, seq]; for one sequence add the "
                         "batch dimension (input_ids[None], labels[None])")
    b, t = ids
    if mask is not None and mask != ids and not (len(mask) == 4 and mask[0] == b
                                                 and mask[2:] == (t, t)):
        raise InputError(f"attention_mask has shape {list(mask)} but input_ids have "
                         f"{list(ids)}: pass a [batch, seq] mask shaped like input_ids (1 "
                         "where a token is attended to, 0 on padding), or a 4-D "
                         "[batch, 1, seq, seq] one")
    if pos is not None and pos != ids:
        raise InputError(f"position_ids have shape {list(pos)} but input_ids have "
                         f"{list(ids)}: pass [batch, seq] position ids shaped like "
                         "input_ids")


def _batch_shape(name: str, tensors: list) -> tuple[int, ...] | None:
    """Shape of the batch that ``tensors`` (one per microbatch, split along dim 0, or
    all ``None``) came from."""
    if all(t is None for t in tensors):
        return None
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            what = "a 0-dim tensor" if isinstance(t, torch.Tensor) else \
                f"a {type(t).__name__}"
            raise InputError(f"{name} is {what}: pass a tensor shaped [batch, seq]")
    return (sum(t.shape[0] for t in tensors), *tensors[0].shape[1:])


@dataclass(frozen=True)
class _Ref:
    index: int   # position in the side input's tensor tuple


class Layout:
    """Per layer: the tree of ``(args, kwargs)`` the model passed, tensors replaced by
    references into the shared tensor tuple. A plain object: the pipeline passes it to
    workers by reference (only tensors are uploaded)."""

    def __init__(self, calls: list[tuple[tuple, dict]]):
        tensors: list[torch.Tensor] = []
        seen: dict[int, int] = {}
        self.layers = []
        for args, kwargs in calls:
            leaves, spec = tree_flatten((args, kwargs))
            out = []
            for leaf in leaves:
                if isinstance(leaf, torch.Tensor):
                    if id(leaf) not in seen:
                        seen[id(leaf)] = len(tensors)
                        tensors.append(leaf)
                    out.append(_Ref(seen[id(leaf)]))
                else:
                    out.append(leaf)
            self.layers.append((spec, out))
        self.tensors = tuple(tensors)

    def arguments(self, layer: int, tensors) -> tuple[tuple, dict]:
        """``(args, kwargs)`` of decoder layer ``layer`` with the given (uploaded)
        tensors."""
        spec, leaves = self.layers[layer]
        return tree_unflatten([tensors[x.index] if isinstance(x, _Ref) else x
                               for x in leaves], spec)


class _Stop(Exception):
    """Raised by the last stub: the probe has what it needs."""


class DropoutCall(NamedTuple):
    """Dropout that the model's forward applied in a probe run (where it is an
    identity)."""

    fn: Callable
    """The dropout function (``F.dropout``, ``F.alpha_dropout``, ...)."""
    p: float
    input: torch.Tensor
    """What it was applied to (also what it returned)."""
    blocks_before: int
    """How many decoder blocks the forward had called before it."""
    module: nn.Module | None
    """The model's dropout module (a child of the model that owns the blocks) that
    applied it, or ``None`` where the forward calls the function itself."""


_DROPOUTS = (F.dropout, F.alpha_dropout, F.feature_alpha_dropout, F.dropout1d,
             F.dropout2d, F.dropout3d)


class _ProbeDropouts(TorchFunctionMode):
    """Inside a probe run: every dropout function is an identity, and recorded."""

    def __init__(self, state: _ProbeState):
        super().__init__()
        self.state = state

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _DROPOUTS:
            return func(*args, **kwargs)
        x = args[0] if args else kwargs["input"]
        p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
        self.state.record(func, float(p), x, None)
        return x


class _ProbeDropout(nn.Module):
    """A dropout child of the inner model as the probe calls it: an identity that
    records which module it stands for."""

    def __init__(self, dropout: nn.Module, state: _ProbeState):
        super().__init__()
        self.dropout, self.state = dropout, state

    def forward(self, x, *args, **kwargs):
        self.state.record(F.dropout, float(getattr(self.dropout, "p", 0.5)), x,
                          self.dropout)
        return x


class _ProbeState:
    """What the stubs of one probe share: the calls they record, the return structure
    of each block class, and what the last stub does (stop, or return ``final``)."""

    def __init__(self, blocks: list[nn.Module]):
        self.sink: list = []
        self.classes = [type(b) for b in blocks]
        self.returns: dict[type, int | None] = {}
        """Per block class: ``None`` (a tensor) or the length of the tuple it returns."""
        self.learn: dict[int, nn.Module] = {}
        """Real blocks to run once (first of each class) to learn their return type."""
        self.final: torch.Tensor | None = None
        """Set: the last stub returns it (a run of the whole forward); else it stops."""
        self.max_position: int | None = None
        """Set: the largest position id of the whole batch (:meth:`SideInputs.for_batch`)."""
        self.dropouts: list[DropoutCall] = []
        """The dropout the forward applied in the current (or last) run."""

    def record(self, fn, p: float, x, module: nn.Module | None) -> None:
        self.dropouts.append(DropoutCall(fn, p, x, len(self.sink), module))


class _Stub(nn.Module):
    def __init__(self, index: int, state: _ProbeState, last: bool):
        super().__init__()
        self.index, self.state, self.last = index, state, last

    def forward(self, hidden_states, *args, **kwargs):
        st = self.state
        st.sink.append((hidden_states, args, kwargs))
        cls = st.classes[self.index]
        real = st.learn.pop(self.index, None)
        if real is not None:
            out = real(hidden_states, *args, **kwargs)
            st.returns[cls] = len(out) if isinstance(out, (tuple, list)) else None
        if self.last:
            if st.final is None:
                raise _Stop
            hidden_states = st.final
        n = st.returns.get(cls)
        # The hidden states unchanged (the check that blocks are chained relies on it),
        # in the structure the real block returns; its other outputs (attention
        # weights, caches) are off in these runs.
        return hidden_states if n is None else (hidden_states,) + (None,) * (n - 1)


def _batch_rope(module: nn.Module) -> bool:
    """Whether ``module`` is a rotary embedding whose frequencies depend on the largest
    position of the batch it is given (``transformers``' dynamic and long RoPE:
    ``dynamic_rope_update`` takes ``torch.max(position_ids)``)."""
    kind = getattr(module, "rope_type", None)
    kinds = kind.values() if isinstance(kind, dict) else (kind,)
    return any(isinstance(k, str) and ("dynamic" in k or k == "longrope") for k in kinds)


class _WholeBatchRope(nn.Module):
    """The model's rotary module as the probe calls it for one microbatch: the
    largest position of the whole batch rides along as one more row of position ids,
    so a dynamic or long RoPE picks the frequencies the model's forward on the whole
    batch would, and that row's tables are dropped."""

    def __init__(self, rope: nn.Module, state: _ProbeState):
        super().__init__()
        self.rope, self.state = rope, state

    def forward(self, x, position_ids, *args, **kwargs):
        top = self.state.max_position
        if top is None or position_ids is None or int(position_ids.max()) >= top:
            return self.rope(x, position_ids, *args, **kwargs)
        n = position_ids.shape[0]
        row = torch.full_like(position_ids[:1], top)
        out = self.rope(x, torch.cat([position_ids, row]), *args, **kwargs)
        return tuple(t[:n] for t in out)


class SideInputs:
    """``side_inputs`` for :class:`rotapipe.RoundPipe`: ``fn(microbatch inputs) -> dict``.

    Keys: ``hf_tensors`` (tuple of tensors), ``hf_layout`` (:class:`Layout`), and for
    MoE models ``hf_routing`` (a fresh :class:`RoutingLog`) and ``hf_moe_mask`` (the
    flattened attention mask, or ``None``).
    """

    def __init__(self, inner: nn.Module, layers_name: str, blocks: list[nn.Module],
                 hidden_size: int, dtype: torch.dtype, moe: bool, aux_loss: bool = False):
        num_layers = len(blocks)
        self.num_layers, self.hidden_size, self.dtype, self.moe = \
            num_layers, hidden_size, dtype, moe
        self.aux_loss = aux_loss
        """Whether the layers add the MoE load-balancing loss (it needs a 2-D mask)."""
        self._state = _ProbeState(blocks)
        self._blocks = blocks
        self.layers_name = layers_name
        self.stubs = nn.ModuleList(_Stub(i, self._state, i == num_layers - 1)
                                   for i in range(num_layers))
        # A shallow clone of the inner model sharing every submodule but the decoder
        # list: the user's model is never modified.
        ropes = {name: _WholeBatchRope(m, self._state)
                 for name, m in inner.named_children() if _batch_rope(m)}
        drops = {name: _ProbeDropout(m, self._state) for name, m in inner.named_children()
                 if isinstance(m, nn.modules.dropout._DropoutNd)}
        self.probe = shallow_clone(inner, {layers_name: self.stubs, **ropes, **drops})
        self._name = type(inner).__name__

    def learn_returns(self) -> None:
        """Run the first real block of each class once on a two-token batch (its
        parameters' dtype) so the stubs return what it returns (wrap time)."""
        first: dict[type, int] = {}
        for i, cls in enumerate(self._state.classes):
            first.setdefault(cls, i)
        self._state.learn = {i: self._blocks[i] for i in first.values()}
        param = next(self._blocks[0].parameters(), None)
        dtype = param.dtype if param is not None and param.is_floating_point() else self.dtype
        try:
            with eval_mode(self.probe, *self._blocks):
                self.run(torch.ones(1, 2, self.hidden_size, dtype=dtype),
                         torch.ones(1, 2, dtype=torch.long), None)
        except AdapterError:
            raise
        except Exception as exc:
            if isinstance(exc, AttributeError) and "'_Stub'" in str(exc):
                raise AdapterError(
                    f"{self._name}.forward reads {str(exc).split('attribute ')[-1]} of "
                    "its decoder layer objects (it decides per layer what to pass), which "
                    "rotapipe's probe of the forward cannot provide: build the layers "
                    "yourself and pass them to rotapipe.RoundPipe") from exc
            if not self._state.sink:
                # No block was reached: the forward itself failed on inputs_embeds.
                raise AdapterError(self._before_blocks(exc)) from exc
            if "input_ids" in self._state.sink[-1][2]:
                raise AdapterError(token_ids_refusal(self._name)) from exc
            raise AdapterError(
                f"{self._name}.forward: a decoder layer failed on the arguments the "
                f"model gives it ({type(exc).__name__}: {exc}); rotapipe cannot run it "
                "as a layer: build the layers yourself and pass them to "
                "rotapipe.RoundPipe") from exc
        finally:
            self._state.learn = {}

    def _before_blocks(self, exc: Exception) -> str:
        """Why a forward that fails before its first block, given ``inputs_embeds``,
        cannot be pipelined (Gemma 4 with per-layer inputs derives an input for every
        layer from the token ids, in modules outside the blocks)."""
        held = [n for n, m in self.probe.named_children()
                if n != self.layers_name and next(m.parameters(), None) is not None]
        return (f"{self._name}.forward failed before its first decoder layer when given "
                f"the embeddings instead of token ids ({type(exc).__name__}: {exc}). "
                "rotapipe looks the tokens up in its layer 0 and runs the model's forward "
                "from inputs_embeds only to compute the side inputs, so a model whose "
                "forward needs the token ids outside its decoder blocks (for example "
                "per-layer input embeddings; this one holds, besides the blocks: "
                f"{', '.join(held) or 'nothing with parameters'}) cannot be pipelined: "
                "build the layers yourself and pass them to rotapipe.RoundPipe")

    def run_whole(self, model: nn.Module, hidden: torch.Tensor, final: torch.Tensor,
                  attention_mask, **kwargs):
        """Run ``model`` (a clone whose inner model is :attr:`probe`) to its output, the
        last stub returning ``final``; ``(output, calls)``."""
        self._state.sink.clear()
        self._state.dropouts.clear()
        self._state.final = final
        try:
            with torch.no_grad(), _ProbeDropouts(self._state):
                out = model(inputs_embeds=hidden, attention_mask=attention_mask,
                            use_cache=False, **kwargs)
        finally:
            self._state.final = None
        calls, self._state.sink[:] = list(self._state.sink), []
        return out, calls

    def run(self, hidden: torch.Tensor, attention_mask, position_ids) -> list:
        """Run the model's forward with stub blocks; ``[(hidden, args, kwargs)]``."""
        self._state.sink.clear()
        self._state.dropouts.clear()
        try:
            with torch.no_grad(), _ProbeDropouts(self._state):
                self.probe(inputs_embeds=hidden, attention_mask=attention_mask,
                           position_ids=position_ids, use_cache=False)
        except _Stop:
            pass
        calls, self._state.sink[:] = list(self._state.sink), []
        if len(calls) != self.num_layers:
            raise AdapterError(f"{self._name}.forward called {len(calls)} of its "
                               f"{self.num_layers} decoder layers: rotapipe cannot derive "
                               "their inputs; pass layers explicitly to RoundPipe")
        return calls

    @property
    def dropouts(self) -> list[DropoutCall]:
        """The dropout the model's forward applied in the last probe run (an identity
        there)."""
        return list(self._state.dropouts)

    def for_batch(self, microbatches: list):
        """The side-input function for the microbatches of one call (the runtime asks
        for it once per call): each microbatch's rotary tables are those of the whole
        batch, whose largest explicit position id a dynamic or long RoPE scales by.
        Checks the inputs' shapes first (:func:`check_shapes`)."""
        self._check(microbatches)
        pos = [unpack_inputs(x)[2] for x in microbatches]
        top = max((int(p.max()) for p in pos if p is not None and p.numel()), default=None)
        return lambda inputs: self._side(inputs, top)

    def __call__(self, inputs) -> dict:
        self._check([inputs])
        return self._side(inputs, None)

    def _check(self, microbatches: list) -> None:
        """:func:`check_shapes`; with the load-balancing loss on, a 2-D mask: the loss
        counts each token by its padding mask (Hugging Face's fails on a 4-D one too)."""
        check_shapes(microbatches)
        masks = [unpack_inputs(x)[1] for x in microbatches]
        if self.aux_loss and any(m is not None and m.dim() != 2 for m in masks):
            shape = list(_batch_shape("attention_mask", masks))
            raise InputError(
                f"attention_mask has shape {shape} and the MoE "
                "load-balancing loss is on: it counts each token by a [batch, seq] "
                "padding mask (1 where a token is attended to, 0 on padding), which a "
                "4-D mask does not give. Pass a [batch, seq] attention_mask, or "
                "wrap_hf(model, moe_aux_loss=False) to train without that loss")

    def _side(self, inputs, max_position: int | None) -> dict:
        """The side inputs of checked ``inputs``; ``max_position``: the whole batch's
        largest position id (:meth:`for_batch`)."""
        ids, mask, pos = unpack_inputs(inputs)
        b, t = ids.shape[:2]
        placeholder = torch.zeros((), dtype=self.dtype).expand(b, t, self.hidden_size)
        self._state.max_position = max_position
        try:
            calls = self.run(placeholder, mask, pos)
        finally:
            self._state.max_position = None
        layout = Layout([(args, kwargs) for _, args, kwargs in calls])
        side = {"hf_tensors": layout.tensors, "hf_layout": layout}
        if self.moe:
            side["hf_routing"] = RoutingLog()
            side["hf_moe_mask"] = None if mask is None else mask.reshape(-1)
        return side
