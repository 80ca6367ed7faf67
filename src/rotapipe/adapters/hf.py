"""Hugging Face causal LMs (and PEFT models around them) as rotapipe layers.

    wrapped = rotapipe.adapters.wrap_hf(model)          # discovers the pieces
    pipe = wrapped.pipe(rotapipe.PipeConfig(microbatches=4))
    loss = pipe.forward_backward({"input_ids": ids, "attention_mask": mask}, labels)

Layout (``len(wrapped.layers) == num_hidden_layers + 2``): layer 0 embeds the tokens,
layers 1..N are the decoder blocks, the last layer is the final norm + LM head whose
loss runs chunked (:mod:`.loss`). Masks, rotary tables and position ids are side inputs
(:mod:`.side`), computed once per microbatch on the host by the model's own forward.

Pieces are found from structure and the model's own forward, not class names: the
input embeddings (``get_input_embeddings()``), the module that owns them and the
``nn.ModuleList`` of ``config.num_hidden_layers`` blocks next to them, the final norm
(the child of that module the forward applies to the last block's output, found by
running it with stub blocks), the output embeddings (``get_output_embeddings()``), and
MoE routers from ``_can_record_outputs``. Per-family values the forward applies
outside the blocks come from :mod:`.families`. Before returning, :mod:`.checks`
compares the adapter's layers with the model's own forward (always the tail; with
``verify="full"`` the whole model), so a family the adapter would train wrong is
refused instead.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable

import torch
from torch import nn

from ..config import PipeConfig
from ..errors import ConfigError, PipelineClosedError
from ..model.quant import QUANTIZE, check_frozen, quantize_frozen, quantized
from ..model.work import set_work
from ..plan.costs import model_work
from .errors import AdapterError
from .checks import (check_chain, check_embedding_width, check_model, check_peft,
                     check_tail, find_tail, verify_full)
from .families import embedding_multiplier, logit_transforms
from .layers import DecoderLayer, EmbedLayer, HeadLayer
from .loss import CausalLMLoss, TokenCount, head_vocab
from .moe import find_routers, moe_spec, router_class, warn_eager_experts
from .side import SideInputs, token_ids

__all__ = ["AdapterError", "HFModel", "wrap_hf", "hf_pipe", "load_hf", "PLANNER_SEQ"]

PLANNER_SEQ = 2048
"""Sequence length the runtime's planner prices attention at (capped by the config's
``max_position_embeddings``): the real length is unknown before the first call, and
only the ratios between layers matter to the plan."""


class HFModel:
    """A wrapped Hugging Face model: the rotapipe ``layers``, ``loss_fn``,
    ``side_inputs`` and ``loss_weight``, and the original model's ``config``,
    ``generation_config`` and ``save_pretrained``.

    The layers hold the model's own modules: training updates the model's parameters in
    place (trainable ones become fp32 masters), so ``save_pretrained`` writes the
    trained weights (a PEFT model writes its adapter).
    """

    def __init__(self, model: nn.Module, base: nn.Module, layers: list[nn.Module],
                 loss_fn: CausalLMLoss, side_inputs: SideInputs, parts: dict[str, str]):
        self.model, self.base = model, base
        self.layers = layers
        self.loss_fn = loss_fn
        self.side_inputs = side_inputs
        self.loss_weight = TokenCount(loss_fn.ignore_index, head_vocab(layers[-1].lm_head))
        self.parts = parts
        """Where each piece was found, e.g. ``{"layers": "model.layers", ...}``."""
        self._pipes: list[weakref.ref] = []      # what :meth:`pipe` built, to flush

    @property
    def config(self):
        return self.base.config

    @property
    def generation_config(self):
        return getattr(self.base, "generation_config", None)

    @property
    def compute_dtype(self) -> torch.dtype:
        """dtype the side inputs (masks, rotary tables) are built in: the pipeline's
        compute dtype (:meth:`pipe` sets it from the config)."""
        return self.side_inputs.dtype

    @compute_dtype.setter
    def compute_dtype(self, dtype: torch.dtype) -> None:
        self.side_inputs.dtype = dtype

    def save_pretrained(self, save_directory, **kwargs):
        """The wrapped model's ``save_pretrained`` (safetensors; a PEFT model saves its
        adapter in PEFT format), once the calls in flight of the open pipelines
        :meth:`pipe` built are complete (``flush``: in ``overlap`` or ``stale`` a step
        may still be running, or pending, when ``train_step`` returns)."""
        nf4 = [] if self.model is not self.base else \
            [n for n, p in self.model.named_parameters() if quantized(p) is not None]
        if nf4:     # a PEFT model saves its adapters only
            raise AdapterError(
                f"save_pretrained would write the {len(nf4)} weights kept as NF4 "
                f"(quantize='nf4'; {nf4[0]}, ...) as NaN: close the pipeline and call "
                "rotapipe.model.quant.dequantize_frozen(wrapped.layers) first, to save "
                "the dequantized weights the model trained with")
        for ref in self._pipes:
            pipe = ref()
            if pipe is not None:
                try:
                    pipe.flush()      # raises a failure of a call in flight
                except PipelineClosedError:
                    continue          # closing flushed it
                low = [n for n, p in self.model.named_parameters()
                       if p.requires_grad and p.dtype != torch.float32]
                if getattr(pipe, "_shard", None) is not None and low:
                    # Sharded, the model's trainable weights are the compute-dtype
                    # copies; the fp32 masters are in pieces over the ranks.
                    raise AdapterError(
                        f"save_pretrained would write {len(low)} trained weights "
                        f"({low[0]}, ...) as their {self.model.get_parameter(low[0]).dtype}"
                        " copies: with sharded data parallelism the fp32 masters are "
                        "pieces on the ranks. Save inside `with "
                        "rotapipe.distributed.full_weights(pipe):` on every rank")
        return self.model.save_pretrained(save_directory, **kwargs)

    def pipe_kwargs(self) -> dict:
        """Keyword arguments for :class:`rotapipe.RoundPipe` (add ``config=``)."""
        check_frozen(self.model.named_parameters())
        kwargs = dict(layers=self.layers, loss_fn=self.loss_fn,
                      side_inputs=self.side_inputs, loss_weight=self.loss_weight)
        embed = self.layers[0].embed
        if isinstance(embed, nn.Embedding) and embed.max_norm is None and not embed.sparse:
            # The token embedding moves by the rows a call looks up (a PEFT-wrapped
            # embedding is not an nn.Embedding and moves whole).
            kwargs["lookups"] = {embed: token_ids}
        if self.loss_fn.moe is not None:
            kwargs["tail_context"] = self.loss_fn.batch_context
        # What transformers keeps in fp32 when loading in the compute dtype (routers).
        ours = {id(t) for layer in self.layers for t in [*layer.parameters(),
                                                         *layer.buffers()]}
        kept = [t for t in _kept_fp32(self.base, self.compute_dtype) if id(t) in ours]
        if kept:
            kwargs["keep_fp32"] = kept
        return kwargs

    def pipe(self, config: PipeConfig | None = None, **kwargs):
        """Build the :class:`rotapipe.RoundPipe` (side inputs in the config's compute
        dtype). Extra keyword arguments go to ``RoundPipe``."""
        from ..pipe import RoundPipe
        config = config or PipeConfig()
        self.compute_dtype = config.precision.compute_dtype
        pipe = RoundPipe(**self.pipe_kwargs(), config=config, **kwargs)
        self._pipes = [r for r in self._pipes if r() is not None] + [weakref.ref(pipe)]
        return pipe

    @staticmethod
    def inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
               position_ids: torch.Tensor | None = None) -> dict:
        """The pipeline inputs of a batch (a dict without ``None`` entries)."""
        d = {"input_ids": input_ids, "attention_mask": attention_mask,
             "position_ids": position_ids}
        return {k: v for k, v in d.items() if v is not None}

    def layer_params(self) -> list[int]:
        """Parameter count of each layer (a weight shared by two layers counts in
        both): what the planner needs, also for a model on the meta device."""
        return [sum(p.numel() for p in layer.parameters()) for layer in self.layers]


VERIFY = ("tail", "full")
"""``wrap_hf(verify=...)``: the wrap-time check of everything but the blocks' insides
(always), or also the whole model's logits against its own forward (opt-in)."""


