"""Bad input and bad configuration get a clear error before any work starts.

Each error is raised in the caller's thread (not as a :class:`rotapipe.WorkerError`),
is an :class:`rotapipe.InputError` or :class:`rotapipe.ConfigError`, and its message
names the problem and the fix. The one exception is a loss that is not a scalar: only
the worker running the fused tail sees the loss, so it comes back as a ``WorkerError``
that is also an ``InputError``, and the model is unchanged.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import rotapipe
from models import VOCAB, emulated, lm_loss, tiny_transformer, token_batch


@pytest.fixture
def pipe():
    with rotapipe.RoundPipe(tiny_transformer(), lm_loss, config=emulated(2, 4)) as p:
        yield p


def assert_nothing_ran(pipe: rotapipe.RoundPipe) -> None:
    """No action ran: no weights were ever uploaded, no call counted, no gradient."""
    assert pipe.peak_memory() == [0] * len(pipe.devices)
    assert pipe.calls == 0
    assert all(p.grad is None for p in pipe.parameters())


def raises_in_caller(kind, match):
    """``pytest.raises`` for an error of ``kind`` that is *not* a worker's error."""
    class _Check:
        def __enter__(self):
            self._ctx = pytest.raises(kind, match=match)
            self.info = self._ctx.__enter__()
            return self.info

        def __exit__(self, *exc):
            handled = self._ctx.__exit__(*exc)
            assert not isinstance(self.info.value, rotapipe.WorkerError), self.info.value
            return handled
    return _Check()


# -- batches -----------------------------------------------------------------------------

def test_batch_smaller_than_microbatch_count(pipe):
    x, y = token_batch(3, 5)
    with raises_in_caller(rotapipe.InputError,
                          r"3 samples but config.microbatches=4.*lower microbatches"):
        pipe.forward_backward(x, y)
    assert_nothing_ran(pipe)
    x, y = token_batch(4, 5)          # the same pipeline takes a batch that fits
    pipe.forward_backward(x, y)


def test_inputs_and_labels_disagree_on_batch_size(pipe):
    x, _ = token_batch(8, 5)
    _, y = token_batch(6, 5)
    with raises_in_caller(rotapipe.InputError,
                          r"inputs hold 8 samples but labels hold 6.*one label row"):
        pipe.forward_backward(x, y)
    assert_nothing_ran(pipe)


