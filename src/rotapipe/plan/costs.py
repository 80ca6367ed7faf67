"""Per-layer cost model: times and bytes of each layer, from measurements or arithmetic.

A :class:`ModelCosts` says, for one microbatch on one device, how long each layer's
forward, recompute and backward take, how long its weights take to upload and its
output activation to cross one host link, and how many bytes its weights, saved
activations and output hold. The simulator and the planner read nothing else.

Build one from explicit times (:meth:`ModelCosts.explicit`) or from a Hugging Face
config by arithmetic (:func:`model_costs`; no weights are loaded or allocated). The
layers are the embedding, the decoder blocks and the LM head (final norm, output
projection and loss), the way ``rotapipe`` cuts a causal LM into layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from .._validate import integer, number
from ..errors import ConfigError
from .configs import (_SHARED_GATE, KNOWN_MODELS, _attention, _dense_mlp, _experts, _get,
                      _is_moe, _norms, _shared_width, load_config, text_settings,
                      tied_head)
from .hardware import Hardware

__all__ = ["LayerCost", "ModelCosts", "LayerWork", "KNOWN_MODELS", "ROWS_FIRST_COST",
           "load_config", "model_work", "model_costs"]

MAX_TOKENS = 2**20
"""Tokens of one microbatch at most (``rotapipe plan --seq``'s range): beyond, a typo."""
MAX_LAYERS = 4096
"""Layers of a cost model at most: a model of more is a typo (ten million identical
layers took minutes to build)."""
ROWS_FIRST_COST = 3.5
"""Host work of stepping a table's row first (``OR``: gathering its weight, gradient
and two Adam moments, stepping the gathered rows, writing them in the compute dtype),
in rows of the whole table's step: 111 ms for 32,768 of Qwen3-1.7B's 151,936 rows
against 149 ms for the whole table (fused ``torch.optim.AdamW``, fp32, 2 cores, median
of 6; ``docs/optimizer.md``). A table's rows are stepped first only when that is
cheaper than its whole step (:meth:`ModelCosts.rows_first_pays`); the simulator charges
an ``OR`` the same (:meth:`rotapipe.runtime.emulation.TimedEmulation.optimizer_seconds`)
and :func:`rotapipe.plan.host_memory` counts its buffers."""



@dataclass(frozen=True)
class LayerCost:
    """One layer, one microbatch: times in milliseconds, sizes in bytes."""

    name: str
    forward_ms: float
    backward_ms: float
    """Backward only (input gradients, and the weight gradients of what is trained),
    without recomputing the forward."""
    recompute_ms: float
    """Re-running the forward before the backward (usually ``forward_ms``)."""
    upload_ms: float = 0.0
    """Host-to-device upload of the layer's weights (the download of their gradients
    takes as long, unless ``grad_ms`` says otherwise)."""
    hop_ms: float = 0.0
    """One transfer of the layer's output activation, or of its gradient, over one host
    link (device to host, or host to device)."""
    weight_bytes: int = 0
    saved_bytes: int = 0
    """Activations autograd keeps for the backward when the forward keeps its graph."""
    output_bytes: int = 0
    grad_ms: float | None = None
    """Device-to-host download of the layer's weight gradients when it differs from
    ``upload_ms`` (LoRA: only the adapters' gradients; ``None``: every weight is
    trained and its gradient takes as long as its upload)."""
    grad_bytes: int | None = None
    """Device bytes of the layer's weight gradients when not every weight is trained
    (LoRA: the adapters'); ``None``: as ``weight_bytes``."""

    @property
    def dw_ms(self) -> float:
        """Download of the layer's weight gradients: ``grad_ms``, or ``upload_ms`` when
        every weight is trained."""
        return self.upload_ms if self.grad_ms is None else self.grad_ms

    def __post_init__(self):
        # Finite and >= 0: a NaN time made every plan's step NaN (and "fit").
        for f in ("forward_ms", "backward_ms", "recompute_ms", "upload_ms", "hop_ms",
                  "weight_bytes", "saved_bytes", "output_bytes", "grad_ms", "grad_bytes"):
            number(f"layer {self.name}: {f}", getattr(self, f), low=0.0,
                   optional=f in ("grad_ms", "grad_bytes"))


@dataclass(frozen=True)
class ModelCosts:
    """Costs of every layer of a model for one microbatch of ``tokens`` tokens."""

    layers: tuple[LayerCost, ...]
    tokens: int
    """Tokens in one microbatch (for tokens/s)."""
    input_hop_ms: float = 0.0
    """Upload of one microbatch's model input (token ids)."""
    input_bytes: int = 0
    rows_bytes: int = 0
    """Bytes of the embedding rows one *call* moves each way when the table moves by
    rows (``model_costs(call_tokens=)``; 0: it moves whole). They are gathered into
    the workers' bounce buffers (:func:`rotapipe.plan.host_memory`)."""
    shared_bytes: int = 0
    """Weight bytes the last layer (the LM head) shares with the first (the embedding,
    ``tie_word_embeddings``): both layers upload them, the host holds them once
    (:func:`rotapipe.plan.host_memory`)."""

    @property
    def frozen(self) -> tuple[int, ...]:
        """Layers holding weights the optimizer never updates: with LoRA costs (a
        layer's ``grad_ms`` set) every layer's base is frozen; none otherwise. What a
        schedule of overlapping calls uploads without waiting for the optimizer
        (:func:`rotapipe.schedule.roundpipe_call`'s ``frozen``)."""
        return tuple(i for i, l in enumerate(self.layers) if l.grad_ms is not None)

    def rows_first_pays(self) -> bool:
        """Whether ``optimizer_mode="overlap"`` steps first the embedding rows one call
        looks up (``OR``, docs/optimizer.md): the table (layer 0) moves by rows
        (:attr:`rows_bytes`) and those rows cost less than its whole step
        (:data:`ROWS_FIRST_COST`), as the runtime decides it."""
        return 0 < self.rows_bytes * ROWS_FIRST_COST < self.layers[0].weight_bytes

    def stepped_params(self, layers, dtype_bytes: int = 2, rows: bool = False) -> float:
        """Parameters the host optimizer steps over ``layers``: a layer's weights (a
        tied head's without the embedding's, :attr:`shared_bytes`), or with LoRA costs
        (``grad_bytes`` set) its adapters'; weights in ``dtype_bytes`` per parameter. ``rows``: an ``OR`` action, which steps the embedding rows the
        next call looks up (layer 0, where :meth:`rows_first_pays`), each at
        :data:`ROWS_FIRST_COST` rows of the whole step."""
        def one(l: int) -> float:
            c = self.layers[l]
            if c.grad_bytes is not None:
                return c.grad_bytes
            if rows and l == 0 and self.rows_first_pays():
                return self.rows_bytes * ROWS_FIRST_COST
            if l == len(self.layers) - 1 and l > 0:
                # A tied head's weight is the embedding's, stepped once with it.
                return c.weight_bytes - self.shared_bytes
            return c.weight_bytes
        return sum(one(l) for l in layers) / dtype_bytes

    def __post_init__(self):
        if not self.layers:
            raise ConfigError("ModelCosts needs at least one layer")
        integer("ModelCosts.tokens", self.tokens, maximum=MAX_TOKENS)

    @classmethod
    def explicit(cls, blocks: int, forward_ms: float, backward_ms: float, *,
                 head_forward_ms: float, head_backward_ms: float,
                 recompute_ms: float | None = None, hop_ms: float = 0.0,
                 upload_ms: float = 0.0, tokens: int = 2048) -> ModelCosts:
        """``blocks`` identical layers plus an LM head, from measured times. ``hop_ms``
        is the transfer time of one activation over one link, ``upload_ms`` a block's
        weight upload (the head's is taken as the same)."""
        integer("blocks", blocks, minimum=0, maximum=MAX_LAYERS)
        rec = forward_ms if recompute_ms is None else recompute_ms
        block = LayerCost("block", forward_ms, backward_ms, rec, upload_ms, hop_ms)
        head = LayerCost("head", head_forward_ms, head_backward_ms, head_forward_ms,
                         upload_ms, hop_ms)
        return cls(tuple(replace(block, name=f"block{i}") for i in range(blocks)) + (head,),
                   tokens)

    @classmethod
    def uniform(cls, layers: int, forward_ms: float, backward_ms: float,
                recompute_ms: float | None = None, tokens: int = 1) -> ModelCosts:
        """``layers`` identical layers, no transfer cost (for closed-form checks)."""
        integer("layers", layers, maximum=MAX_LAYERS)
        rec = forward_ms if recompute_ms is None else recompute_ms
        return cls(tuple(LayerCost(f"layer{i}", forward_ms, backward_ms, rec)
                         for i in range(layers)), tokens)

    def sum(self, attr: str, start: int, stop: int) -> float:
        """Sum of one field over layers ``[start, stop)``."""
        return sum(getattr(layer, attr) for layer in self.layers[start:stop])

    def boundary_hop_ms(self, at: int) -> float:
        """Transfer time of the activation entering layer ``at``."""
        return self.input_hop_ms if at == 0 else self.layers[at - 1].hop_ms


@dataclass(frozen=True)
class LayerWork:
    """Arithmetic of one layer per token (independent of hardware)."""

    name: str
    forward_flops: float
    backward_flops: float
    params: int
    saved_bytes: float
    """Bytes autograd keeps per token for the backward."""
    output_bytes: float
    """Bytes of the layer's output per token."""
    memory_bytes: float = 0.0
    """Bytes a memory-bound layer moves per token in its forward, priced by bandwidth
    rather than FLOPs (an embedding lookup reads one row and writes it; the backward
    moves twice as many). The runtime's planner reads it (:mod:`rotapipe.planner.pipeline`);
    :func:`model_costs` leaves it out (a hardware profile's memory bandwidth is
    informational)."""


def model_work(config, seq: int, dtype_bytes: int = 2,
               adapters: Sequence[int] | None = None) -> tuple[LayerWork, ...]:
    """Per-token FLOPs and bytes of the embedding, every decoder block and the LM head
    of a Hugging Face decoder, for sequences of ``seq`` tokens with causal flash
    attention. Each block's parameters are counted as its family builds them
    (:data:`FAMILIES`: projections and their biases, gated or two-matrix MLPs, norms,
    QK-norms, multi-head latent attention, dense and MoE blocks); ``test_sim_costs``
    checks every count against the model ``transformers`` builds. MoE blocks count the
    routed (active) experts' FLOPs and every expert's weights; sliding-window layers
    (``layer_types``) attend to at most ``sliding_window`` positions. Norm scales,
    attention sinks and the router's score are parameters without FLOPs here.

    ``adapters``: what is trained. ``None``: every weight (full fine-tuning; a weight's
    backward computes its input gradient and its weight gradient, each as many FLOPs
    as its forward). Otherwise LoRA on a frozen base: the trainable adapter parameters
    of each layer (:func:`rotapipe.plan.lora_params`, one entry per layer). A frozen
    weight's backward computes only the input gradient (as many FLOPs as its
    forward); an adapter of ``p`` parameters adds ``2 p`` FLOPs per token to the
    forward and ``4 p`` to the backward (input and weight gradients)."""
    cfg = text_settings(load_config(config))
    h = _get(cfg, "hidden_size")
    layers = _get(cfg, "num_hidden_layers")
    nh = _get(cfg, "num_attention_heads")
    vocab = _get(cfg, "vocab_size")
    kind = str(cfg.get("model_type", ""))
    gpt_oss = kind == "gpt_oss"
    block_norms, final_norm = _norms(cfg, kind, h)
    experts = _experts(cfg)
    types = cfg.get("layer_types") or ()
    window = cfg.get("sliding_window")
    if adapters is not None and len(adapters) != layers + 2:
        raise ConfigError(f"adapters has {len(adapters)} entries; the model has "
                          f"{layers + 2} layers (embedding, {layers} blocks, head)")
    # Backward FLOPs per forward FLOP of a weight: input gradient, plus the weight
    # gradient when it is trained.
    grads = 2 if adapters is None else 1
    # Embedding: a row lookup, no FLOPs; it reads one row per token and writes it.
    works = [LayerWork("embed", 0.0, 0.0, vocab * h, 0.0, h * dtype_bytes,
                       memory_bytes=2 * h * dtype_bytes)]
    for i in range(layers):
        attn = _attention(cfg, kind, h, nh, i)
        sliding = window and i < len(types) and types[i] == "sliding_attention"
        # QK^T and AV, 2 FLOPs per multiply-add each, over the positions a token attends
        # to on average; flash attention's backward recomputes the scores: 2.5x forward.
        # A linear-attention layer's core costs the same per token at any length.
        core = 2 * (attn.qk_width + attn.v_width) * \
            _attended(seq, window if sliding else None) + attn.linear_core
        # GPT-NeoX-Japanese: the last block's attention output has a bias.
        late_bias = h if kind == "gpt_neox_japanese" and i == layers - 1 else 0
        moe = bool(experts) and _is_moe(cfg, kind, i)
        if moe:
            inter = cfg.get("moe_intermediate_size") or _get(cfg, "intermediate_size")
            top_k = cfg.get("num_experts_per_tok") or cfg.get("moe_k") or \
                _get(cfg, "experts_per_token")
            shared = _shared_width(cfg, kind, inter)
            # GPT-OSS: biased router and experts (gate_up 2 * inter, down h per expert);
            # ERNIE 4.5: a score-correction bias per expert on the router; Qwen2-MoE: a
            # one-output gate on the shared expert.
            expert = 3 * h * inter + ((2 * inter + h) if gpt_oss else 0)
            router = h * experts + (experts if gpt_oss or kind == "ernie4_5_moe" else 0)
            shared_extra = h if shared and kind in _SHARED_GATE else 0
            if shared and kind == "ernie4_5_moe" and cfg.get("use_bias"):
                shared_extra += 2 * shared + h          # the shared experts' biases
            mlp_params = experts * expert + router + 3 * h * shared + shared_extra
            mlp_flops = 2 * (h * experts + top_k * 3 * h * inter + 3 * h * shared +
                             shared_extra)
            mlp_saved = h + top_k * (h + 4 * inter) + 4 * shared
        else:
            mlp_params, mlp_saved = _dense_mlp(cfg, kind, h)
            mlp_flops = 2 * mlp_params
        proj = 2 * (attn.params + late_bias) + mlp_flops
        works.append(LayerWork(
            f"block{i}", proj + core, grads * proj + 2.5 * core,
            attn.params + late_bias + attn.extra + mlp_params + block_norms,
            (attn.saved + mlp_saved) * dtype_bytes + (4 * experts if moe else 0),
            h * dtype_bytes))
    # Head: final norm, output projection (with its bias in Phi and CodeGen, and where
    # PhiMoE's lm_head_bias or ERNIE-4.5-MoE's use_bias says),
    # cross-entropy over the vocabulary (logits in the compute dtype, log-softmax kept
    # in fp32 for the backward).
    head_bias = vocab if kind in ("phi", "codegen") or (
        kind == "phimoe" and cfg.get("lm_head_bias")) or (
        kind == "ernie4_5_moe" and cfg.get("use_bias")) else 0
    works.append(LayerWork("head", 2 * h * vocab, grads * 2 * h * vocab,
                           vocab * h + head_bias + final_norm,
                           2 * h * dtype_bytes + vocab * (dtype_bytes + 4), 0.0))
    if adapters is not None:
        works = [replace(w, forward_flops=w.forward_flops + 2 * p,
                         backward_flops=w.backward_flops + 4 * p)
                 for w, p in zip(works, adapters)]
    return tuple(works)


def _attended(seq: int, window: int | None) -> float:
    """Positions a token attends to, averaged over a causal sequence of ``seq``: (seq +
    1) / 2, or with a sliding window of ``window`` positions, min(position, window)."""
    if not window or window >= seq:
        return (seq + 1) / 2
    return (window * (window + 1) / 2 + (seq - window) * window) / seq


NF4_BLOCK = 64
"""Elements per NF4 block (one absmax scale each; QLoRA's and bitsandbytes' default)."""
NF4_SCALE_BLOCK = 256
"""Scales per block of the second (8-bit) quantization of the scales."""


def nf4_bytes(numel: int) -> int:
    """Packed bytes of an :class:`rotapipe.model.quant.NF4Weight` of ``numel`` elements (the planner's
    count): half a byte per element, one byte of scale per 64 elements, four per
    16,384 (the scales' scales), the offset and the two code books (1,092 bytes), each
    piece 8-byte aligned as ``NF4Weight.quantize`` lays them out."""
    blocks = -(-numel // NF4_BLOCK)
    offset = 0
    for nbytes in (-(-numel // 2), blocks, 4 * -(-blocks // NF4_SCALE_BLOCK), 4, 4 * 16,
                   4 * 256):
        offset = -(-offset // 8) * 8 + nbytes
    return offset


def model_costs(config, hardware: Hardware, *, seq: int = 2048, microbatch_size: int = 1,
                dtype_bytes: int = 2, quantize: str | None = None,
                adapters: Sequence[int] | None = None,
                call_tokens: int | None = None) -> ModelCosts:
    """:class:`ModelCosts` of a Hugging Face decoder on ``hardware``: times from FLOPs at
    ``hardware.flops``, transfers at the host link bandwidth, for microbatches of
    ``microbatch_size`` sequences of ``seq`` tokens. ``quantize="nf4"`` (QLoRA): the
    decoder blocks' weights upload as NF4 bytes (:func:`rotapipe.model.quant.nf4_bytes`)
    and are dequantized on the device, where they take ``weight_bytes`` as before.

    ``adapters`` (LoRA: trainable adapter parameters per layer, as
    :func:`rotapipe.plan.lora_params` gives them; ``None``: full fine-tuning): the
    times of :func:`model_work` with those adapters on a frozen base, and each layer's
    ``grad_ms`` is the download of its adapters' compute-dtype gradients (0 for a
    layer without adapters). The adapters' own weights (rank 16: 1.2% of a Qwen3-1.7B
    block's, 0.02% of a Qwen3-235B-A22B block's) are left out of ``weight_bytes`` and
    the upload.

    ``call_tokens``: the tokens of one call (global batch x sequence): the token
    embedding then moves by rows (``RoundPipe(lookups=...)``, what wrapped Hugging Face
    models do), at most ``min(vocab, call_tokens)`` of them each way, and keeps its
    full ``weight_bytes`` on the device; ``None``: the whole table moves."""
    if quantize not in (None, "nf4"):
        raise ConfigError(f"quantize={quantize!r}: use 'nf4' or None")
    integer("seq", seq, maximum=MAX_TOKENS)
    integer("microbatch_size", microbatch_size, maximum=MAX_TOKENS)
    integer("call_tokens", call_tokens, optional=True,
            allowed="the tokens of one call, a positive int (None: the whole embedding "
                    "table moves)")
    if seq * microbatch_size > MAX_TOKENS:
        raise ConfigError(f"seq={seq} x microbatch_size={microbatch_size} tokens per "
                          f"microbatch: at most {MAX_TOKENS:,} (a typo, not a run)")
    tokens = seq * microbatch_size
    ms_per_flop = 1e3 / hardware.flops
    ms_per_byte = 1e3 / hardware.link_bytes_per_s
    layers, rows_bytes = [], 0
    works = model_work(config, seq, dtype_bytes, adapters)
    for i, w in enumerate(works):
        fwd = w.forward_flops * tokens * ms_per_flop
        weight_bytes = w.params * dtype_bytes
        moved = nf4_bytes(w.params) if quantize and 0 < i < len(works) - 1 else weight_bytes
        if i == 0 and call_tokens is not None and w.output_bytes:
            # Distinct rows a call can look up: at most one per token.
            row = int(w.output_bytes)
            moved = rows_bytes = min(weight_bytes, row * int(call_tokens))
        out_bytes = int(w.output_bytes * tokens)
        grad_ms = None if adapters is None else adapters[i] * dtype_bytes * ms_per_byte
        layers.append(LayerCost(w.name, fwd, w.backward_flops * tokens * ms_per_flop, fwd,
                                moved * ms_per_byte, out_bytes * ms_per_byte,
                                weight_bytes, int(w.saved_bytes * tokens), out_bytes,
                                grad_ms, None if adapters is None else
                                int(adapters[i] * dtype_bytes)))
    input_bytes = 8 * tokens
    # A head tied to the embedding holds the embedding's weight, not a copy.
    shared = works[0].params * dtype_bytes if tied_head(config) else 0
    return ModelCosts(tuple(layers), tokens, input_bytes * ms_per_byte, input_bytes,
                      rows_bytes, shared)
