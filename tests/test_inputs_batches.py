"""What a training call does with the batch it is given, against plain PyTorch.

- A batch tensor that requires grad (an input made by a module outside the pipeline, a
  soft prompt, labels from a teacher run with grad on) is refused in the caller's
  thread before anything runs: the pipeline never backpropagates into its batch, so
  plain PyTorch's gradient for it would be lost without a word.
- ``loss_weight`` may count with NumPy (``(labels.numpy() != -100).sum()`` is a NumPy
  integer): the gradient is the token mean over the whole batch, as in plain PyTorch.
- A tokenizer's ``BatchEncoding`` (a mapping PyTorch's pytree does not open) trains and
  evaluates as its dict, equal to the Hugging Face model's own loss, gradients and logits.
- A layer output whose first tensor is not the activation is named as such.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

import rotapipe
from models import emulated, tiny_transformer, token_batch
from test_inputs import assert_nothing_ran, raises_in_caller

RTOL, ATOL = 1e-5, 1e-6


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 4))


def assert_like_plain(got: float, want: torch.Tensor, params, ref_params) -> None:
    """The call's loss and every gradient equal plain PyTorch's, element by element."""
    assert got == pytest.approx(want.item(), rel=RTOL, abs=ATOL)
    for i, (p, q) in enumerate(zip(params, ref_params)):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL, msg=f"param {i}")


def _grad_inputs():
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    return x.clone().requires_grad_(), torch.randn(6, 4)


def _made_inputs():
    scale = torch.ones(8, requires_grad=True)        # e.g. a module outside the pipeline
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    return (x, x * scale), torch.randn(6, 4)


def _teacher_labels():
    teacher = nn.Linear(8, 4)                         # run with grad on
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    return x, {"target": teacher(x)}


@pytest.mark.parametrize("make, match", [
    (_grad_inputs, r"inputs leaf 0 requires grad: rotapipe does not backpropagate into "
                   r"the inputs.*layer 0 of the pipeline, or pass it \.detach\(\)ed"),
    (_made_inputs, r"inputs leaf 1 requires grad"),
    (_teacher_labels, r"labels leaf 0 requires grad: .*torch\.no_grad\(\) .*"
                      r"\.detach\(\)ed"),
], ids=["leaf-input", "input-made-with-grad", "teacher-labels"])
def test_a_batch_that_requires_grad_is_refused_before_anything_runs(make, match):
    def loss(out, y):
        return nn.functional.mse_loss(out, y["target"] if isinstance(y, dict) else y)

    first = _First()
    with rotapipe.RoundPipe([_First(), *mlp()], loss, config=emulated(2, 3)) as pipe:
        inputs, labels = make()
        with raises_in_caller(rotapipe.InputError, match):
            pipe.forward_backward(inputs, labels)
        assert_nothing_ran(pipe)
        # Detached, the same batch trains as in plain PyTorch.
        ref = mlp()
        x, y = first(inputs).detach(), labels
        y = {"target": y["target"].detach()} if isinstance(y, dict) else y
        got = pipe.forward_backward(x, y)
        want = loss(ref(x), y)
        want.backward()
        assert_like_plain(got, want, pipe.parameters(), ref.parameters())


class _First(nn.Module):
    """Takes a tensor or the second tensor of a pair (the tuple-input case)."""

    def forward(self, x):
        return x[1] if isinstance(x, tuple) else x


def _token_loss(logits, labels):
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                       labels.reshape(-1), ignore_index=-100)


def test_loss_weight_may_count_with_numpy():
    x, y = token_batch(8, 6)
    y = y.clone()
    y[:3, 1:] = -100             # microbatch 0 counts far fewer tokens than the others
    model = tiny_transformer()
    ref = copy.deepcopy(model)
    with rotapipe.RoundPipe(model, _token_loss, config=emulated(2, 4),
                            loss_weight=lambda lab: (lab.numpy() != -100).sum()) as pipe:
        assert isinstance((y.numpy() != -100).sum(), np.integer)
        got = pipe.forward_backward(x, y)
    want = _token_loss(ref(x), y)
    want.backward()
    assert_like_plain(got, want, model.parameters(), ref.parameters())


def test_a_tokenizers_batch_encoding_trains_and_evaluates_as_its_dict():
    """``tokenizer(texts, return_tensors="pt", padding=True)`` gives a ``BatchEncoding``
    (a ``UserDict``, which PyTorch's pytree does not open): passed as it is, the batch
    trains and evaluates as the same dict would, equal to the model's own forward."""
    transformers = pytest.importorskip("transformers")
    import rotapipe.adapters
    from hf_models import assert_grads_equal, batch, clone, hf_backward, tiny

    ids, mask, labels = batch(6, 7)
    model = tiny("qwen3")
    ref = clone(model)
    want = hf_backward(ref, ids, mask, labels)
    encoding = transformers.BatchEncoding({"input_ids": ids, "attention_mask": mask})
    wrapped = rotapipe.adapters.wrap_hf(model, loss_chunk_tokens=5)
    with wrapped.pipe(emulated(2, 3)) as pipe:
        got = pipe.forward_backward(encoding, labels)
        assert got == pytest.approx(want, rel=RTOL, abs=ATOL)
        assert_grads_equal(model, ref)
        with torch.no_grad():
            logits = ref(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(pipe(encoding), logits, rtol=RTOL, atol=ATOL)


class _AuxFirst(nn.Module):
    """Returns ``{"aux": mean, "hidden": h}`` (``hidden_first``: the other key order)."""

    def __init__(self, hidden_first: bool):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.hidden_first = hidden_first

    def forward(self, x):
        h = self.lin(x if isinstance(x, torch.Tensor) else x["hidden"])
        aux = h.pow(2).mean()
        return {"hidden": h, "aux": aux} if self.hidden_first else {"aux": aux, "hidden": h}


class _Head(nn.Linear):
    def forward(self, d):
        return super().forward(d["hidden"])


@pytest.mark.parametrize("hidden_first", [False, True])
def test_an_output_whose_first_tensor_is_not_the_activation_is_named_so(hidden_first):
    """The activation is the first tensor of a layer's output: a layer that returns its
    hidden states after a 0-dim term is told to put them first (not that it changed
    the batch size, which it did not); in that order it trains."""
    torch.manual_seed(0)
    layers = [_AuxFirst(hidden_first), _AuxFirst(hidden_first), _Head(8, 4)]
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    with rotapipe.RoundPipe(layers, nn.functional.mse_loss, config=emulated(2, 2)) as pipe:
        if hidden_first:
            assert pipe.forward_backward(x, y) > 0
            return
        with pytest.raises(rotapipe.InputError, match=r"layer 0 \(_AuxFirst\) returned a "
                           r"0-dim tensor \(shape \(\)\) as the first of the 2 tensors of its "
                           r"output .*return the activation first"):
            pipe.forward_backward(x, y)


class _Pair(nn.Module):
    """Layer 0 taking ``({"x": features}, per-sample scale)``."""

    def forward(self, pair):
        features, scale = pair
        return features["x"] * scale[:, None]


def test_a_mapping_inside_the_batch_is_split_like_a_dict():
    """A ``UserDict`` nested in the inputs is split with the rest, not handed whole to
    every microbatch: the gradients are plain PyTorch's on the whole batch."""
    from collections import UserDict
    g = torch.Generator().manual_seed(2)
    x, scale, y = torch.randn(6, 8, generator=g), torch.rand(6, generator=g), \
        torch.randn(6, 4, generator=g)
    ref = mlp()
    want = nn.functional.mse_loss(ref(x * scale[:, None]), y)
    want.backward()
    with rotapipe.RoundPipe([_Pair(), *mlp()], nn.functional.mse_loss,
                            config=emulated(2, 3)) as pipe:
        got = pipe.forward_backward((UserDict(x=x), scale), y)
        assert_like_plain(got, want, pipe.parameters(), ref.parameters())
        with torch.no_grad():
            torch.testing.assert_close(pipe((UserDict(x=x), scale)),
                                       ref(x * scale[:, None]), rtol=RTOL, atol=ATOL)



@pytest.mark.parametrize("mode,grain", [("sync", "stage"), ("overlap", "layer"),
                                        ("stale", "stage")])
def test_a_microbatch_whose_labels_are_all_ignored_adds_nothing(mode, grain):
    """The user's own mean loss over no tokens is NaN; weighted by tokens, that
    microbatch counts for nothing in plain PyTorch's whole-batch mean: the call
    trains exactly as that mean does (it failed as a non-finite loss)."""
    x, y = token_batch(8, 6)
    y = y.clone()
    y[:2] = -100                                # microbatch 0 of 4: nothing to learn
    y[5, 2:] = -100
    model, ref = tiny_transformer(), tiny_transformer()
    with rotapipe.RoundPipe(model, _token_loss,
                            config=emulated(2, 4, optimizer_mode=mode, grain=grain),
                            loss_weight=lambda lab: int((lab != -100).sum())) as pipe:
        loss = pipe.forward_backward(x, y)
        pipe.flush()
        want = _token_loss(ref(x), y)
        want.backward()
        assert_like_plain(loss, want, model.parameters(), ref.parameters())


@pytest.mark.parametrize("mode", ["overlap", "stale"])
def test_a_pinned_input_refilled_after_the_call_returns_changes_nothing(mode, monkeypatch):
    """A loader's pinned buffer (on CUDA ``t.is_pinned()``; here reported pinned) is
    the caller's again once a pipelined call returns, before its backward re-reads
    the inputs: the call works on its own copy, as with pageable inputs."""
    from models import lm_loss
    from rotapipe.runtime.pinning import HostPinning
    x, y = token_batch(8, 6)
    other, _ = token_batch(8, 6, seed=7)
    buffer = x.clone()
    pinned = HostPinning.is_pinned
    monkeypatch.setattr(HostPinning, "is_pinned", lambda self, t: (
        t.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        or pinned(self, t)))
    model, ref = tiny_transformer(), tiny_transformer()
    with rotapipe.RoundPipe(model, lm_loss, config=emulated(2, 4, optimizer_mode=mode)) as pipe:
        pipe.forward_backward(buffer, y)
        buffer.copy_(other)                     # the loader refills its buffer
        pipe.flush()
        lm_loss(ref(x), y).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