class PairEmbed(nn.Module):
    """Layer 0 taking a tuple ``(token ids (B, T), per-sample scale (B,))``."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)

    def forward(self, pair):
        ids, scale = pair
        return self.emb(ids) * scale[:, None, None]


def pair_model() -> nn.Sequential:
    body = tiny_transformer()
    return nn.Sequential(PairEmbed(), *list(body)[1:])


def test_tuple_inputs_whose_tensors_disagree():
    x, y = token_batch(8, 5)
    with rotapipe.RoundPipe(pair_model(), lm_loss, config=emulated(2, 2)) as pipe:
        pipe.forward_backward((x, torch.ones(8)), y)          # agreeing tuple: fine
        calls = pipe.calls
        pipe.reset_peak_memory()
        with raises_in_caller(rotapipe.InputError, r"inputs tensors disagree on the batch "
                              r"size \(leaf 0: 8, leaf 1: 6\).*same dimension 0"):
            pipe.forward_backward((x, torch.ones(6)), y)
        with raises_in_caller(rotapipe.InputError, r"labels tensors disagree"):
            pipe.forward_backward((x, torch.ones(8)), {"a": y, "b": y[:7]})
        assert pipe.calls == calls and pipe.peak_memory() == [0, 0]


@pytest.mark.parametrize("inputs, match", [
    (torch.tensor(3), r"leaf 0 is a 0-dim tensor.*batch dimension 0"),
    ((1, "a"), r"holds no tensor: pass.*batch in dimension 0"),
    (np.zeros((4, 5), dtype=np.int64),
     r"holds no tensor \(it holds a numpy.ndarray: convert it with torch.as_tensor\)"),
], ids=["zero-dim", "no-tensor", "numpy"])
def test_inputs_without_a_batch_dimension(pipe, inputs, match):
    with raises_in_caller(rotapipe.InputError, match):
        pipe.forward_backward(inputs, token_batch(4, 5)[1])
    assert_nothing_ran(pipe)


# -- the loss ------------------------------------------------------------------------------

def per_token_loss(logits, labels):
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1),
                                       reduction="none")


def test_loss_that_is_not_a_scalar_is_reported_and_changes_nothing():
    model = tiny_transformer()
    with rotapipe.RoundPipe(model, per_token_loss, config=emulated(2, 2)) as pipe:
        before = {k: v.clone() for k, v in pipe.state_dict().items()}
        x, y = token_batch(4, 5)
        with pytest.raises(rotapipe.InputError) as info:
            pipe.forward_backward(x, y)
        err = info.value
        assert isinstance(err, rotapipe.WorkerError)
        msg = str(err)
        assert "the loss function returned (10,), not a scalar" in msg, msg
        assert "reduce it (e.g. .mean())" in msg
        assert err.action == "FT:T:m0" and ">>FT:T:m0<<" in msg
        assert pipe.calls == 0
        assert all(p.grad is None for p in pipe.parameters())
        assert all(torch.equal(v, pipe.state_dict()[k]) for k, v in before.items())
        assert all(d.memory_in_use() == 0 for d in pipe.devices)


# -- the model ------------------------------------------------------------------------------

@pytest.mark.parametrize("layers", [nn.Sequential(), [], nn.ModuleList()],
                         ids=["empty-sequential", "empty-list", "empty-modulelist"])
def test_model_with_zero_layers(layers):
    with raises_in_caller(rotapipe.ConfigError, r"zero layers.*at least one nn.Module"):
        rotapipe.RoundPipe(layers, lm_loss, config=emulated(2, 2))


def test_model_that_is_not_a_list_of_layers():
    with raises_in_caller(rotapipe.ConfigError, r"single Linear.*nn.Sequential or a list"):
        rotapipe.RoundPipe(nn.Linear(2, 2), lm_loss, config=emulated(1, 1))
    with raises_in_caller(rotapipe.ConfigError, r"layer 1 is a builtin_function_or_method, not an nn.Module: wrap"):
        rotapipe.RoundPipe([nn.Linear(2, 2), torch.relu], lm_loss, config=emulated(1, 1))


def test_model_with_a_parameter_on_the_wrong_device():
    model = tiny_transformer()
    model[2].up.weight = nn.Parameter(torch.empty(40, 16, device="meta"))
    with raises_in_caller(rotapipe.ConfigError, r"layer 2 holds up.weight on meta.*\.cpu\(\)"):
        rotapipe.RoundPipe(model, lm_loss, config=emulated(2, 2))
    model = tiny_transformer(buffers=True)
    model[3].bn.running_mean = torch.zeros(16, device="meta")
    with raises_in_caller(rotapipe.ConfigError, r"layer 3 holds bn.running_mean on meta"):
        rotapipe.RoundPipe(model, lm_loss, config=emulated(2, 2))


def test_inputs_or_labels_on_the_wrong_device(pipe):
    x, y = token_batch(4, 5)
    with raises_in_caller(rotapipe.InputError, r"inputs leaf 0 is on meta.*pass CPU tensors"):
        pipe.forward_backward(x.to("meta"), y)
    with raises_in_caller(rotapipe.InputError, r"labels leaf 0 is on meta.*pass CPU tensors"):
        pipe.forward_backward(x, y.to("meta"))
    with raises_in_caller(rotapipe.InputError, r"inputs leaf 0 is on meta"):
        pipe(x.to("meta"))
    assert_nothing_ran(pipe)


# -- configuration -----------------------------------------------------------------------

@pytest.mark.parametrize("kw, match", [
    ({"microbatches": 0}, r"microbatches=0: use an int in \[1, 65,536\]"),
    ({"microbatches": 2.5}, r"microbatches=2.5: use an int in \[1, 65,536\]"),
    ({"grain": "foo"}, r"grain='foo' is invalid: use one of 'stage', 'layer'"),
    ({"backend": "tpu"}, r"backend='tpu' is invalid: use one of 'auto', 'cuda', 'emulated'"),
    ({"workers": 0}, r"workers=0: use an int in \[1, 256\] \(one worker per GPU.* or None"),
    ({"forward_stages": 0}, r"forward_stages=0: use a positive int or None"),
    ({"backward_stages": -2}, r"backward_stages=-2"),
    ({"tail_layers": 0}, r"tail_layers=0: use a positive int: the fused tail needs at least "
                         r"one layer"),
    ({"device_memory": 0}, r"device_memory=0: use a whole number of bytes > 0 .* or None"),
    ({"timeout_s": 0}, r"timeout_s=0: use a finite number of seconds > 0"),
])
def test_bad_config_values(kw, match):
    with raises_in_caller(rotapipe.ConfigError, match):
        rotapipe.PipeConfig(**kw)


@pytest.mark.parametrize("kw, match", [
    ({"compute_dtype": "int8"}, r"compute_dtype='int8' is not supported: use one of "
                                r"'float32', 'bfloat16' or 'float16'"),
    ({"compute_dtype": torch.int8}, r"compute_dtype=torch.int8 is not supported"),
    ({"compute_dtype": torch.float64}, r"compute_dtype=torch.float64 is not supported"),
    ({"loss_scale": -1.0}, r"loss_scale=-1.0: use 'dynamic', a finite number > 0, or None"),
    ({"loss_scale": "auto"}, r"loss_scale='auto': use 'dynamic'"),
    ({"init_scale": 0}, r"init_scale=0: use a finite number > 0"),
])
def test_bad_precision_values(kw, match):
    with raises_in_caller(rotapipe.ConfigError, match):
        rotapipe.PrecisionConfig(**kw)


def test_config_is_frozen_and_errors_are_value_errors():
    config = rotapipe.PipeConfig()
    with pytest.raises(AttributeError):
        config.microbatches = 3                       # type: ignore[misc]
    assert issubclass(rotapipe.ConfigError, ValueError)
    assert issubclass(rotapipe.InputError, ValueError)


def test_bad_wiring_of_loss_optimizer_and_plan():
    with raises_in_caller(rotapipe.ConfigError, r"loss_fn must be callable, got str"):
        rotapipe.RoundPipe(tiny_transformer(), "mse", config=emulated(1, 1))
    with raises_in_caller(rotapipe.ConfigError, r"plan covers 3 layers but the model has 6"):
        rotapipe.RoundPipe(tiny_transformer(), lm_loss, config=emulated(1, 1),
                           plan=rotapipe.even_plan(3, 1, 1))
    with rotapipe.RoundPipe(tiny_transformer(), lm_loss, config=emulated(1, 1)) as pipe:
        with raises_in_caller(rotapipe.ConfigError, r"no optimizer.*attach_optimizer"):
            pipe.step()
        foreign = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
        with raises_in_caller(rotapipe.ConfigError, r"not a trainable parameter.*"
                              r"pipe.parameters\(\)"):
            pipe.attach_optimizer(foreign)
        other = rotapipe.roundpipe_schedule(rotapipe.even_plan(6, 2, 2), 1, 1)
        with raises_in_caller(rotapipe.ConfigError, r"schedule is for 1 workers and plan"):
            pipe.use_schedule(other)
        assert_nothing_ran(pipe)
