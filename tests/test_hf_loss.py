"""The chunked LM-head loss: value and gradients equal the unchunked Hugging Face loss
(``ForCausalLMLoss`` on full logits) for every chunk size, with and without bias,
soft-capping and logit scaling, in fp32 (rtol 1e-5, atol 1e-6); a head that is not a
plain ``nn.Linear`` (LoRA on the LM head) takes the generic autograd path."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rotapipe.adapters import LMHead, TokenCount, lm_loss, shift_labels
from rotapipe.adapters.loss import chunk_size, unchunked_lm_loss

RTOL, ATOL = 1e-5, 1e-6


def _case(bias=False, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(16, 50, bias=bias)
    h = torch.randn(3, 7, 16, requires_grad=True)
    labels = torch.randint(0, 50, (3, 7))
    labels[0, :3] = -100
    labels[2, 6] = -100
    return lin, h, labels


def _grads(loss, h, module):
    loss.backward()
    out = [h.grad.clone()] + [p.grad.clone() for p in module.parameters()]
    h.grad = None
    module.zero_grad()
    return out


@pytest.mark.parametrize("chunk", [1, 4, 7, 21, 1000])
@pytest.mark.parametrize("bias,softcap,divide", [(False, None, None), (True, None, None),
                                                 (False, 3.0, None), (True, None, 4.0)])
def test_chunked_equals_unchunked(chunk, bias, softcap, divide):
    lin, h, labels = _case(bias)
    head = LMHead(lin, softcap, divide)
    got = lm_loss(h, labels, head, chunk_tokens=chunk) * 0.37   # a loss weight
    g_got = _grads(got, h, lin)
    want = unchunked_lm_loss(head(h), labels) * 0.37
    g_want = _grads(want, h, lin)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


def test_generic_head_module_path():
    lin, h, labels = _case()
    wrapped = nn.Sequential(lin)          # not a plain nn.Linear: autograd per chunk
    head = LMHead(wrapped, softcap=2.0)
    assert head.linear() is None
    got = lm_loss(h, labels, head, chunk_tokens=4)
    g_got = _grads(got, h, wrapped)
    want = unchunked_lm_loss(head(h), labels)
    g_want = _grads(want, h, wrapped)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


def test_frozen_head_gets_no_gradient_and_hidden_still_does():
    lin, h, labels = _case()
    lin.weight.requires_grad_(False)
    lm_loss(h, labels, LMHead(lin), chunk_tokens=4).backward()
    assert lin.weight.grad is None and h.grad is not None


def test_hf_label_semantics():
    labels = torch.tensor([[5, 6, -100, 7], [-100, -100, -100, -100]])
    assert shift_labels(labels).tolist() == [[6, -100, 7, -100], [-100] * 4]
    assert TokenCount()(labels) == 2
    # A microbatch with nothing to count gives 0, not NaN (its loss weight is 0 too).
    lin, h, _ = _case()
    empty = torch.full((3, 7), -100)
    assert lm_loss(h, empty, LMHead(lin), chunk_tokens=4).item() == 0.0


def test_default_chunk_is_256_mib_of_fp32_logits():
    assert chunk_size(151936, None) == 256 * 2**20 // (4 * 151936)
    assert chunk_size(97, 5) == 5
