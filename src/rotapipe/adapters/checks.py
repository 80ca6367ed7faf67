"""Wrap-time checks that the adapter's layers compute what the model's own forward does.

Three checks, from cheapest:

- **Between the blocks** (:func:`check_chain`): the model's forward, run with stub blocks
  (:class:`~rotapipe.adapters.side.SideInputs`), hands block 0 the input embeddings
  unchanged (or scaled by a known multiplier, then dropped out: the dropout found is
  the embedding layer's) and every block its predecessor's output.
- **The tail** (:func:`find_tail` and :func:`check_tail`): the whole causal-LM forward,
  run with stub blocks whose last one returns known random hidden states ``H``, gives
  Hugging Face's logits for ``H``; the adapter's head layer (final norm, LM head, logit
  transforms) must give the same logits for the same ``H``, element by element, and
  the loss the forward returns for them must be their causal-LM cross-entropy (what
  the adapter trains; Bamba's z-loss is not). The same run finds the final norm: the
  child of the inner model applied to ``H`` (parameter-free norms included). Only the
  norm and head weights are touched.
- **The whole model** (:func:`verify_full`, opt-in with ``wrap_hf(verify="full")``): the
  adapter's layers, run one after another on a few padded tokens, against the model's
  own forward.

They run the model in eval mode (:func:`~rotapipe.adapters.side.eval_mode`: dropout
off, each module's own flag given back after). Each mismatch raises
:class:`AdapterError` naming the model class, what differs and how to fix it, so no
family trains with a silently wrong loss. Before them, :func:`check_model` refuses an
encoder-decoder or flex attention by its config. A structural check refuses what the
adapter cannot train: PEFT prompt learning (:func:`check_peft`).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from .errors import AdapterError
from .loss import unchunked_lm_loss
from .side import (DropoutCall, SideInputs, eval_mode, shallow_clone,
                   token_ids_refusal)

__all__ = ["check_model", "check_embedding_width", "check_chain", "find_tail",
           "check_tail", "verify_full", "tolerance", "check_peft"]

ATTENTION = ("eager", "sdpa")
"""Attention implementations the wrap-time checks and the tests cover on the CPU."""


def tolerance(dtype: torch.dtype) -> float:
    """Relative tolerance of a logits comparison in ``dtype`` (a few units in the last
    place: both sides run the same operations, but not always in the same order)."""
    return 1e-5 if dtype in (torch.float32, torch.float64) else 4 * torch.finfo(dtype).eps


def check_model(base: nn.Module, config) -> None:
    """What the config says rules the model out: an encoder-decoder (its decoder
    blocks need the encoder's output), or flex attention (its block masks are objects
    the pipeline does not upload, and its backward does not run on the CPU).
    ``config``: the text config."""
    name = type(base).__name__
    configs = (base.config, config)
    if any(getattr(c, "is_encoder_decoder", False) for c in configs):
        raise AdapterError(f"{name} is an encoder-decoder (config.is_encoder_decoder="
                           "True): rotapipe trains decoder-only causal LMs, whose forward "
                           "is embeddings -> decoder blocks -> norm -> LM head")
    supported = " or ".join(map(repr, ATTENTION))
    for c in configs:
        attn = getattr(c, "_attn_implementation", None)
        if isinstance(attn, str) and "flex" in attn:
            raise AdapterError(
                f"{name} uses attn_implementation={attn!r}, which rotapipe does not "
                "support (its block masks are not tensors the pipeline uploads, and its "
                f"backward does not run on the CPU): use {supported}, e.g. "
                "model.set_attn_implementation('sdpa') before wrap_hf")
    check_not_quantized(base)


def check_embedding_width(embed: nn.Module, hidden_size: int, name: str) -> None:
    """Layer 0 hands block 0 the embedding's output, ``hidden_size`` wide (OPT-350m
    projects narrower embeddings first: ``project_in``)."""
    width = getattr(embed, "embedding_dim", None)
    if isinstance(width, int) and width != hidden_size:
        raise AdapterError(
            f"{name}'s input embeddings are {width} wide but its decoder blocks take "
            f"hidden_size={hidden_size}: the forward projects the embeddings before the "
            "first block, which rotapipe's layer 0 (the embedding alone) does not; build "
            "the layers yourself and pass them to rotapipe.RoundPipe")


def check_not_quantized(base: nn.Module) -> None:
    """Refuse a model whose weights a quantization library replaced (bitsandbytes'
    ``Params4bit`` / ``Int8Params``, or any ``transformers`` quantizer): the pipeline
    moves and computes with plain weight tensors, and such a layer fails deep inside
    the wrap-time probe (or, where a weight is plain bytes, would run on them)."""
    how = ("load the model without quantization_config (e.g. dtype=torch.bfloat16) "
           "and pass wrap_hf(model, quantize='nf4') for QLoRA: rotapipe keeps the "
           "frozen base in NF4 itself")
    for pname, p in base.named_parameters():
        module = type(p).__module__.split(".")[0]
        if module == "bitsandbytes" or hasattr(p, "quant_state"):
            raise AdapterError(f"{type(base).__name__} is quantized by {module} ({pname} "
                               f"is a {type(p).__name__} of {p.dtype}): {how}")
    quantizer = getattr(base, "hf_quantizer", None)
    if quantizer is not None or getattr(base, "is_quantized", False):
        kind = type(quantizer).__name__ if quantizer is not None else "a quantizer"
        raise AdapterError(f"{type(base).__name__} was loaded quantized ({kind}): {how}")


def check_chain(side: SideInputs, multiplier: float | None,
                name: str) -> nn.Module | None:
    """Every block is reached, block 0 gets the input embeddings (times the known
    ``multiplier``, then through dropout), and each later block gets its predecessor's
    output. Returns the dropout the forward applies to the embeddings (the model's own
    module, or an ``nn.Dropout`` of the probability its forward passes to
    ``F.dropout``; its mode is then the pipeline's: ``pipe.train()``,
    ``pipe.eval()``), or ``None``."""
    with eval_mode(side.probe):
        dropout = _check_chain(side, multiplier, name)
    if dropout is not None and dropout.module is None:
        # A functional dropout of the forward follows the model's flag: start there.
        return nn.Dropout(dropout.p).train(side.probe.training)
    return None if dropout is None else dropout.module


def _check_chain(side: SideInputs, multiplier: float | None,
                 name: str) -> DropoutCall | None:
    ones = torch.ones(1, 2, side.hidden_size, dtype=side.dtype)
    calls = side.run(ones, torch.ones(1, 2, dtype=torch.long), None)
    dropouts = side.dropouts
    first = calls[0][0]
    if first is not ones:
        if multiplier is None or not torch.equal(first, ones * multiplier):
            raise AdapterError(f"{name}.forward changes the input embeddings before the "
                               "first decoder layer in a way rotapipe does not know (for "
                               "example learned position embeddings added there): build "
                               "the layers yourself and pass them to rotapipe.RoundPipe")
    if any("input_ids" in kwargs for _, _, kwargs in calls):
        raise AdapterError(token_ids_refusal(name))    # a block that took None for them
    for i in range(1, len(calls)):
        if calls[i][0] is not calls[i - 1][0]:
            raise AdapterError(f"{name}.forward changes the hidden states between decoder "
                               f"layers {i - 1} and {i}: build the layers yourself and pass "
                               "them to rotapipe.RoundPipe")
    # The side inputs are computed once per microbatch from a placeholder of the
    # embeddings: an argument that depends on the embeddings' values (Zamba2's
    # original_hidden_states) would be a constant, and its gradient lost.
    other = side.run(ones * 2, torch.ones(1, 2, dtype=torch.long), None)
    for i, ((_, args, kwargs), (_, args2, kwargs2)) in enumerate(zip(calls, other)):
        for key, v, v2 in _arguments(args, kwargs, args2, kwargs2):
            if isinstance(v, torch.Tensor) and v.is_floating_point() and \
                    not (isinstance(v2, torch.Tensor) and torch.equal(v, v2)):
                raise AdapterError(
                    f"{name}.forward passes decoder layer {i} an argument computed from "
                    f"the input embeddings ({key}): rotapipe hands each layer only the "
                    "previous layer's output, so that argument would be a constant and "
                    "its gradient lost; build the layers yourself and pass them to "
                    "rotapipe.RoundPipe")
    return _embedding_dropout(dropouts, first, name)


def _embedding_dropout(dropouts: list[DropoutCall], first: torch.Tensor,
                       name: str) -> DropoutCall | None:
    """The one dropout the forward applies to what block 0 gets, if any; any other
    dropout before or between the blocks is refused (the layers would not apply it).
    Dropout of probability 0 changes nothing and is left out."""
    def where(d: DropoutCall) -> str:
        what = getattr(d.fn, "__name__", str(d.fn))
        by = f" (module {type(d.module).__name__})" if d.module is not None else ""
        return f"{what}(p={d.p}){by}"
    fix = ("set that dropout probability to 0 in the config (or build the layers "
           "yourself and pass them to rotapipe.RoundPipe)")
    dropouts = [d for d in dropouts if d.p > 0]
    later = [d for d in dropouts if d.blocks_before > 0]
    if later:
        d = later[0]
        raise AdapterError(f"{name}.forward applies {where(d)} to the hidden states "
                           f"after decoder layer {d.blocks_before - 1}, outside the "
                           f"blocks, which rotapipe's layers do not repeat: {fix}")
    if not dropouts:
        return None
    d = dropouts[0]
    if len(dropouts) > 1 or d.input is not first or (
            d.module is None and d.fn is not torch.nn.functional.dropout):
        applied = ", ".join(where(x) for x in dropouts)
        raise AdapterError(f"{name}.forward applies dropout before the first decoder "
                           f"layer in a way rotapipe does not repeat ({applied}; rotapipe "
                           "applies one dropout to the scaled embeddings): " + fix)
    return d


def _arguments(args, kwargs, args2, kwargs2):
    """``(name, value in run 1, value in run 2)`` of every argument after the hidden
    states, nested tuples and lists flattened (``args[1][0]``, ``kwargs['x']``)."""
    def walk(name, v, v2):
        if isinstance(v, (tuple, list)):
            for j, item in enumerate(v):
                other = v2[j] if isinstance(v2, (tuple, list)) and j < len(v2) else None
                yield from walk(f"{name}[{j}]", item, other)
        else:
            yield name, v, v2
    for j, v in enumerate(args):
        yield from walk(f"positional argument {j + 1}", v,
                        args2[j] if j < len(args2) else None)
    for k, v in kwargs.items():
        yield from walk(k, v, kwargs2.get(k))


class TailRun:
    """Hugging Face's output for known final hidden states, and which children of the
    inner model the forward applied after the last block (in call order)."""

    def __init__(self, hidden: torch.Tensor, logits: torch.Tensor | None,
                 after: list[tuple[str, nn.Module, bool]],
                 labels: torch.Tensor | None = None, loss: torch.Tensor | None = None,
                 loss_terms: str = ""):
        self.hidden, self.logits = hidden, logits
        self.after = after
        """``(name, module, applied to the last block's output)`` per call."""
        self.labels, self.loss = labels, loss
        """The labels the forward was given and the loss it returned (or ``None``)."""
        self.loss_terms = loss_terms
        """Non-zero loss coefficients of the config, for the message (``"a=1, b=2"``)."""

    def norm(self) -> tuple[str, nn.Module] | None:
        """The child applied to the last block's output, if any."""
        for name, module, on_hidden in self.after:
            if on_hidden:
                return name, module
        return None


def find_tail(base: nn.Module, inner_path: str, side: SideInputs, embed: nn.Module,
              dtype: torch.dtype, **forward_kwargs) -> TailRun:
    """Run ``base``'s forward with stub blocks on a padded 2 x 3 batch, the last block
    returning random hidden states; record the logits and what ran after the block."""
    with eval_mode(base):
        return _find_tail(base, inner_path, side, embed, dtype, **forward_kwargs)


def _find_tail(base: nn.Module, inner_path: str, side: SideInputs, embed: nn.Module,
               dtype: torch.dtype, **forward_kwargs) -> TailRun:
    inner = base.get_submodule(inner_path) if inner_path else base
    probe = _clone_path(base, inner_path, side.probe)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 3, side.hidden_size, generator=g).to(dtype)
    embeds = torch.zeros(2, 3, side.hidden_size, dtype=dtype)
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    # Labels as a collator builds them (-100 on padding): the loss the forward returns
    # for them must be the causal-LM cross-entropy of its logits (check_tail).
    labels = torch.randint(0, 2, (2, 3), generator=g).masked_fill(mask == 0, -100)
    after: list[tuple[str, nn.Module, bool]] = []
    done = {"last": False}

    def watch(name):
        def hook(module, args, kwargs):
            if done["last"]:
                first = args[0] if args else next(iter(kwargs.values()), None)
                after.append((name, module, first is hidden))
        return hook

    def last_returned(module, args, out):
        done["last"] = True

    handles = [m.register_forward_pre_hook(watch(_join(inner_path, n)), with_kwargs=True)
               for n, m in inner.named_children() if m is not embed and n != side.layers_name]
    handles.append(side.stubs[-1].register_forward_hook(last_returned))
    try:
        out, _ = side.run_whole(probe, embeds, hidden, mask, labels=labels,
                                **forward_kwargs)
    except AdapterError:
        raise
    except Exception as exc:
        raise AdapterError(
            f"{type(base).__name__}.forward failed when run with stub decoder layers "
            f"({type(exc).__name__}: {exc}): rotapipe cannot check what the model does "
            "after its last layer; build the layers yourself and pass them to "
            "rotapipe.RoundPipe") from exc
    finally:
        for h in handles:
            h.remove()
    tail_drop = [d for d in side.dropouts if d.blocks_before == side.num_layers
                 and d.module is not None and d.p > 0]
    if tail_drop:
        d = tail_drop[0]
        raise AdapterError(f"{type(inner).__name__}.forward applies dropout (module "
                           f"{type(d.module).__name__}, p={d.p}) after its last decoder "
                           "layer, which rotapipe's head layer does not repeat: set that "
                           "dropout probability to 0 in the config (or build the layers "
                           "yourself and pass them to rotapipe.RoundPipe)")
    logits = getattr(out, "logits", None)
    if logits is None and isinstance(out, (tuple, list)) and out:
        logits = out[0]
    loss = getattr(out, "loss", None)
    return TailRun(hidden, logits if isinstance(logits, torch.Tensor) else None, after,
                   labels, loss if isinstance(loss, torch.Tensor) else None,
                   _loss_terms(base))