def wrap_hf(model: nn.Module, *, compute_dtype: torch.dtype | None = None,
            loss_chunk_tokens: int | None = None, ignore_index: int = -100,
            moe_aux_loss: bool | None = None, layers_path: str | None = None,
            norm_path: str | None = None,
            logits_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
            verify: str = "tail", quantize: str | None = None) -> HFModel:
    """Adapt a ``transformers`` causal LM (or a ``peft.PeftModel`` around one).

    Args:
        model: the model, on the CPU (or the meta device, to inspect the layers only).
        compute_dtype: dtype of the side inputs; default the embedding weight's dtype.
            :meth:`HFModel.pipe` sets it from the pipeline config.
        loss_chunk_tokens: tokens per LM-head chunk; default: 256 MiB of fp32 logits.
        ignore_index: label value that does not count (HF: -100).
        moe_aux_loss: add the load-balancing loss; default ``config.output_router_logits``
            (as the model's own forward does).
        layers_path: dotted path of the decoder list (from the causal-LM model, e.g.
            ``"model.layers"``) when it cannot be found automatically.
        norm_path: dotted path of the final norm (e.g. ``"model.norm"``; ``""`` for
            no final norm) when it cannot be found automatically.
        logits_fn: an elementwise transform the model's forward applies to the logits
            that rotapipe does not know (:mod:`.families` lists the ones it does).
        verify: ``"tail"`` (always done): the model's forward, run with stub blocks,
            must hand the blocks their inputs unchanged and give the adapter's logits
            for the same final hidden states. ``"full"``: also the whole model's logits
            on a few tokens against its own forward (a full forward pass: the way to
            trust a new architecture). A model on the meta device is not checked.
        quantize: ``"nf4"``: QLoRA. After the checks, every frozen weight matrix of
            the decoder blocks (attention and MLP projections, MoE experts; not the
            routers, norms, embedding or LM head) becomes 4-bit NormalFloat in host
            memory, uploaded packed and dequantized on the worker
            (:mod:`rotapipe.model.quant`, bitsandbytes). Trainable weights and PEFT
            adapter weights (also a frozen one: an adapter not active) are left as
            they are. The model's own forward no longer runs outside the pipeline
            (the weights are in the pipeline's host state);
            ``save_pretrained`` of a PEFT model still writes the adapter.

    Raises:
        AdapterError: a piece is not found, or the checks find that the adapter would
            not compute what the model computes (the message says what and the fix).
    """
    if verify not in VERIFY:
        raise AdapterError(f"verify={verify!r}: use one of {', '.join(map(repr, VERIFY))}")
    if quantize is not None and quantize not in QUANTIZE:
        raise AdapterError(f"quantize={quantize!r}: use one of "
                           f"{', '.join(map(repr, QUANTIZE))} or None")
    base = _unwrap_peft(model)
    # The pipeline recomputes every block in its backward stage. A block's own
    # checkpoint would recompute it a second time, and from the process's random
    # generator, not the layer's stream its forward drew from: with dropout on, the
    # gradients were another mask's (tests/test_hf_families.py). transformers 5.x names
    # it activation checkpointing (the gradient_* names warn).
    new = hasattr(base, "activation_checkpointing_disable")
    if getattr(base, "is_activation_checkpointing" if new else "is_gradient_checkpointing",
               False):
        (base.activation_checkpointing_disable if new
         else base.gradient_checkpointing_disable)()
    config = base.config.get_text_config() if hasattr(base.config, "get_text_config") \
        else base.config
    check_model(base, config)
    embed = _get(base, "get_input_embeddings", "input embeddings")
    head = _get(base, "get_output_embeddings", "output embeddings (LM head)")
    inner_path, inner, list_name, block_list = _find_decoder(base, embed, config,
                                                             layers_path)
    n = int(getattr(config, "num_hidden_layers", len(block_list)) or len(block_list))
    blocks = list(block_list)[:n]
    if not blocks:
        raise AdapterError(f"{type(base).__name__} has no decoder blocks "
                           f"(num_hidden_layers={n}): rotapipe pipelines the blocks between "
                           "the embedding and the head; build the model with at least one "
                           "layer")

    multiplier = embedding_multiplier(config)
    transforms = logit_transforms(config, logits_fn)
    router = router_class(base)
    routers = [find_routers(b, router) for b in blocks]
    moe = moe_spec(base, config, moe_aux_loss, routed=any(routers))
    if any(routers):
        warn_eager_experts(base)

    if compute_dtype is None:
        w = getattr(embed, "weight", None)
        compute_dtype = w.dtype if w is not None and w.is_floating_point() else torch.float32
    side = SideInputs(inner, list_name, blocks, int(config.hidden_size), compute_dtype,
                      moe=any(routers), aux_loss=moe is not None)
    p = (inner_path + ".") if inner_path else ""
    meta = _on_meta(base)
    embed_dropout = None
    if meta:
        norm_name, norm = _find_norm(base, inner, inner_path, embed, block_list,
                                     norm_path)
    else:
        # Wrap-time checks draw no numbers from the user's random stream.
        with torch.random.fork_rng(devices=[]):
            check_embedding_width(embed, int(config.hidden_size), type(base).__name__)
            side.learn_returns()
            embed_dropout = check_chain(side, multiplier, type(inner).__name__)
            extra = {"output_router_logits": False} if router is not None else {}
            run = find_tail(base, inner_path, side, embed, _dtype(head, compute_dtype),
                            **extra)
        if norm_path is not None:
            norm_name, norm = norm_path, (base.get_submodule(norm_path) if norm_path
                                          else None)
        else:
            norm_name, norm = run.norm() or ("", None)
    head_layer = HeadLayer(norm, head, transforms, moe)
    if not meta:
        where = ", ".join([f"final norm {norm_name or '(none)'}",
                           f"head {_path(base, head)}",
                           *(f"{k}={v}" for k, v in head_layer.transforms.items())])
        check_tail(run, head_layer, type(base).__name__, where)
    layers: list[nn.Module] = [EmbedLayer(embed, multiplier, moe, embed_dropout)]
    layers += [DecoderLayer(b, i, routers[i], moe) for i, b in enumerate(blocks)]
    layers.append(head_layer)
    _attach_work(layers, config)

    parts = {"embed": _path(base, embed), "layers": p + list_name,
             "norm": norm_name, "head": _path(base, head),
             "routers": sorted({r for rs in routers for r, _ in rs})}
    wrapped = HFModel(model, base, layers,
                      CausalLMLoss(loss_chunk_tokens, ignore_index, moe), side, parts)
    if verify == "full" and not meta:
        with torch.random.fork_rng(devices=[]):
            verify_full(wrapped)
    if quantize is not None:
        # After the checks (they run the model's forward on the original weights).
        router_mods = {id(b.get_submodule(name)) for b, rs in zip(blocks, routers)
                       for name, _ in rs}
        # A model wrapped with quantize='nf4' before keeps its NF4 weights as they are.
        if not quantize_frozen(blocks, skip=lambda mod, name: id(mod) in router_mods) \
                and not any(quantized(q) is not None for b in blocks for q in b.parameters()):
            raise AdapterError(f"quantize={quantize!r} quantizes frozen weight matrices "
                               "of the decoder blocks, and this model has none (every "
                               "weight trains): add LoRA adapters first (peft."
                               "get_peft_model), or drop quantize for full fine-tuning")
    return wrapped


