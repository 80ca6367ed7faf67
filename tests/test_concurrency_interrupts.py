"""A Ctrl-C (``KeyboardInterrupt``) in the middle of training, delivered to the main
thread as ``SIGINT`` is (``_thread.interrupt_main``). The optimizer step a call (or
``pipe.step()``) runs on the caller's thread is not cut part-way: the interrupt waits
for its end, the step is kept, and the state is the step boundary after it, equal to
plain PyTorch's element by element; training then goes on. A second Ctrl-C while the
workers stop after the first does not leave the aborted call for the next call to
wait on."""

from __future__ import annotations

import _thread
import copy
import threading
import time

import pytest
import torch
from torch import nn

import rotapipe
from rotapipe.runtime.emulated import running_seed
from models import emulated, lm_loss, reference_forward_backward, tiny_transformer, token_batch

RTOL, ATOL = 1e-5, 1e-6


class InterruptedSGD(torch.optim.SGD):
    """SGD whose ``step()`` is interrupted (SIGINT to the main thread) in the calls
    listed in ``at`` (counted from 0), before it has updated anything."""

    def __init__(self, params, at=(), **kw):
        super().__init__(params, **kw)
        self.at, self.count = set(at), 0

    def step(self, closure=None):
        if self.count in self.at and threading.current_thread() is threading.main_thread():
            _thread.interrupt_main()       # raised at the next bytecode, as a real Ctrl-C
        self.count += 1
        return super().step(closure)


def reference(model, data, microbatches):
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for c, (x, y) in enumerate(data):
        reference_forward_backward(ref, x, y, microbatches, c)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return ref.state_dict()


@pytest.mark.parametrize("how", ["train_step", "step"])
def test_ctrl_c_during_a_synchronous_step_keeps_the_step_whole(how):
    model = tiny_transformer(dropout=0.1)
    data = [token_batch(8, 6, seed=s) for s in range(3)]
    pipe = rotapipe.RoundPipe(copy.deepcopy(model), lm_loss, config=emulated(2, 2),
                              optimizer=lambda ps: InterruptedSGD(ps, at={1}, lr=0.1,
                                                                  momentum=0.9))
    with pipe:
        for c, (x, y) in enumerate(data):
            try:
                if how == "train_step":
                    pipe.train_step(x, y)
                else:
                    pipe.forward_backward(x, y)
                    pipe.step()
            except KeyboardInterrupt:
                assert c == 1
                interrupted = True
        assert interrupted and pipe.calls == 3
        got = {k: v.clone() for k, v in pipe.state_dict().items()}
    want = reference(model, data, 2)
    assert got.keys() == want.keys()
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=RTOL, atol=ATOL, msg=lambda m, k=k: f"{k}: {m}")


class InterruptingLayer(nn.Module):
    """A linear layer that sends a Ctrl-C to the main thread (waiting for the call) the
    first time it runs in the training call ``at``."""

    def __init__(self, at: int):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.at, self.sent = at, [False]

    def __deepcopy__(self, memo):
        new = InterruptingLayer(self.at)
        new.lin = copy.deepcopy(self.lin, memo)
        new.sent = self.sent            # shared by the workers' copies
        return new

    def forward(self, x):
        if torch.is_grad_enabled() and not self.sent[0] and \
                running_seed() == rotapipe.layer_seed(0, self.at, 0, 1):
            self.sent[0] = True
            _thread.interrupt_main()
            time.sleep(0.2)             # the main thread takes it while this one runs
        return self.lin(x)


@pytest.mark.parametrize("mode", ["sync", "overlap"])
def test_a_second_ctrl_c_while_the_workers_drain_leaves_no_call_hanging(mode, monkeypatch):
    """The first Ctrl-C aborts the call; a second one arrives while the workers drain
    (before the abort undid the call): the next call must not wait for the aborted
    call forever, and training goes on from the last step boundary as plain PyTorch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), InterruptingLayer(at=1), nn.Linear(8, 4))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g))
            for _ in range(3)]
    loss = lambda o, y: ((o - y) ** 2).mean()
    config = emulated(2, 2, optimizer_mode=mode, timeout_s=10.0)
    pipe = rotapipe.RoundPipe(copy.deepcopy(model), loss, config=config,
                              optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    executor = pipe._stream.runner.executor
    drain, second = executor._drain, [False]

    def interrupted_drain(*args):
        if not second[0]:
            second[0] = True
            raise KeyboardInterrupt     # the second Ctrl-C, in the drain
        return drain(*args)

    monkeypatch.setattr(executor, "_drain", interrupted_drain)
    with pipe:
        pipe.train_step(*data[0])
        with pytest.raises(KeyboardInterrupt):
            pipe.train_step(*data[1])
            pipe.flush()
        assert second[0]
        start = time.monotonic()
        pipe.flush()
        assert time.monotonic() - start < 1.0 and pipe.calls == 1
        for x, y in data[1:]:
            pipe.train_step(x, y)
        got = {k: v.clone() for k, v in pipe.state_dict().items()}
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in data:
        for xm, ym in zip(x.tensor_split(2), y.tensor_split(2)):
            (loss(ref(xm), ym) / 2).backward()
        opt.step()
        opt.zero_grad()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=RTOL, atol=ATOL, msg=lambda m, k=k: f"{k}: {m}")