_MOE_COEFS = ("router_aux_loss_coef", "aux_loss_coef")
"""Loss coefficients rotapipe applies itself (the load-balancing loss, :mod:`.moe`)."""


def _loss_terms(base: nn.Module) -> str:
    """The config's non-zero numbers named like a loss term (``z_loss_coefficient``),
    other than the load-balancing coefficients rotapipe applies."""
    config = base.config.get_text_config() if hasattr(base.config, "get_text_config") \
        else base.config
    terms = [f"{k}={v}" for k, v in sorted(vars(config).items())
             if "loss" in k and k not in _MOE_COEFS and not isinstance(v, bool)
             and isinstance(v, (int, float)) and v]
    return ", ".join(terms)


def check_tail(run: TailRun, head_layer: nn.Module, name: str, where: str) -> None:
    """The adapter's head layer gives Hugging Face's logits for the same hidden states.

    ``where`` describes the adapter's tail (norm and head paths, transforms) for the
    message."""
    ran = ", ".join(n for n, _, _ in run.after) or "nothing"
    if run.logits is None:
        raise AdapterError(f"{name}.forward returned no logits when run with stub decoder "
                           "layers: rotapipe cannot check its tail; build the layers "
                           "yourself and pass them to rotapipe.RoundPipe")
    x = run.hidden if getattr(head_layer, "moe", None) is None else (run.hidden, None)
    with torch.no_grad(), eval_mode(head_layer):
        ours = head_layer(x)
    want = run.logits
    fix = ("pass wrap_hf(model, norm_path=...) if the final norm is another module, "
           "wrap_hf(model, logits_fn=...) for a transform of the logits, or add a family "
           "hook (rotapipe/adapters/families.py); verify with wrap_hf(model, "
           "verify='full')")
    if want.shape != ours.shape:
        raise AdapterError(
            f"{name}.forward gives logits of shape {list(want.shape)} for final hidden "
            f"states {list(run.hidden.shape)}, the adapter's tail ({where}) "
            f"{list(ours.shape)}; after the last layer the forward ran: {ran}. {fix}")
    a, b = want.double(), ours.double()
    scale = max(a.abs().max().item(), b.abs().max().item(), 1e-30)
    err = (a - b).abs().max().item()
    if err <= tolerance(ours.dtype) * scale:
        _check_loss(run, ours, name)
        return
    ratio = (a * b).sum().item() / max((b * b).sum().item(), 1e-30)
    hint = ""
    if torch.allclose(a, b * ratio, rtol=tolerance(ours.dtype), atol=1e-30 + 1e-5 * scale):
        hint = (f" HF's logits are the adapter's times {ratio:.6g}: a logit scale the "
                f"adapter does not know (wrap_hf(model, logits_fn=lambda x: x * "
                f"{ratio:.6g}) if it is a constant of the config).")
    raise AdapterError(
        f"{name}.forward's logits differ from the adapter's tail ({where}) on the same "
        f"final hidden states: max abs error {err:.3g} (logits up to {scale:.3g}, shape "
        f"{list(want.shape)}, {ours.dtype}); after the last layer the forward ran: "
        f"{ran}.{hint} Training would use a wrong loss: {fix}")


