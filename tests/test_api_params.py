"""Parameters the pipeline cannot train as plain PyTorch would are refused up front.

The host keeps an fp32 master of every trained parameter, converted in place from the
user's tensor, and the workers move dense weight gradients only. A complex parameter
would lose its imaginary part and a float64 one would train in float32; a sparse
gradient (``nn.Embedding(sparse=True)``) failed deep in a weight-gradient download.
Each is refused with a message naming the parameter and the fix, before the model is
touched.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import rotapipe
from models import emulated

D = 4


class Scale(nn.Module):
    """``x * w`` with ``w`` of any dtype (complex: the magnitude of the product)."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, dtype=dtype))

    def forward(self, x):
        y = x.to(self.w.dtype) * self.w
        return y.abs() if y.is_complex() else y.to(x.dtype)


def mse(out, y):
    return ((out - y) ** 2).mean()


@pytest.mark.parametrize("dtype", [torch.complex64, torch.float64])
def test_a_parameter_an_fp32_master_cannot_hold_is_refused_untouched(dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), Scale(dtype), nn.Linear(D, D))
    before = model[1].w.detach().clone()
    with pytest.raises(rotapipe.ConfigError, match=rf"parameter 1\.w is {dtype}.*\.float\(\)"):
        rotapipe.RoundPipe(model, mse, config=emulated(2, 2))
    assert model[1].w.dtype == dtype and torch.equal(model[1].w.detach(), before)
    # Nothing was claimed: the fixed model wraps and trains.
    model[1].float() if dtype is torch.float64 else model[1].w.requires_grad_(False)
    with rotapipe.RoundPipe(model, mse, config=emulated(2, 2)) as pipe:
        assert pipe.forward_backward(torch.randn(4, D), torch.randn(4, D)) > 0


def test_a_half_precision_parameter_still_gets_an_fp32_master():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), Scale(torch.bfloat16), nn.Linear(D, D))
    before = model[1].w.detach().float()
    with rotapipe.RoundPipe(model, mse, config=emulated(2, 2)):
        assert model[1].w.dtype == torch.float32 and torch.equal(model[1].w.detach(), before)


class SparseLookup(nn.Module):
    """Sum of embedding rows, through the module or through ``F.embedding``."""

    def __init__(self, functional: bool):
        super().__init__()
        self.emb = nn.Embedding(20, D, sparse=not functional)
        self.functional = functional

    def forward(self, ids):
        if self.functional:
            return nn.functional.embedding(ids, self.emb.weight, sparse=True).sum(1)
        return self.emb(ids).sum(1)


def lookup_model(functional: bool) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(SparseLookup(functional), nn.Linear(D, D), nn.Linear(D, D))


def test_a_sparse_embedding_is_refused_at_construction():
    with pytest.raises(rotapipe.ConfigError, match=r"layer 0\.emb \(Embedding\) has "
                                                   r"sparse=True.*sparse=False"):
        rotapipe.RoundPipe(lookup_model(False), mse, config=emulated(2, 2))


def test_a_sparse_gradient_from_functional_code_is_named_and_changes_nothing():
    model = lookup_model(True)
    ids, y = torch.randint(0, 20, (8, 3)), torch.randn(8, D)
    with rotapipe.RoundPipe(model, mse, config=emulated(2, 2),
                            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1)) as pipe:
        before = {k: v.clone() for k, v in pipe.state_dict().items()}
        for _ in range(2):          # the pipeline stays usable: it fails the same way
            with pytest.raises(rotapipe.InputError,
                               match=r"parameter 0\.emb\.weight got a torch\.sparse_coo "
                                     r"gradient.*sparse=False") as failed:
                pipe.train_step(ids, y)
            assert isinstance(failed.value, rotapipe.WorkerError)
        assert all(p.grad is None for p in pipe.parameters())
        for k, v in pipe.state_dict().items():
            assert torch.equal(v, before[k]), k