def hf_pipe(model: nn.Module, config: PipeConfig | None = None, **wrap_kwargs):
    """``wrap_hf(model, **wrap_kwargs).pipe(config)``: the pipeline in one call."""
    return wrap_hf(model, **wrap_kwargs).pipe(config)


def load_hf(path, *, dtype: torch.dtype | str | None = None, adapter: str | None = None,
            trainable: bool = True, **kwargs) -> nn.Module:
    """Load a causal LM from a local directory (safetensors, memory-mapped by
    ``transformers``, so host RAM holds the weights once), optionally with a PEFT
    adapter from ``adapter`` (trainable unless ``trainable=False``).

    ``transformers`` 5.x leaves the weights in a private mapping of the
    ``.safetensors`` file (pages fault in on first use, as page cache). Loaded in the
    compute dtype, a frozen base stays mapped in the pipeline, and ``PipeConfig(pin=None)``
    keeps it pageable when pinning it would not fit in RAM (found by address, see
    :func:`rotapipe.runtime.pinning.resolve_pin`; docs/host_memory.md)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    if adapter is not None:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, adapter, is_trainable=trainable)
    return model


# -- discovery -------------------------------------------------------------------------
def _kept_fp32(base: nn.Module, dtype: torch.dtype) -> list[torch.Tensor]:
    """The parameters and buffers ``transformers`` keeps in fp32 when it loads ``base``
    in ``dtype``: those ``_keep_in_fp32_modules_strict`` names under bf16 and fp16, and
    ``_keep_in_fp32_modules`` under fp16, each entry a regular expression (``*`` for
    ``.*``) searched in the full name, as its loader matches them (a PEFT-wrapped
    module's ``base_layer`` left out of the name)."""
    names = set(getattr(base, "_keep_in_fp32_modules_strict", None) or ())
    if dtype == torch.float16:
        names |= set(getattr(base, "_keep_in_fp32_modules", None) or ())
    if dtype == torch.float32 or not names:
        return []
    pattern = re.compile("|".join(f"(?:{n.replace('*', '.*')})" for n in sorted(names)))
    return [t for name, t in [*base.named_parameters(), *base.named_buffers()]
            if t.is_floating_point() and pattern.search(name.replace(".base_layer", ""))]


def _unwrap_peft(model: nn.Module) -> nn.Module:
    get_base = getattr(model, "get_base_model", None)
    if callable(get_base) and hasattr(model, "peft_config"):
        check_peft(model)
        return get_base()
    return model


def _get(base: nn.Module, method: str, what: str) -> nn.Module:
    fn = getattr(base, method, None)
    found = None
    if callable(fn):
        try:
            found = fn()
        except (NotImplementedError, AttributeError):
            found = None
    if not isinstance(found, nn.Module):
        raise AdapterError(f"{type(base).__name__}.{method}() gave no module: rotapipe "
                           f"needs the {what} of a causal LM; build the layers yourself "
                           "and pass them to rotapipe.RoundPipe")
    return found


def _path(root: nn.Module, module: nn.Module) -> str:
    for name, m in root.named_modules(remove_duplicate=False):
        if m is module:
            return name
    return "?"


def _find_decoder(base, embed, config, layers_path):
    """``(inner path, inner module, list name, blocks)``."""
    if layers_path:
        try:
            blocks = base.get_submodule(layers_path)
        except AttributeError:
            raise AdapterError(f"layers_path={layers_path!r} names no submodule of "
                               f"{type(base).__name__}") from None
        inner_path, _, name = layers_path.rpartition(".")
        return inner_path, base.get_submodule(inner_path), name, blocks
    owners = [(n, m) for n, m in base.named_modules()
              if any(c is embed for c in m.children())]
    if not owners:
        raise AdapterError(f"the input embeddings are not a direct child of any module "
                           f"of {type(base).__name__}: pass the decoder list with "
                           "wrap_hf(model, layers_path='model.layers')")
    inner_path, inner = owners[0]
    lists = [(n, c) for n, c in inner.named_children() if isinstance(c, nn.ModuleList)]
    want = getattr(config, "num_hidden_layers", None)
    match = [(n, c) for n, c in lists if len(c) == want] or \
        (lists if len(lists) == 1 and want is None else [])
    if len(match) != 1:
        where = f"{type(base).__name__}.{inner_path}" if inner_path else type(base).__name__
        children = ", ".join(f"{n} ({type(c).__name__})" for n, c in inner.named_children())
        raise AdapterError(
            f"no decoder layer list found on {where}: expected one nn.ModuleList of "
            f"config.num_hidden_layers={want} blocks among its children ({children}); "
            "pass its path: wrap_hf(model, layers_path='model.layers'), or build the "
            "layers yourself and pass them to rotapipe.RoundPipe")
    return inner_path, inner, match[0][0], match[0][1]


def _find_norm(base, inner, inner_path, embed, blocks, norm_path):
    if norm_path is not None:
        if norm_path == "":
            return "", None
        return norm_path, base.get_submodule(norm_path)
    cands = [(n, c) for n, c in inner.named_children()
             if c is not embed and c is not blocks and next(c.parameters(), None) is not None]
    p = (inner_path + ".") if inner_path else ""
    if len(cands) > 1:
        names = ", ".join(p + n for n, _ in cands)
        raise AdapterError(f"more than one candidate final norm next to the decoder "
                           f"layers ({names}): pass the one the model applies after its "
                           f"last layer, e.g. wrap_hf(model, norm_path={p + cands[-1][0]!r})"
                           " (or norm_path='' for none)")
    if not cands:
        return "", None
    return p + cands[0][0], cands[0][1]


def _attach_work(layers: list[nn.Module], config) -> None:
    """Give each layer its per-token arithmetic from the config (embedding, blocks with
    attention at :data:`PLANNER_SEQ` tokens, LM head; :func:`rotapipe.plan.model_work`)
    for the runtime's planner. A config the FLOP model cannot read leaves the layers to
    the planner's estimate from their modules (:mod:`rotapipe.model.work`)."""
    seq = min(int(getattr(config, "max_position_embeddings", None) or PLANNER_SEQ),
              PLANNER_SEQ)
    try:
        works = model_work(config, seq, adapters=_lora_adapters(layers))
    except (ConfigError, TypeError, ValueError):
        return
    if len(works) == len(layers):
        for layer, work in zip(layers, works):
            set_work(layer, work)


def _lora_adapters(layers: list[nn.Module]) -> list[int] | None:
    """Each layer's trainable LoRA parameters (PEFT names them ``lora_*``) when they are
    all that trains, as :func:`rotapipe.plan.model_work` prices LoRA (a frozen weight's
    backward computes only its input gradient); ``None`` (priced as full fine-tuning)
    when a base weight trains or there are no adapters. Read at wrap time: freezing or
    unfreezing weights later does not change the plan's costs."""
    counts = []
    for layer in layers:
        n = 0
        for name, p in layer.named_parameters():
            if not p.requires_grad:
                continue
            if "lora_" not in name:
                return None
            n += p.numel()
        counts.append(n)
    return counts if any(counts) else None


def _on_meta(model: nn.Module) -> bool:
    return any(p.device.type == "meta" for p in model.parameters())


def _dtype(head: nn.Module, default: torch.dtype) -> torch.dtype:
    w = next(head.parameters(), None)
    return w.dtype if w is not None and w.is_floating_point() else default
