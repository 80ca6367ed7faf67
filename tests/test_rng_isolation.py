"""Random numbers on emulated workers never meet the caller's.

Emulated workers run on the CPU, whose generator is one per process. A training call
still running when ``train_step`` returns (``overlap``, ``stale``), or a second thread
of the user's during any call, used to share it with the workers: ``torch.rand`` in the
user's loop or a ``DataLoader`` starting an epoch moved a layer's dropout mask (weights
0.03-0.06 away from plain PyTorch after 9 steps of a tiny model), and the user's loop
got numbers of the layer's stream, then its generator rewound (these tests, without
the fix: weights up to 0.03 off after 4 steps, shuffles and draws changed). Here the
layers' draws equal plain PyTorch's seeded per layer (``layer_seed``), element by
element, and the user's draws equal those of the same loop with no training in it.
"""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
from torch import nn

import rotapipe
from models import emulated, lm_loss, tiny_transformer, token_batch
from test_exactness import OPTIMIZERS
from test_pipelined_calls import assert_weights, reference

M = 2          # microbatches
STEPS = 4


class Slow(nn.Module):
    """A layer that holds the worker a few milliseconds before running ``inner`` (a
    block with dropout): the window in which a draw of the caller's thread used to land
    between the layer's seeding and its dropout."""

    def __init__(self, inner: nn.Module, seconds: float = 0.004):
        super().__init__()
        self.inner, self.seconds = inner, seconds

    def forward(self, x):
        time.sleep(self.seconds)
        return self.inner(x)


def slow_model() -> nn.Sequential:
    model = tiny_transformer(dropout=0.3, widths=(24, 40))
    return nn.Sequential(model[0], *(Slow(b) for b in model[1:-1]), model[-1])


def _user_draws(n: int = 12) -> list[torch.Tensor]:
    """What a training loop draws between steps (token masking, augmentation),
    spread over a few milliseconds while the call drains."""
    out = []
    for _ in range(n):
        out.append(torch.rand(3))
        time.sleep(0.001)
    return out


@pytest.mark.parametrize("mode", ["overlap", "stale"])
def test_draws_between_pipelined_steps(mode):
    """``torch.rand`` in the loop between pipelined steps: the weights equal plain
    PyTorch's and the loop's numbers those of the loop without training in it."""
    model = slow_model()
    data = [token_batch(8, 6, seed=s) for s in range(STEPS)]
    _, want = reference(mode, model, data, M, None)
    torch.manual_seed(1234)
    want_draws = [_user_draws() for _ in data]
    config = emulated(2, M, optimizer_mode=mode)
    with rotapipe.RoundPipe(copy.deepcopy(model), lm_loss, config=config,
                            optimizer=OPTIMIZERS["adamw"]) as pipe:
        torch.manual_seed(1234)
        draws = []
        for x, y in data:
            pipe.train_step(x, y)
            draws.append(_user_draws())
        got = {k: v.clone() for k, v in pipe.state_dict().items()}
    assert_weights(got, want, mode)
    for step, (a, b) in enumerate(zip(draws, want_draws)):
        assert torch.equal(torch.stack(a), torch.stack(b)), f"draws after step {step}"


def _loader():
    ids, labels = token_batch(16, 6, seed=3)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids, labels),
                                       batch_size=8, shuffle=True)


def test_dataloader_epochs_between_overlapping_steps():
    """A shuffling ``DataLoader`` draws its epoch's seed from the process's generator
    while the last step of the previous epoch still runs (``overlap``): it shuffles as
    it would without training, and the weights equal plain PyTorch's."""
    epochs = 3
    torch.manual_seed(77)
    want_batches = [b for _ in range(epochs) for b in _loader()]
    model = slow_model()
    with rotapipe.RoundPipe(copy.deepcopy(model), lm_loss,
                            config=emulated(2, M, optimizer_mode="overlap"),
                            optimizer=OPTIMIZERS["adamw"]) as pipe:
        torch.manual_seed(77)
        batches = []
        for _ in range(epochs):
            for x, y in _loader():
                pipe.train_step(x, y)
                batches.append((x, y))
        got = {k: v.clone() for k, v in pipe.state_dict().items()}
    for i, (a, b) in enumerate(zip(batches, want_batches)):
        assert torch.equal(a[0], b[0]), f"batch {i} shuffled differently"
    _, want = reference("overlap", model, batches, M, None)
    assert_weights(got, want, "overlap")


def test_second_thread_drawing_during_sync_calls():
    """Another thread of the user's draws all the time while ``sync`` calls run: its
    numbers are its own stream's, and the weights equal plain PyTorch's."""
    model = slow_model()
    data = [token_batch(8, 6, seed=s) for s in range(STEPS)]
    _, want = reference("sync", model, data, M, None)
    torch.manual_seed(99)
    drawn, stop = [], threading.Event()

    def draw():
        while not stop.is_set():
            drawn.append(torch.rand(3))
            time.sleep(0.0005)

    with rotapipe.RoundPipe(copy.deepcopy(model), lm_loss,
                            config=emulated(2, M, optimizer_mode="sync"),
                            optimizer=OPTIMIZERS["adamw"]) as pipe:
        torch.manual_seed(99)
        thread = threading.Thread(target=draw)
        thread.start()
        try:
            for x, y in data:
                pipe.train_step(x, y)
        finally:
            stop.set()
            thread.join()
        got = {k: v.clone() for k, v in pipe.state_dict().items()}
    torch.manual_seed(99)
    assert torch.equal(torch.stack(drawn), torch.rand(len(drawn), 3))
    assert_weights(got, want, "sync")