def _check_loss(run: TailRun, logits: torch.Tensor, name: str) -> None:
    """The loss the forward returned with the tail check's labels is the causal-LM
    cross-entropy of its logits (Hugging Face's ``ForCausalLMLoss``), which is what
    the adapter trains: a forward that adds a term to it (Bamba's z-loss,
    ``z_loss_coefficient``) or computes it another way is refused."""
    if run.loss is None or run.labels is None:
        return
    want = run.loss.double().item()
    got = unchunked_lm_loss(logits, run.labels).double().item()
    if abs(want - got) <= tolerance(logits.dtype) * max(abs(want), abs(got), 1.0):
        return
    terms = f" (the config sets {run.loss_terms})" if run.loss_terms else ""
    raise AdapterError(
        f"{name}.forward's loss differs from the causal-LM cross-entropy of its own "
        f"logits on the same final hidden states and labels: {want:.6g} against "
        f"{got:.6g}{terms}. rotapipe trains the cross-entropy (plus the MoE "
        "load-balancing loss), so the forward's other loss terms would be silently "
        "left out: set their coefficients to 0 in the config to train without them, or "
        "build the layers and loss yourself and pass them to rotapipe.RoundPipe")


def verify_full(wrapped, tokens: int = 6, seed: int = 0) -> float:
    """The adapter's layers, run in order on the host on two padded sequences of
    ``tokens`` tokens, give the model's own logits at every attended position; returns
    the max abs error, raises :class:`AdapterError` beyond :func:`tolerance`."""
    base = wrapped.base
    config = wrapped.config
    # A multimodal wrapper's vocabulary is its language model's.
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    if vocab < 2:
        raise AdapterError(f"verify='full' needs the vocabulary size: {type(base).__name__}"
                           f"'s (text) config has vocab_size={vocab!r}")
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(min(3, vocab - 1), vocab, (2, tokens), generator=g)
    mask = torch.ones(2, tokens, dtype=torch.long)
    mask[1, : tokens // 3] = 0                      # left padding in the second row
    inputs = wrapped.inputs(ids, mask)
    with torch.no_grad(), eval_mode(base, *wrapped.layers):
        want = base(input_ids=ids, attention_mask=mask, use_cache=False).logits
        side = wrapped.side_inputs(inputs)
        x = wrapped.layers[0](inputs, **side)
        for layer in wrapped.layers[1:]:
            x = layer(x, **side)
    name = type(base).__name__
    if not isinstance(x, torch.Tensor) or x.shape != want.shape:
        got = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise AdapterError(f"verify='full': {name} gives logits {list(want.shape)}, the "
                           f"adapter's layers {got}")
    keep = mask.bool()
    a, b = want[keep].double(), x[keep].double()
    err = (a - b).abs().max().item()
    scale = max(a.abs().max().item(), b.abs().max().item(), 1e-30)
    if not err <= tolerance(x.dtype) * scale:
        raise AdapterError(
            f"verify='full': the adapter's layers give logits that differ from "
            f"{name}.forward by up to {err:.3g} (logits up to {scale:.3g}, {x.dtype}) on "
            f"{tokens} tokens: rotapipe would train this model wrong. Check "
            "wrapped.parts, pass layers_path/norm_path, or build the layers yourself "
            "and pass them to rotapipe.RoundPipe")
    return err


def check_peft(model: nn.Module) -> None:
    """A PEFT model must adapt modules inside the base model (LoRA, IA3, LoHa, ...), and
    its adapters must depend on nothing but each layer's input. Refused, because
    rotapipe runs the base model's layers and never the PeftModel's own forward:

    - prompt learning (prompt tuning, prefix tuning, P-tuning): that forward prepends
      virtual tokens or key/value prefixes, so training would ignore them;
    - what that forward computes from the whole batch and hands the adapted layers:
      X-LoRA's scalings (a classifier run on the base model's hidden states), Poly's task ids,
      activated LoRA's (``alora_invocation_tokens``) per-row offsets, ShadowPEFT's
      shadow state. Without them the layers would train the wrong function silently
      (X-LoRA: another loss, no gradient for the classifier; aLoRA: the adapter applied
      nowhere) or fail;
    - a loss term that forward adds: AdaLoRA's orthogonality penalty
      (``orth_reg_weight > 0`` with a task type)."""
    configs = getattr(model, "peft_config", None) or {}
    # With a task type (PeftModelForCausalLM) the tuner's forward runs (AdaLoRA's adds
    # to the loss); a plain PeftModel runs the base model's.
    plain = getattr(type(model), "forward", None) is _plain_peft_forward()
    for name, cfg in configs.items():
        kind = getattr(cfg, "peft_type", None)
        kind = getattr(kind, "value", kind) or type(cfg).__name__
        why = _peft_refusal(cfg, str(kind), tuner_forward=not plain)
        if why is not None:
            raise AdapterError(f"PEFT adapter {name!r} is {kind}{why}")


_OUTSIDE = (": rotapipe pipelines the base model's layers and never runs the PeftModel's "
            "own forward, which computes {what} and hands it to the adapted layers, so "
            "training would compute another function. Use an adapter that depends on each "
            "layer's input only ({use}, IA3Config, LoHaConfig, ...)")


def _plain_peft_forward():
    peft = sys.modules.get("peft")      # imported: the model is a PeftModel
    return None if peft is None else peft.PeftModel.forward


def _peft_refusal(cfg, kind: str, tuner_forward: bool = True) -> str | None:
    """Why adapter config ``cfg`` of PEFT type ``kind`` cannot train (the message after
    the type), or ``None``. ``tuner_forward``: the PeftModel runs the tuner's forward."""
    if getattr(cfg, "is_prompt_learning", False):
        return (", prompt learning: its virtual tokens are added by the PeftModel's "
                "forward, outside the base model's layers that rotapipe pipelines, so "
                "training would ignore them and compute another loss. Use an adapter "
                "inside the layers (peft.LoraConfig, IA3Config, LoHaConfig, ...)")
    if kind == "XLORA":
        return _OUTSIDE.format(what="the adapters' scalings (a classifier run on the "
                               "base model's hidden states)",
                               use="one LoRA adapter: peft.LoraConfig")
    if kind == "POLY":
        return _OUTSIDE.format(what="the routing of each sample from its task_ids",
                               use="one LoRA adapter: peft.LoraConfig")
    if kind == "SHADOW":
        return _OUTSIDE.format(what="a shadow state (its own shadow network run on the "
                               "inputs, advanced block by block)",
                               use="peft.LoraConfig")
    weight = getattr(cfg, "orth_reg_weight", 0) or 0
    if kind == "ADALORA" and tuner_forward and weight > 0:
        # A term of every layer's weights, which the loss in the last layer cannot add.
        return (f" with orth_reg_weight={weight} and a task type: the PeftModel's forward "
                "adds that times the orthogonality penalty of every lora_A and lora_B to "
                "the loss, which rotapipe's loss (the cross-entropy, in the last layer) "
                "would leave out, training other gradients. Use peft.AdaLoraConfig("
                "orth_reg_weight=0.0, ...) to train without the penalty")
    if getattr(cfg, "alora_invocation_tokens", None) is not None:
        return (" with alora_invocation_tokens (activated LoRA)" + _OUTSIDE.format(
            what="each row's adapter offset from the invocation tokens in input_ids",
            use="peft.LoraConfig without alora_invocation_tokens"))
    return None


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _clone_path(root: nn.Module, path: str, leaf: nn.Module) -> nn.Module:
    """A shallow clone of ``root`` whose submodule at dotted ``path`` is ``leaf``."""
    if not path:
        return leaf
    head, _, rest = path.partition(".")
    child = root._modules[head]
    return shallow_clone(root, {head: _clone_path(child, rest, leaf)})
