"""Train/eval flags between training calls: ``pipe.train()`` / ``pipe.eval()`` set the
mode of the next call in every optimizer mode, also while earlier calls still drain
(``overlap``), against plain PyTorch doing the same, element by element; and what an
evaluation between pipelined calls runs on and returns."""

from __future__ import annotations

import copy

import pytest
import torch

import rotapipe
from models import emulated, lm_loss, reference_forward_backward, tiny_transformer, token_batch

RTOL, ATOL = 1e-5, 1e-6
EVAL_CALLS = (2, 3)          # the calls made after pipe.eval(), before pipe.train()


def reference(model, steps: int):
    """Plain PyTorch, dropout drawn as the pipeline draws it (``layer_seed``), one SGD
    step per call; eval mode for :data:`EVAL_CALLS`."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for call in range(steps):
        model.train(call not in EVAL_CALLS)
        losses.append(reference_forward_backward(model, *token_batch(8, 6, seed=call), 2,
                                                 call))
        opt.step()
        opt.zero_grad()
    return losses


def _dropout_p(model, p: float) -> None:
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = p


@pytest.mark.parametrize("through", ["pipe", "model", "attribute"])
@pytest.mark.parametrize("mode", ["sync", "overlap"])
def test_mode_switch_between_pipelined_calls_reaches_the_next_call(mode, through):
    """Dropout 0.3; ``eval()`` after call 1 and ``train()`` after call 3, with no
    evaluation in between, through the pipeline or on the user's own model (the wrapped
    layers), or the dropout turned off by attribute (``dropout.p = 0``, which the
    workers' copies follow too): calls 2 and 3 run without dropout. In ``overlap`` the
    runner is never idle between calls, and the workers' copies of the layers used to
    keep the mode of the first call for good (the loss of call 2 was 3.7% off, the
    weights 7e-3)."""
    model = tiny_transformer(dropout=0.3, widths=(24, 40))
    ref = copy.deepcopy(model)
    want = reference(ref, 6)
    with rotapipe.RoundPipe(model, lm_loss, config=emulated(2, 2, optimizer_mode=mode),
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.5)) as pipe:
        target = pipe if through == "pipe" else model
        got = []
        for call in range(6):
            if call == EVAL_CALLS[0]:
                if through == "attribute":
                    _dropout_p(model, 0.0)
                else:
                    assert target.eval() is target
            if call == EVAL_CALLS[-1] + 1:
                if through == "attribute":
                    _dropout_p(model, 0.3)
                else:
                    target.train()
            got.append(pipe.train_step(*token_batch(8, 6, seed=call)))
        state = pipe.state_dict()
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=RTOL, atol=ATOL)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(state[k], v, rtol=RTOL, atol=ATOL, msg=k)


def test_mode_switch_keeps_the_call_in_flight_in_its_own_mode():
    """A call still draining when ``pipe.eval()`` is called finishes in train mode (its
    backward recomputes with the dropout its forward drew): equal to plain PyTorch."""
    model = tiny_transformer(dropout=0.3, widths=(24, 40))
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    want = reference_forward_backward(ref.train(), *token_batch(8, 6, seed=0), 2, 0)
    opt.step()
    ref.eval()
    with torch.no_grad():
        want_eval = ref(token_batch(8, 6, seed=9)[0])
    cfg = emulated(2, 2, optimizer_mode="overlap")
    with rotapipe.RoundPipe(model, lm_loss, config=cfg,
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.5)) as pipe:
        got = pipe.train_step(*token_batch(8, 6, seed=0))
        got_eval = pipe.eval()(token_batch(8, 6, seed=9)[0])
    assert got == pytest.approx(want, rel=RTOL, abs=ATOL)
    torch.testing.assert_close(got_eval, want_eval, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("mode", ["sync", "overlap", "stale"])
def test_evaluation_between_pipelined_calls_sees_every_step(mode):
    """``pipe(x)`` after ``train_step`` runs on the weights with every step so far
    applied (docs/guide.md, "Evaluation"): plain PyTorch's after the same steps. In
    ``stale`` an evaluation applies the pending step first, so with one after every
    step the run trains as ``sync`` does (the documented cost of evaluating there).
    The output is the caller's own: fp32 CPU memory, no grad, kept across calls."""
    model = tiny_transformer(widths=(24, 40))
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    x = token_batch(5, 6, seed=9)[0]
    want, want_eval = [], []
    for call in range(3):
        want.append(reference_forward_backward(ref, *token_batch(8, 6, seed=call), 2, call))
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            want_eval.append(ref.eval()(x))
        ref.train()
    got, evals = [], []
    with rotapipe.RoundPipe(model, lm_loss, config=emulated(2, 2, optimizer_mode=mode),
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.5)) as pipe:
        for call in range(3):
            got.append(pipe.train_step(*token_batch(8, 6, seed=call)))
            evals.append(pipe.eval()(x))
            pipe.train()
        kept = [e.clone() for e in evals]
        pipe.train_step(*token_batch(8, 6, seed=3))
        pipe(x)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=RTOL, atol=ATOL)
    for e, k, w in zip(evals, kept, want_eval):
        assert e.dtype == torch.float32 and e.device.type == "cpu" and not e.requires_grad
        assert torch.equal(e, k)
        torch.testing.assert_close(e, w, rtol=RTOL, atol=ATOL)


class _WithStats(torch.nn.Module):
    """A last layer that returns its output with a per-feature statistic of its
    microbatch (dim 0: the features, not the samples) and a per-sample score."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 6)

    def forward(self, x):
        y = self.lin(x)
        return y, y.mean(0), y.sum(1)


def test_evaluation_joins_only_per_sample_outputs():
    """An evaluation output whose dim 0 is not the microbatch's samples (a statistic of
    6 features, 2 microbatches of 3 and 2 samples) comes back one value per microbatch;
    before, the microbatches' statistics were joined into one tensor of 12 values that
    stood for nothing. Per-sample outputs are joined and equal the model's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), _WithStats())
    ref = copy.deepcopy(model)
    x = torch.randn(5, 6)
    with rotapipe.RoundPipe(model, lambda out, y: out[0].sum(), config=emulated(2, 2)) as pipe:
        y, stats, score = pipe(x)
    want_y, _, want_score = ref(x)
    torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(score, want_score, rtol=1e-5, atol=1e-6)
    assert isinstance(stats, list) and len(stats) == 2
    for got, part in zip(stats, x.tensor_split(2)):
        torch.testing.assert_close(got, ref(part)[1], rtol=1e-5, atol=1e-6)
