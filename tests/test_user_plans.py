"""Schedules a user builds or edits: they run exactly, or are refused with a message that
names the problem; never run wrong, never hang.

- Bound schedules (``schedule/bound.py``) over a model whose layers in different chunks
  hold one buffer their forward updates: given the buffer ids, a later chunk's buffers
  come as the earlier chunk left them (plain PyTorch's values, element by element);
  an order that cannot wait so is refused; ``use_schedule`` refuses a schedule that does
  not pass the buffer on (before, every chunk started from the call's first value and
  the last download won: a counter two chunks update counted 48 samples of 144).
- Hand-edited schedules: an optimizer hand-off that does not wait for its weight
  gradients (before: it ran first, found none and the gradients were silently
  dropped), an action on a worker the schedule does not have or on the wrong side of
  the host lane (before: ``KeyError`` / ``NotImplementedError`` from the executor), an
  evaluation schedule with training work or a missing output (before: ``RaceError``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import rotapipe
from rotapipe.errors import ScheduleError
from rotapipe.plan import bound_plan
from rotapipe.schedule import (HOST, ActionKind as K, gpipe_schedule, interleaved_1f1b_schedule,
                               looped_bfs_schedule, one_f_one_b_schedule, validate)
from models import emulated, lm_loss, tiny_transformer, token_batch
from test_races import mse, reference_shared, sgd, shared_buffer_model

BOUND = {"gpipe": (gpipe_schedule, 1), "1f1b": (one_f_one_b_schedule, 1),
         "interleaved-1f1b": (interleaved_1f1b_schedule, 2),
         "looped-bfs": (looped_bfs_schedule, 2)}


def shared_data(calls: int = 3):
    return [(torch.randn(16, 8, generator=torch.Generator().manual_seed(c)),
             torch.randn(16, 8, generator=torch.Generator().manual_seed(100 + c)))
            for c in range(calls)]


def held_buffers(pipe: rotapipe.RoundPipe) -> dict[int, list[int]]:
    """Layer -> the ids of the buffers it holds (what the bound generators take)."""
    return {l: pipe.layerset.layer_buffers[l] for l in pipe.layerset.buffer_layers()}


# -- bound schedules and buffers shared between chunks -----------------------------------

@pytest.mark.parametrize("name, workers, microbatches", [
    ("gpipe", 2, 2), ("gpipe", 3, 4), ("1f1b", 2, 2), ("interleaved-1f1b", 2, 2),
    ("looped-bfs", 2, 4), ("looped-bfs", 3, 4)])
def test_bound_schedules_pass_a_shared_buffer_from_chunk_to_chunk(name, workers,
                                                                  microbatches):
    """Every layer holds ``scale``; layers 0, 2 and 5 the counter ``seen`` (in different
    chunks): three SGD steps give plain PyTorch's losses, weights and buffers."""
    make, per_device = BOUND[name]
    plan = bound_plan([1.0] * 6, workers * per_device, devices=workers)
    data = shared_data()
    losses = []
    with rotapipe.RoundPipe(shared_buffer_model(), mse, plan=plan, optimizer=sgd,
                            config=emulated(workers, microbatches, timeout_s=60)) as pipe:
        schedule = make(plan, workers, microbatches, offload_optimizer=True,
                        buffer_layers=held_buffers(pipe))
        pipe.use_schedule(schedule)
        for x, y in data:
            losses.append(pipe.forward_backward(x, y))
            assert pipe.step()
        state = {k: v.clone() for k, v in pipe.state_dict().items()}
    want_losses, _, want = reference_shared(microbatches, data, stale=False)
    torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=1e-6)
    assert state.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(state[k], want[k].detach(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, k=k: f"{k}: {m}")
    assert int(state["0.seen"]) == 3 * 16 * len(data)
    # The later holders' uploads wait for the earlier holders' buffer downloads.
    uploads = {a.stage: a.deps for a in schedule.actions if a.kind is K.UPLOAD_WEIGHTS}
    assert uploads["T"] and all(d.startswith("DB:") for d in uploads["T"])


def test_bound_schedule_refuses_to_pass_a_buffer_where_it_would_deadlock():
    """1F1B runs a later chunk's first forward before the earlier chunk's last one once
    the microbatches outnumber its warm-up: it cannot pass a shared buffer on."""
    plan = bound_plan([1.0] * 6, 2)
    held = {0: ["scale", "seen"], 2: ["scale", "seen"], 5: ["scale", "seen"]}
    with pytest.raises(ScheduleError, match=r"1f1b cannot pass a buffer.*'seen'.*F0.*T "
                                            r"\(layers 3-5\).*gpipe_schedule"):
        one_f_one_b_schedule(plan, 2, 4, offload_optimizer=True, buffer_layers=held)
    # Buffers of their own (a plain collection) need no order between chunks.
    validate(one_f_one_b_schedule(plan, 2, 4, offload_optimizer=True,
                                  buffer_layers=[0, 2, 5]))


def test_use_schedule_refuses_a_schedule_that_does_not_pass_a_shared_buffer():
    """Without the buffer ids a bound schedule uploads each chunk's copy of the shared
    buffer at the start of the call; a RoundPipe schedule with its upload's wait on the
    buffer download removed reads the call's first value too. Both are refused."""
    plan = bound_plan([1.0] * 6, 2)
    with rotapipe.RoundPipe(shared_buffer_model(), mse, plan=plan, optimizer=sgd,
                            config=emulated(2, 2)) as pipe:
        plain = gpipe_schedule(plan, 2, 2, offload_optimizer=True,
                               buffer_layers=pipe.layerset.buffer_layers())
        with pytest.raises(rotapipe.ConfigError,
                           match=r"FK:T:m0 on worker 1 reads buffers \[0, 1\].*UW:T does "
                                 r"not wait for DB:F0.*buffer_layers=\{0: \[0, 1\], 1: \[0\]"):
            pipe.use_schedule(plain)
    with rotapipe.RoundPipe(shared_buffer_model(), mse, optimizer=sgd,
                            config=emulated(2, 2, partition="even")) as pipe:
        s = pipe.schedule()
        cut = dataclasses.replace(s, actions=tuple(
            dataclasses.replace(a, deps=tuple(d for d in a.deps if not d.startswith("DB:")))
            if a.kind is K.UPLOAD_WEIGHTS else a for a in s.actions))
        validate(cut)             # sound as a schedule; it is the host state that is not
        with pytest.raises(rotapipe.ConfigError, match=r"does not wait for DB:F0"):
            pipe.use_schedule(cut)
        pipe.use_schedule(s)      # the generated one passes the check


# -- hand-edited schedules -----------------------------------------------------------------

def _pipe(workers: int = 2, microbatches: int = 2) -> rotapipe.RoundPipe:
    return rotapipe.RoundPipe(tiny_transformer(buffers=True, tied=True), lm_loss,
                              config=emulated(workers, microbatches, partition="even",
                                              timeout_s=60))


def _edit(schedule, fn):
    return dataclasses.replace(schedule, actions=tuple(fn(a) for a in schedule.actions))


def test_a_hand_off_must_wait_for_its_weight_gradients():
    """An ``O`` whose wait on its ``DW`` was removed ran first, found no gradients and
    dropped them: the call returned the right loss and wrong gradients."""
    with _pipe() as pipe:
        s = pipe.schedule()
        for cut in (_edit(s, lambda a: dataclasses.replace(a, host_deps=())
                          if a.kind is K.OPTIMIZER else a),
                    _edit(s, lambda a: dataclasses.replace(
                        a, host_deps=tuple(d for d in a.host_deps if d != "DW:B2"))
                        if a.key == "O:B2" else a)):
            with pytest.raises(ScheduleError, match=r"O:(T|B2) hands .* does not wait for "
                                                    r"DW:(T|B2).*<~ DW"):
                validate(cut)
            with pytest.raises(ScheduleError, match="does not wait for DW:"):
                pipe.use_schedule(cut)
        x, y = token_batch(8)
        pipe.forward_backward(x, y)          # the pipeline still works


@pytest.mark.parametrize("where, match", [
    (5, r"UW:F0 is placed on worker 5, but the schedule has 2 worker\(s\), 0\.\.1"),
    (-3, r"UW:F0 is placed on worker -3"),
    (HOST, r"UW:F0 runs on a device \(weights lane\) but is placed on the host lane")])
def test_actions_must_run_on_a_worker_of_the_schedule(where, match):
    """Before, a job moved to worker 5 passed validation and failed in the executor
    with ``KeyError: 5``; on the host lane with ``NotImplementedError``."""
    with _pipe() as pipe:
        moved = _edit(pipe.schedule(), lambda a: dataclasses.replace(a, worker=where)
                      if a.stage == "F0" and a.worker == 0 else a)
        with pytest.raises(ScheduleError, match=match):
            pipe.use_schedule(moved)
        on_device = _edit(pipe.schedule(), lambda a: dataclasses.replace(a, worker=0)
                          if a.kind is K.OPTIMIZER else a)
        with pytest.raises(ScheduleError, match=r"O:\w+ is host work .* placed on worker 0"):
            validate(on_device)
        text = pipe.schedule().to_text().replace("\nw1 ", "\nw7 ", 1)
        with pytest.raises(ScheduleError, match="placed on worker 7"):
            validate(rotapipe.Schedule.from_text(text))


def test_evaluation_schedules_are_checked_too():
    """A training schedule named ``-eval`` ran for evaluation calls and failed with a
    ``RaceError``; an evaluation schedule missing an output failed the same way."""
    x, _ = token_batch(8)
    with _pipe() as pipe:
        want = pipe(x)
        with pytest.raises(ScheduleError, match=r"roundpipe-eval is an evaluation call's "
                                                r".* has (R|B|FT|DB|DG|UG|DW|O):"):
            pipe.use_schedule(dataclasses.replace(pipe.schedule(), name="roundpipe-eval"))
        e = pipe.schedule(training=False)
        last = pipe.plan.num_layers
        no_out = dataclasses.replace(e, actions=tuple(
            a for a in e.actions if not (a.kind is K.DOWNLOAD_ACT and a.at == last
                                         and a.mb == 1)))
        with pytest.raises(ScheduleError, match=f"never downloads microbatch 1's output "
                                                f"\\(DA at layer {last}\\)"):
            pipe.use_schedule(no_out)
        gone = {a.key for a in e.actions if a.key == "F:F0:m1"}
        no_f = dataclasses.replace(e, actions=tuple(
            dataclasses.replace(a, deps=tuple(d for d in a.deps if d not in gone))
            for a in e.actions if a.key not in gone))
        with pytest.raises(ScheduleError, match="forward of stage F0 microbatch 1 is "
                                                "missing from evaluation schedule"):
            validate(no_f)
        pipe.use_schedule(e)
        torch.testing.assert_close(pipe(x), want, rtol=0, atol=0)
