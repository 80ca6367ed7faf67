"""The runtime's promises under misuse and faults (issue 15, runtime half).

Each class of failure a training library must not have: silent corruption (a module
shared by two live pipelines, non-finite losses and gradients, a partial
``load_state_dict``, in-place parameter updates in forward, evaluation changing the
batch size), hangs (calls after ``close()``, closing or exiting with a stuck worker)
and messages that do not name what was running. Every case asserts the exception
type, a message naming the problem, a bounded time, and that the state is unchanged
(or equal to a plain PyTorch reference) afterwards.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch import nn

import rotapipe
from models import emulated
from train_util import deadline

RTOL, ATOL = 1e-5, 1e-6


def linear_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 4))


def batch(n: int = 8, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g), torch.randn(n, 4, generator=g)


def state_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_state(model: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    got = model.state_dict()
    assert got.keys() == expected.keys()
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=0, atol=0, msg=k)


class Sleepy(nn.Module):
    """Sleeps ``seconds`` in forward (a stuck kernel) while ``seconds`` is set."""

    def __init__(self, seconds: float):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seconds = seconds

    def forward(self, x):
        if self.seconds:
            time.sleep(self.seconds)
        return self.lin(x)


# -- lifecycle -------------------------------------------------------------------------

CLOSED_CALLS = {
    "forward_backward": lambda p, x, y: p.forward_backward(x, y),
    "train_step": lambda p, x, y: p.train_step(x, y),
    "evaluate": lambda p, x, y: p(x),
    "step": lambda p, x, y: p.step(),
    "flush": lambda p, x, y: p.flush(),
    "state_dict": lambda p, x, y: p.state_dict(),
    "load_state_dict": lambda p, x, y: p.load_state_dict({}),
    "parameters": lambda p, x, y: p.parameters(),
    "zero_grad": lambda p, x, y: p.zero_grad(),
    "pipeline_state": lambda p, x, y: p.pipeline_state(),
    "attach_optimizer": lambda p, x, y: p.attach_optimizer(torch.optim.SGD(p.layerset.params, lr=1)),
}


@pytest.mark.parametrize("method", sorted(CLOSED_CALLS))
def test_a_closed_pipeline_raises_at_once(method):
    model = linear_model()
    pipe = rotapipe.RoundPipe(model, nn.functional.mse_loss,
                              config=emulated(2, 2, timeout_s=30))
    pipe.attach_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.1))
    x, y = batch()
    pipe.train_step(x, y)
    before = state_of(model)
    pipe.close()
    pipe.close()                       # closing twice does nothing
    t0 = time.monotonic()
    with deadline(10), pytest.raises(rotapipe.PipelineClosedError, match="was closed"):
        CLOSED_CALLS[method](pipe, x, y)
    assert time.monotonic() - t0 < 0.5
    assert_state(model, before)        # the trained weights stay in the model


def test_a_stall_names_the_action_running_and_close_is_bounded():
    model = nn.Sequential(nn.Linear(4, 4), Sleepy(30.0), nn.Linear(4, 4))
    pipe = rotapipe.RoundPipe(model, nn.functional.mse_loss,
                              config=emulated(2, 2, timeout_s=0.5))
    stuck = next(s for s in pipe.plan.forward if 1 in s.layers)
    x, y = batch(4)
    with deadline(20):
        t0 = time.monotonic()
        with pytest.raises(rotapipe.WorkerError) as info:
            pipe.forward_backward(x, y)
        msg = str(info.value)
        # The stalled forward is the one named as running, with its worker.
        assert f"running: F:{stuck.name}:m0 (forward) on worker " in msg
        assert "cannot run again" in msg and f"F:{stuck.name}:m0 (forward)" in \
            msg.split("cannot run again")[0].rsplit("\n\n", 1)[-1]
        assert time.monotonic() - t0 < 5
        t0 = time.monotonic()
        with pytest.warns(RuntimeWarning, match=r"abandoning rotapipe-w\d\.compute"):
            pipe.close()
        assert time.monotonic() - t0 < 3


def test_a_script_with_a_stuck_worker_exits_without_close(tmp_path):
    script = tmp_path / "stuck.py"
    script.write_text(textwrap.dedent("""
        import sys, time, torch
        from torch import nn
        import rotapipe

        class Sleepy(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(4, 4)
            def forward(self, x):
                time.sleep(60)
                return self.lin(x)

        pipe = rotapipe.RoundPipe(
            nn.Sequential(nn.Linear(4, 4), Sleepy(), nn.Linear(4, 4)),
            nn.functional.mse_loss,
            config=rotapipe.PipeConfig(workers=2, microbatches=2, backend="emulated",
                                       timeout_s=0.5))
        try:
            pipe.forward_backward(torch.randn(4, 4), torch.randn(4, 4))
        except rotapipe.WorkerError as exc:
            print("raised:", str(exc).splitlines()[0])
        # no close(): the interpreter's exit must not wait for the stuck worker
    """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=40, env=env)
    took = time.monotonic() - t0
    assert done.returncode == 0, done.stderr
    assert "raised: forward F:" in done.stdout
    assert "abandoning rotapipe-w" in done.stderr
    assert took < 20, f"exit took {took:.1f} s (the stuck layer sleeps 60 s)"
