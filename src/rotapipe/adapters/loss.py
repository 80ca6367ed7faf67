"""Chunked LM head + cross-entropy: the causal-LM loss without [tokens x vocab] logits.

The head (final projection, plus any soft-capping or scaling of the logits) runs on
``chunk_tokens`` tokens at a time. Each chunk's logits live only long enough to give its
loss and its gradients, which the forward computes at once (the loss is always
backpropagated right after, in the fused tail stage) and the backward only scales by the
incoming gradient. For a plain ``nn.Linear`` head without logit transforms the gradient
``softmax - one_hot`` is built in place in the chunk's fp32 logits, so the working set is
about two chunks of fp32 logits (``benchmarks/chunked_loss_memory.py``) instead of about
three full [tokens x vocab] tensors; the gradient is the unchunked one up to the order
in which chunk contributions to the weight gradient are summed.

Loss semantics are Hugging Face's (``ForCausalLMLoss``): labels are shifted left by one
inside the loss, ``ignore_index`` (-100) positions do not count, and the loss is the mean
over the counted positions. Across microbatches the pipeline weights each microbatch by
its counted positions (:class:`TokenCount` as ``loss_weight``), so the result is the mean
over every counted token of the global batch, as one Hugging Face forward computes it.
:class:`CausalLMLoss` is a wrapped model's ``loss_fn``: that loss, plus an MoE model's
load-balancing loss over the whole batch (:mod:`.moe`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import InputError
from .errors import AdapterError
from .moe import MoESpec

__all__ = ["LMHead", "TokenCount", "CausalLMLoss", "shift_labels", "chunked_cross_entropy",
           "lm_loss", "DEFAULT_LOGITS_BYTES"]

DEFAULT_LOGITS_BYTES = 256 * 2**20
"""Default chunk size: as many tokens as fit 256 MiB of fp32 logits (about 440 tokens
for a 150K vocabulary)."""


class LMHead:
    """The output projection (as bound in the worker that runs it) with the model's
    logit transforms.

    ``module`` is the (bound) output-embedding module; ``softcap`` applies
    ``tanh(x / c) * c`` (Gemma 2/3 ``final_logit_softcapping``), ``divide`` applies
    ``x / d`` (Granite ``logits_scaling``), ``multiply`` applies ``x * m`` (Cohere
    ``logit_scale``), and ``fn`` is any other elementwise, differentiable transform
    (``wrap_hf(logits_fn=...)``), in that order, in the dtype the head computes in.
    """

    def __init__(self, module: nn.Module, softcap: float | None = None,
                 divide: float | None = None, multiply: float | None = None,
                 fn: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.module, self.softcap, self.divide = module, softcap, divide
        self.multiply, self.fn = multiply, fn

    @property
    def transforms(self) -> bool:
        """Whether the logits are transformed after the projection."""
        return any(v is not None for v in (self.softcap, self.divide, self.multiply,
                                           self.fn))

    def transform(self, logits: torch.Tensor) -> torch.Tensor:
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        if self.divide is not None:
            logits = logits / self.divide
        if self.multiply is not None:
            logits = logits * self.multiply
        if self.fn is not None:
            logits = self.fn(logits)
        return logits

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits for ``hidden`` (any leading shape)."""
        return self.transform(self.module(hidden))

    def linear(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """``(weight, bias)`` when the head is a plain ``nn.Linear`` (the fast path:
        explicit matmuls, weight gradient accumulated in place); else ``None``."""
        m = self.module
        if type(m) is nn.Linear and not (m._forward_hooks or m._forward_pre_hooks):
            return m.weight, m.bias
        return None

    def parameters(self) -> list[torch.Tensor]:
        return list(self.module.parameters())


def shift_labels(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Targets of every position: the next label, ``ignore_index`` after the last
    (``ForCausalLMLoss``'s pad-and-shift)."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


class TokenCount:
    """``loss_weight`` for :class:`rotapipe.RoundPipe`: the positions of a microbatch the
    causal-LM loss averages over (shifted labels that are not ``ignore_index``). Runs in
    the caller's thread before the call starts, so it also checks the labels: integer
    token ids shaped ``[batch, seq]``, each in ``[0, vocab)`` (when ``vocab`` is given)
    or ``ignore_index``."""

    def __init__(self, ignore_index: int = -100, vocab: int | None = None):
        self.ignore_index = ignore_index
        self.vocab = vocab

    def __call__(self, labels: torch.Tensor) -> int:
        if not isinstance(labels, torch.Tensor) or labels.is_floating_point() or \
                labels.is_complex() or labels.dtype is torch.bool:
            what = labels.dtype if isinstance(labels, torch.Tensor) else \
                type(labels).__name__
            raise InputError(f"labels are {what}: pass integer token ids (a LongTensor "
                             f"shaped like input_ids, {self.ignore_index} where no loss "
                             "counts)")
        if labels.dim() == 0:
            raise InputError("labels are a 0-dim tensor: pass one label per input token "
                             "(shaped like input_ids)")
        if labels.dim() != 2:
            # Else [batch, seq, 1] counts nothing (labels[..., 1:] is empty) and the
            # call fails as "are all labels ignored?".
            raise InputError(f"labels have shape {list(labels.shape)} in a microbatch: "
                             "pass labels shaped [batch, seq] like input_ids (unshifted, "
                             f"{self.ignore_index} where no loss counts); for one "
                             "sequence add the batch dimension (input_ids[None], "
                             "labels[None])")
        if self.vocab is not None and labels.numel():
            bad = (labels != self.ignore_index) & ((labels < 0) | (labels >= self.vocab))
            if bad.any():
                raise InputError(f"labels hold {int(labels[bad][0])}, outside the "
                                 f"vocabulary [0, {self.vocab}) and not ignore_index="
                                 f"{self.ignore_index}: pass token ids of this model's "
                                 "tokenizer")
        return int((labels[..., 1:] != self.ignore_index).sum())


def chunk_size(vocab: int, chunk_tokens: int | None) -> int:
    if chunk_tokens is not None:
        return max(1, int(chunk_tokens))
    return max(16, DEFAULT_LOGITS_BYTES // (4 * max(vocab, 1)))


class _ChunkedCE(torch.autograd.Function):
    """Sum of cross-entropy over tokens, head applied chunk by chunk.

    ``forward(hidden [N, H], targets [N], head, chunk, ignore_index, *params)`` returns
    an fp32 scalar; ``params`` are the head's parameters (gradients flow to them).
    Gradients (w.r.t. ``hidden`` and the head's ``params``) are computed in forward
    chunk by chunk and scaled by the incoming gradient in backward.
    """

    @staticmethod
    def forward(ctx, hidden, targets, head: LMHead, chunk: int, ignore_index: int, *params):
        want_h = ctx.needs_input_grad[0]
        want_p = [ctx.needs_input_grad[5 + i] for i in range(len(params))]
        grads = want_h or any(want_p)
        lin = head.linear()
        g_h = torch.zeros_like(hidden) if want_h else None
        g_p: list[torch.Tensor | None] = [None] * len(params)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for s in range(0, hidden.shape[0], chunk):
            h, t = hidden[s:s + chunk], targets[s:s + chunk]
            if lin is not None:
                loss, gh, gps = _linear_chunk(h, t, head, lin, ignore_index, want_h,
                                              want_p, g_p, grads)
            else:
                loss, gh, gps = _module_chunk(h, t, head, params, ignore_index, want_h,
                                              want_p, grads)
            total += loss
            if gh is not None:
                g_h[s:s + chunk] = gh
            for i, g in enumerate(gps):
                if g is not None:
                    g_p[i] = g if g_p[i] is None else g_p[i].add_(g)
        ctx.grads = (g_h, g_p)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        g_h, g_p = ctx.grads
        ctx.grads = None
        # In place (the buffers are ours), by an fp32 scalar: a bf16/fp16 gradient is
        # scaled in fp32 and rounded once, with no second [V, H] buffer.
        scale = grad_out.detach().to(torch.float32)
        out_h = None if g_h is None else g_h.mul_(scale)
        out_p = [None if g is None else g.mul_(scale) for g in g_p]
        return (out_h, None, None, None, None, *out_p)


def _ce_sum(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    # As ForCausalLMLoss: upcast the logits, then sum over the counted positions.
    return F.cross_entropy(logits.float(), targets, ignore_index=ignore_index,
                           reduction="sum")


def _ce_and_grad(raw: torch.Tensor, t: torch.Tensor, head: LMHead, ignore_index: int,
                 grads: bool):
    """Cross-entropy sum over one chunk and its gradient w.r.t. the head's raw output
    ``raw`` [C, V] (which this function may overwrite).

    Without logit transforms the gradient ``softmax - one_hot`` is built in place in the
    fp32 logits (``raw`` itself in fp32): one [C, V] buffer plus the log-sum-exp's
    temporary. With soft-capping or scaling, autograd runs through the transform (as
    the model would), keeping a few [C, V] buffers.
    """
    if head.transforms:
        if not grads:
            return _ce_sum(head.transform(raw), t, ignore_index), None
        with torch.enable_grad():
            r = raw.detach().requires_grad_()
            loss = _ce_sum(head.transform(r), t, ignore_index)
            (g,) = torch.autograd.grad(loss, r)
        return loss.detach(), g
    valid = t != ignore_index
    safe = torch.where(valid, t, torch.zeros_like(t))
    logits = raw.float()                                   # as ForCausalLMLoss
    lse = torch.logsumexp(logits, dim=-1)                  # [C]
    picked = logits.gather(1, safe[:, None]).squeeze(1)    # [C]
    loss = torch.where(valid, lse - picked, torch.zeros_like(lse)).sum()
    if not grads:
        return loss, None
    g = logits.sub_(lse[:, None]).exp_()                   # softmax, in place
    g.scatter_add_(1, safe[:, None], -valid[:, None].to(g.dtype))
    g.mul_(valid[:, None])
    return loss, g.to(raw.dtype)


def _linear_chunk(h, t, head: LMHead, lin, ignore_index, want_h, want_p, acc, grads):
    """Plain ``nn.Linear`` head: logits by one matmul, then the loss and its gradient
    (:func:`_ce_and_grad`), then the two matmuls of the linear's backward written out
    (as autograd would), the weight gradient accumulated in place into ``acc`` (no
    [V, H] temporary per chunk)."""
    weight, bias = lin
    with torch.no_grad():
        raw = F.linear(h, weight, bias)                   # [C, V]
        loss, g_raw = _ce_and_grad(raw, t, head, ignore_index, grads)
        del raw
        params = head.parameters()
        gps: list[torch.Tensor | None] = [None] * len(params)
        if g_raw is None:
            return loss, None, gps
        for i, p in enumerate(params):
            if not want_p[i]:
                continue
            if p is weight:
                if acc[i] is None:
                    acc[i] = g_raw.t().mm(h)              # [V, H]
                else:
                    acc[i].addmm_(g_raw.t(), h)
            elif p is bias:
                gps[i] = g_raw.sum(0)
        gh = g_raw.mm(weight) if want_h else None         # [C, H]
    return loss, gh, gps


def _module_chunk(h, t, head: LMHead, params, ignore_index, want_h, want_p, grads):
    """Any other head module (LoRA on the LM head, ...): autograd through the module."""
    if not grads:
        with torch.no_grad():
            return _ce_sum(head(h), t, ignore_index), None, [None] * len(params)
    with torch.enable_grad():
        hc = h.detach().requires_grad_(want_h)
        loss = _ce_sum(head(hc), t, ignore_index)
        inputs = ([hc] if want_h else []) + [p for p, w in zip(params, want_p) if w]
        got = list(torch.autograd.grad(loss, inputs, allow_unused=True)) if inputs else []
    gh = got.pop(0) if want_h else None
    gps = [got.pop(0) if w else None for w in want_p]
    return loss.detach(), gh, gps


def chunked_cross_entropy(hidden: torch.Tensor, targets: torch.Tensor, head: LMHead, *,
                          chunk_tokens: int | None = None,
                          ignore_index: int = -100) -> torch.Tensor:
    """Sum over tokens of ``cross_entropy(head(hidden), targets)`` (fp32 scalar), with
    the head applied to ``chunk_tokens`` tokens at a time.

    ``hidden`` is ``[..., H]`` and ``targets`` the matching ``[...]`` (already shifted);
    positions equal to ``ignore_index`` add nothing.
    """
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1).to(h.device)
    params = head.parameters()
    vocab = _vocab(head)
    return _ChunkedCE.apply(h, t, head, chunk_size(vocab, chunk_tokens), ignore_index,
                            *params)


def lm_loss(hidden: torch.Tensor, labels: torch.Tensor, head: LMHead | Callable, *,
            chunk_tokens: int | None = None, ignore_index: int = -100) -> torch.Tensor:
    """Hugging Face's causal-LM loss (shift, ignore ``ignore_index``, mean over counted
    positions), computed chunk by chunk. A microbatch with no counted position gives 0
    (its pipeline weight is 0 too), not NaN."""
    if not isinstance(head, LMHead):
        head = LMHead(head)
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise InputError(f"labels have shape {tuple(labels.shape)} but the inputs are "
                         f"{tuple(hidden.shape[:-1])} tokens: pass one label per input "
                         "token (the loss shifts them; unshifted, like input_ids)")
    targets = shift_labels(labels, ignore_index)
    total = chunked_cross_entropy(hidden, targets, head, chunk_tokens=chunk_tokens,
                                  ignore_index=ignore_index)
    count = (targets != ignore_index).sum().to(total.device)
    return total / count.clamp(min=1).to(total.dtype)


def head_vocab(module: nn.Module) -> int | None:
    """An LM head's vocabulary size: its weight's rows (a linear or tied head), else its
    ``out_features``; ``None`` when neither says."""
    w = getattr(module, "weight", None)
    if isinstance(w, torch.Tensor) and w.dim() == 2:
        return int(w.shape[0])
    out = getattr(module, "out_features", None)
    return int(out) if isinstance(out, int) else None


def _vocab(head: LMHead) -> int:
    return head_vocab(head.module) or 32_000


def unchunked_lm_loss(logits: torch.Tensor, labels: torch.Tensor,
                      ignore_index: int = -100) -> torch.Tensor:
    """The reference: ``ForCausalLMLoss`` on full logits (tests and benchmarks)."""
    targets = shift_labels(labels, ignore_index).reshape(-1)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets,
                           ignore_index=ignore_index)


class CausalLMLoss:
    """``loss_fn`` of a wrapped model: Hugging Face's causal-LM loss (chunked), plus
    ``coef * load-balancing loss`` for MoE models whose config enables it (then the
    pipeline must pass ``tail_context=batch_context``; without it a call fails)."""

    def __init__(self, chunk_tokens: int | None = None, ignore_index: int = -100,
                 moe: MoESpec | None = None):
        self.chunk_tokens, self.ignore_index, self.moe = chunk_tokens, ignore_index, moe

    @property
    def tail_context_needed(self) -> str | None:
        """Why the pipeline must pass ``tail_context=self.batch_context`` (``None`` when
        it need not): :class:`rotapipe.RoundPipe` refuses to be built without it."""
        if self.moe is None:
            return None
        return ("this MoE model's loss adds the load-balancing loss over the whole batch, "
                "which needs the pipeline's tail_context (the routing counts of every "
                "microbatch): build the pipeline with wrapped.pipe(config) or "
                "RoundPipe(**wrapped.pipe_kwargs(), config=...) (or pass "
                "tail_context=wrapped.loss_fn.batch_context), or wrap_hf(model, "
                "moe_aux_loss=False) to train without that loss")

    def __call__(self, out, labels: torch.Tensor, batch=None):
        loss = lm_loss(out.hidden, labels, out.head, chunk_tokens=self.chunk_tokens,
                       ignore_index=self.ignore_index)
        if self.moe is None or out.moe is None:
            return loss
        if batch is None:
            # Without the pipeline's tail_context each microbatch would balance its own
            # rows only: another loss, silently, with more than one microbatch. The
            # pipeline refuses it when built (tail_context_needed); a backstop.
            raise AdapterError(self.tail_context_needed)
        # Whole-batch load balancing: the counts T and rows R of every microbatch (from
        # ``batch_context``) with this microbatch's probability sums P, which carry the
        # gradient. Summed over microbatches: E * sum_e (T_e / R) * (P_e / R), exactly
        # Hugging Face's loss on the whole batch. Returned unweighted (second term).
        tokens, rows, per_mb_rows = batch
        _, probs, my_rows = out.moe
        if not any(torch.equal(my_rows.cpu(), r) for r in per_mb_rows):
            raise AdapterError("the fused tail holds MoE blocks, so the whole-batch "
                               "load-balancing loss cannot see their routing before the "
                               "tail runs: use tail_layers=1 (the default)")
        tokens, rows = tokens.to(probs.device), rows.to(probs.device)
        aux = torch.sum((tokens / rows) * (probs / rows)) * self.moe.num_experts
        return loss, self.moe.coef * aux

    def batch_context(self, tail_inputs: list, labels: list):
        """``tail_context`` of the pipeline: the MoE counts summed over the batch."""
        accs = [x[1] if isinstance(x, tuple) and len(x) == 2 else None for x in tail_inputs]
        if any(a is None for a in accs):
            raise AdapterError("the fused tail's input carries no MoE routing counts: "
                               "keep at least one decoder block before the tail")
        tokens = sum(a[0] for a in accs)
        rows = sum(a[2] for a in accs)
        return tokens.detach(), rows.detach(), [a[2].detach() for a in accs]