def test_second_thread_drawing_during_evaluation_calls():
    """Evaluation calls (``pipe(x)``) leave another thread's stream alone too (they put
    the CPU generator's state back afterwards, rewinding what other threads drew)."""
    drawn, stop = [], threading.Event()

    def draw():
        while not stop.is_set():
            drawn.append(torch.rand(3))
            time.sleep(0.0005)

    with rotapipe.RoundPipe(slow_model(), lm_loss, config=emulated(2, M)) as pipe:
        torch.manual_seed(99)
        thread = threading.Thread(target=draw)
        thread.start()
        try:
            for s in range(3):
                pipe(token_batch(8, 6, seed=s)[0])
        finally:
            stop.set()
            thread.join()
    torch.manual_seed(99)
    assert torch.equal(torch.stack(drawn), torch.rand(len(drawn), 3))


class Draws(nn.Module):
    """A layer drawing through ops whose default overloads take no generator
    (``rand_like``, ``randperm``, ``randint``) or that take none at all
    (``native_dropout`` with ``swap=True``: it runs on the process's generator, into
    which the layer's stream is swapped for the op)."""

    def __init__(self, dim: int, swap: bool = False):
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.swap = swap

    def forward(self, x):
        time.sleep(0.004)        # the window of Slow
        h = self.lin(x)
        if self.swap:
            h = torch.native_dropout(h, 0.3, True)[0]
        noise = torch.rand_like(h) * 0.1
        perm = torch.randperm(h.shape[-1])
        shift = torch.randint(0, 3, (1,)).item()
        return x + h[..., perm].roll(shift, dims=1) + noise


@pytest.mark.parametrize("mode,swap", [("overlap", False), ("sync", True)])
def test_ops_without_generator_argument_draw_the_layer_stream(mode, swap):
    """Each of these ops draws the numbers plain PyTorch draws after seeding with the
    layer's seed; ``overlap`` with the loop drawing while the calls drain (the swapped
    op is exposed to draws of the caller's threads meanwhile: ``sync`` without)."""
    base = tiny_transformer(widths=(24,))
    model = nn.Sequential(base[0], Draws(16, swap), base[1], Draws(16, swap), base[2])
    data = [token_batch(8, 6, seed=s) for s in range(3)]
    _, want = reference(mode, model, data, M, None)
    with rotapipe.RoundPipe(copy.deepcopy(model), lm_loss,
                            config=emulated(2, M, optimizer_mode=mode),
                            optimizer=OPTIMIZERS["adamw"]) as pipe:
        for x, y in data:
            pipe.train_step(x, y)
            if mode != "sync":
                _user_draws()
        got = {k: v.clone() for k, v in pipe.state_dict().items()}
    assert_weights(got, want, mode)


def test_layers_that_draw_nothing_run_unwatched():
    """Layers seen to draw nothing run without the dispatch mode; ``eval()`` and
    ``train()`` (followed by the workers' copies) make them watched again, and a
    dropout layer is watched in training."""
    model = tiny_transformer(dropout=0.2, widths=(24,))
    with rotapipe.RoundPipe(model, lm_loss, config=emulated(1, M),
                            optimizer=OPTIMIZERS["adamw"]) as pipe:
        shells = pipe._calls.shells[0]
        pipe.train_step(*token_batch(8, 6, seed=0))
        assert [s.draws for s in shells] == [False, True, False]
        model.eval()
        pipe.train_step(*token_batch(8, 6, seed=1))
        assert [s.draws for s in shells] == [False, False, False]
        model.train()
        pipe.train_step(*token_batch(8, 6, seed=2))
        assert [s.draws for s in shells] == [False, True, False]


class Seeds(nn.Module):
    """Records the seed its copies run with (shared by the workers' copies)."""

    def __init__(self, seen: list):
        super().__init__()
        self.lin, self.seen = nn.Linear(16, 16), seen

    def __deepcopy__(self, memo):
        new = Seeds(self.seen)
        new.lin = copy.deepcopy(self.lin, memo)
        return new

    def forward(self, x):
        from rotapipe.runtime.emulated import running_seed
        self.seen.append((torch.is_grad_enabled(), running_seed()))
        return self.lin(x)


def test_running_seed_names_the_layer_call():
    """``running_seed()`` inside a layer is its ``layer_seed`` (``torch.initial_seed()``
    was, when the workers seeded the process's generator), in the forward and the
    recompute, watched or not; ``None`` outside a layer."""
    seen = []
    base = tiny_transformer(widths=(24,))
    model = nn.Sequential(base[0], Seeds(seen), base[1], base[2])
    with rotapipe.RoundPipe(model, lm_loss, config=emulated(2, M),
                            optimizer=OPTIMIZERS["adamw"]) as pipe:
        for x, y in [token_batch(8, 6, seed=s) for s in range(2)]:
            pipe.train_step(x, y)
    want = {rotapipe.layer_seed(0, c, m, 1) for c in range(2) for m in range(M)}
    assert {s for _, s in seen} == want
    assert {s for grad, s in seen if grad} == want       # the recompute's are the same
    from rotapipe.runtime.emulated import running_seed
    assert running_seed() is None
