"""Saving and restoring state while ``overlap`` / ``stale`` calls are still stepping:
the optimizer's own ``state_dict`` / ``load_state_dict`` wait for them, as the
pipeline's state methods do."""

from __future__ import annotations

import copy
import time

import pytest
import torch

import rotapipe
from models import emulated, lm_loss, token_batch, tiny_transformer


class SlowAdamW(torch.optim.AdamW):
    """AdamW whose every step takes a while: a step is surely under way when
    ``train_step`` returns."""

    def step(self, closure=None):
        time.sleep(0.03)
        return super().step(closure)


def _pipe(mode):
    pipe = rotapipe.RoundPipe(tiny_transformer(widths=(24, 40)), lm_loss,
                              config=emulated(2, 2, optimizer_mode=mode))
    opt = SlowAdamW(pipe.parameters(), lr=1e-2)
    pipe.attach_optimizer(opt)
    return pipe, opt


@pytest.mark.parametrize("mode", ["overlap", "stale"])
def test_optimizer_state_dict_right_after_train_step_is_whole(mode):
    """``torch.save(opt.state_dict(), f)`` right after ``train_step``: it used to read
    the state while the host optimizer was stepping it (no state at all after the first
    call, step counts 2 and 3 mixed in one state after the third)."""
    pipe, opt = _pipe(mode)
    with pipe:
        for call in range(1, 4):
            pipe.train_step(*token_batch(seed=call))
            early = copy.deepcopy(opt.state_dict())
            pipe.flush()
            late = opt.state_dict()
            assert early["state"].keys() == late["state"].keys()
            assert len(late["state"]) == len(list(pipe.parameters()))
            for i, st in late["state"].items():
                assert float(early["state"][i]["step"]) == call
                for k, v in st.items():
                    assert torch.equal(early["state"][i][k], v), (call, i, k)


@pytest.mark.parametrize("mode", ["overlap", "stale"])
def test_optimizer_load_state_dict_right_after_train_step_is_not_stepped_again(mode):
    """Rolling back (``opt.load_state_dict(saved)``, then ``pipe.load_state_dict``)
    right after a ``train_step``: the step still under way used to step the loaded
    state too (step counts 2 and 3 after loading a state of step 2)."""
    pipe, opt = _pipe(mode)
    with pipe:
        for call in range(2):
            pipe.train_step(*token_batch(seed=call))
        pipe.flush()
        saved_opt = copy.deepcopy(opt.state_dict())
        assert {float(st["step"]) for st in saved_opt["state"].values()} == {2.0}
        saved = {k: v.clone() for k, v in pipe.state_dict().items()}
        pipe.train_step(*token_batch(seed=5))
        opt.load_state_dict(copy.deepcopy(saved_opt))
        pipe.load_state_dict(saved)
        now = opt.state_dict()
        for i, st in saved_opt["state"].items():
            for k, v in st.items():
                assert torch.equal(now["state"][i][k], v), (i, k)
        for k, v in pipe.state_dict().items():
            assert torch.equal(v, saved[k]), k


def test_optimizer_hooks_follow_the_attached_pipeline():
    """The hooks hold the pipeline weakly and stop flushing once it is closed, so the
    optimizer keeps working after the pipeline (and with a new one)."""
    pipe, opt = _pipe("overlap")
    pipe.train_step(*token_batch())
    pipe.close()
    state = opt.state_dict()                 # no PipelineClosedError
    opt.load_state_dict(state)
    assert float(state["state"][0]["step"]) == 1
