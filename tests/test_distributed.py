"""Data parallelism over torch.distributed (gloo on loopback).

- 2 processes x 2 emulated workers, ``GLOBAL / 2`` samples per rank, equal element by
  element (rtol 1e-5 / atol 1e-6) to one process with the whole batch after 3 steps,
  with and without gradient clipping, and with a token-mean loss whose token counts
  differ between the ranks (two accumulated calls per step), and with
  ``optimizer_mode="overlap"`` (clipping off and on); the ranks end bit-identical (dropout
  and a tied weight included: rank r's microbatch m draws the random stream of microbatch ``r * M + m``
  of the one-process run).
- A rank killed mid-step, or hung, makes the other exit with a DistributedError naming
  it within the timeout.
- Ranks with different models fail at construction, all of them, naming the rank.
- In-process: a one-rank group runs the whole reduction path (tiny buckets, tied
  weight) bit-identical to no data parallelism, and so does ``optimizer_mode="overlap"``
  (each stage stepped on the optimizer thread once its all-reduce is in); config, env
  and sharding errors.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed as dist

import rotapipe
from rotapipe import distributed
from models import emulated, lm_loss, tiny_transformer, token_batch
import dist_job
from train_util import free_port

JOB = pathlib.Path(__file__).with_name("dist_job.py")
RTOL, ATOL = 1e-5, 1e-6


def _launch(tmp_path, world: int, *args: str) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK="0",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(
            [sys.executable, str(JOB), str(tmp_path / f"rank{r}.pt"), *args], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def _finish(p: subprocess.Popen, timeout: float) -> tuple[int, str]:
    try:
        _, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        _, err = p.communicate()
        pytest.fail(f"pid {p.pid} still running after {timeout} s:\n{err}")
    return p.returncode, err


def test_two_ranks_equal_one_process_with_the_whole_batch(tmp_path):
    procs = _launch(tmp_path, 2)
    # The one-process reference runs here meanwhile: whole batch, 2 x the microbatches.
    one = distributed.DistInfo(0, 1, 0)
    mbs = 2 * dist_job.MICROBATCHES
    ref = {"plain": dist_job.train(one, None, mbs, None, 20.0),
           "clip": dist_job.train(one, dist_job.CLIP, mbs, None, 20.0),
           "tokens": dist_job.train(one, None, mbs, None, 20.0, tokens=True)}
    for p in procs:
        rc, err = _finish(p, 60)
        assert rc == 0, err
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert [r["any_rank"] for r in ranks] == [(True, False)] * 2
    # optimizer_mode="overlap" must give the sync reference's weights (plain and clipped).
    ref["overlap"], ref["overlap_clip"] = ref["plain"], ref["clip"]
    for mode in ("plain", "clip", "tokens", "overlap", "overlap_clip"):
        want = ref[mode]
        for r, got in enumerate(ranks):
            got = got[mode]
            assert got["losses"] == pytest.approx(want["losses"], rel=1e-6)
            assert got["state"].keys() == want["state"].keys()
            for k, v in want["state"].items():
                torch.testing.assert_close(got["state"][k], v, rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"{mode} rank {r} {k}: {m}")
                # Reduced gradients are identical on every rank, so is the state.
                assert torch.equal(got["state"][k], ranks[0][mode]["state"][k])
        stats = ranks[0][mode]["stats"]
        assert stats.buckets > 0 and stats.bytes > 0 and 0.0 <= stats.hidden_fraction <= 1.0
    # Clipping was active (the clipped run differs from the plain one), and the ranks
    # held different token counts (so a per-rank mean would not have matched).
    assert not torch.equal(ref["plain"]["state"]["0.emb.weight"],
                           ref["clip"]["state"]["0.emb.weight"])
    seeds = [10 + i for i in range(dist_job.STEPS)] + [50 + i for i in range(dist_job.STEPS)]
    counts = [[int((dist_job.masked(token_batch(dist_job.GLOBAL, seed=seed)[1], seed)
                    .tensor_split(2)[r] != -100).sum()) for r in range(2)] for seed in seeds]
    assert any(c0 != c1 for c0, c1 in counts), counts


@pytest.mark.parametrize("fault,overlap", [("kill", False), ("hang", False),
                                           ("kill", True), ("raise", False)])
def test_lost_rank_fails_the_others_naming_it(tmp_path, fault, overlap):
    """overlap: the survivor's optimizer thread waits for the lost rank's all-reduce
    too; the error is the same."""
    # A hung or failed rank is only noticed at the timeout; a dead one at once.
    timeout = 10.0 if fault == "kill" else 3.0
    procs = _launch(tmp_path, 2, f"--{fault}-at", "1", "--timeout", str(timeout),
                    *(["--overlap"] if overlap else []))
    try:
        rc, err = _finish(procs[0], 40)
    finally:
        procs[1].kill()
        procs[1].communicate()
    assert rc == 3, err
    assert "DistributedError" in err and "lost_ranks=[1]" in err and "rank 1 lost" in err, err
    why = {"kill": "no heartbeat from rank(s) [1]",
           "hang": "rank(s) [1] are alive but never issued",
           # alive, but it said why it left (its pipeline closed after the failure)
           "raise": "rank 1 left the collectives: its own call failed"}[fault]
    assert why in err, err
    # From the fault to the error: within the timeout (a hang is only detected by it;
    # then ~1 s of diagnosis reading the heartbeats).
    began = float((tmp_path / "rank1.pt.fault").read_text())
    failed = float(re.search(r"at=([0-9.]+)", err).group(1))
    limit = timeout if fault == "kill" else timeout + 4
    assert 0 < failed - began < limit, (failed - began, err)


def test_ranks_with_different_models_fail_at_construction(tmp_path):
    procs = _launch(tmp_path, 2, "--mismatch")
    for p in procs:
        rc, err = _finish(p, 40)
        assert rc == 4, err
        assert "rank(s) [1] differ from rank 0" in err, err



def test_a_rank_gone_before_its_pipeline_fails_the_others_at_construction(tmp_path):
    """Rank 1 exits after the process group formed, before its pipeline: rank 0's
    start-up check becomes a DistributedError saying so (it was gloo's raw RuntimeError,
    "Connection closed by peer")."""
    procs = _launch(tmp_path, 2, "--exit-before-pipe", "--timeout", "20")
    rc1, _ = _finish(procs[1], 40)
    rc0, err = _finish(procs[0], 40)
    assert rc1 == 1 and rc0 == 3, err
    assert "start-up check" in err and "another rank exited or hung" in err, err

def _run_steps(config, steps=2):
    model = tiny_transformer(dropout=0.1, tied=True)
    model[2].unused = torch.nn.Parameter(torch.ones(3))   # never gets a gradient
    pipe = rotapipe.RoundPipe(model, lm_loss, config=config,
                              optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2, eps=1e-3))
    with pipe:
        losses = []
        for step in range(steps):
            x, y = token_batch(8, seed=step)
            losses.append(pipe.forward_backward(x, y))
            # A parameter no rank touched keeps grad=None (AdamW then skips it).
            assert model[2].unused.grad is None
            assert all(p.grad is not None for n, p in pipe.named_parameters()
                       if "unused" not in n)
            pipe.step()
        return pipe, losses, {k: v.clone() for k, v in pipe.state_dict().items()}, \
            pipe.schedule()


def test_one_rank_group_runs_the_reduction_bit_identically(one_rank_group):
    dp = rotapipe.DataParallelConfig(enabled=True, bucket_mb=0.001, timeout_s=10)
    pipe, losses, state, schedule = _run_steps(emulated(2, 2, data_parallel=dp))
    _, ref_losses, ref_state, _ = _run_steps(emulated(2, 2, data_parallel=False))
    assert losses == ref_losses
    for k, v in ref_state.items():
        assert torch.equal(state[k], v), k
    # Every trainable parameter is reduced exactly once per call, the tied weight
    # (handed off by the head and the embedding stages) with the later hand-off.
    layout = pipe.data_parallel._layout(schedule)
    pids = [pid for buckets in layout.values() for b in buckets for pid in b]
    assert sorted(pids) == sorted(pipe.host.trainable)
    assert pipe.data_parallel.last.buckets > len(layout)   # 1 KiB buckets: many
    tied = 0   # the embedding weight is shared by layer 0 and the head
    handoffs = [a.key for a in schedule.actions
                if a.kind is rotapipe.schedule.ActionKind.OPTIMIZER]
    owner = [k for k, buckets in layout.items() if any(tied in b for b in buckets)]
    assert owner == [handoffs[-1]]


@pytest.mark.parametrize("clip", [None, 1e3, 0.05])
def test_one_rank_group_overlap_steps_on_reduced_gradients(one_rank_group, monkeypatch,
                                                           clip):
    """optimizer_mode="overlap" under data parallelism: each stage's step waits for its own
    all-reduce on the host lane. Bit-identical to sync without data parallelism,
    with clipping off, never triggering (1e3) and triggering every step (0.05)."""
    applied = []            # (thread, buckets) of every CallReduce.apply
    real = rotapipe.runtime.allreduce.CallReduce.apply

    def spy(self, buckets):
        applied.append((threading.current_thread().name, len(buckets)))
        return real(self, buckets)
    monkeypatch.setattr(rotapipe.runtime.allreduce.CallReduce, "apply", spy)

    def run(**kw):
        model = tiny_transformer(dropout=0.1, tied=True)
        config = emulated(2, 2, clip_grad_norm=clip, **kw)
        with rotapipe.RoundPipe(model, lm_loss, config=config, optimizer=lambda ps:
                                torch.optim.AdamW(ps, lr=1e-2, eps=1e-3)) as pipe:
            steps = []
            pipe._optimizer_cost = lambda pids: steps.append(len(pids))
            losses = [pipe.train_step(*token_batch(8, seed=s)) for s in range(3)]
            return losses, {k: v.clone() for k, v in pipe.state_dict().items()}, steps, \
                pipe.last_grad_norm

    dp = rotapipe.DataParallelConfig(enabled=True, bucket_mb=0.001, timeout_s=10)
    losses, state, steps, norm = run(optimizer_mode="overlap", data_parallel=dp)
    ref_losses, ref_state, _, ref_norm = run(optimizer_mode="sync", data_parallel=False)
    assert losses == ref_losses and norm == ref_norm
    for k, v in ref_state.items():
        assert torch.equal(state[k], v), k
    # Stepped stage by stage. Clipping at 0.05 redoes one whole step at the first call;
    # the calls after a step whose clip took effect take it whole, without speculating.
    if clip == 0.05:
        whole = max(steps)
        assert len(steps) > 4 and steps.count(whole) == 3, steps
        assert steps[-2:] == [whole, whole] and sum(steps[:-3]) == whole, steps
    else:
        assert len(steps) >= 3 * 3, steps
    # The host lane applied the reduced buckets at the hand-offs, before stepping on
    # them (not the caller's finish()).
    assert any(name == "rotapipe-dispatch-host" and n > 0 for name, n in applied), applied


def test_auto_is_off_without_a_group_and_true_requires_one():
    assert not dist.is_initialized()
    with rotapipe.RoundPipe(tiny_transformer(), lm_loss, config=emulated(1, 1)) as pipe:
        assert pipe.data_parallel is None
    with pytest.raises(rotapipe.ConfigError, match="no torch.distributed process group"):
        rotapipe.RoundPipe(tiny_transformer(), lm_loss,
                           config=emulated(1, 1, data_parallel=True))


def test_config_validation():
    assert rotapipe.PipeConfig(data_parallel=False).data_parallel.enabled is False
    assert rotapipe.PipeConfig().data_parallel == rotapipe.DataParallelConfig()
    with pytest.raises(rotapipe.ConfigError, match="bucket_mb"):
        rotapipe.DataParallelConfig(bucket_mb=0)
    with pytest.raises(rotapipe.ConfigError, match="data_parallel="):
        rotapipe.PipeConfig(data_parallel="yes")


def test_init_from_env(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    assert distributed.init_from_env() == distributed.DistInfo(0, 1, 0)
    assert distributed.world_size() == 1 and distributed.is_main()
    assert distributed.any_rank(True) and not distributed.any_rank(False)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(rotapipe.ConfigError, match="MASTER_ADDR"):
        distributed.init_from_env()


def test_shard_batch():
    x, y = token_batch(8)
    parts = [distributed.shard_batch((x, {"y": y}), r, 4) for r in range(4)]
    assert torch.equal(torch.cat([p[0] for p in parts]), x)
    assert torch.equal(torch.cat([p[1]["y"] for p in parts]), y)
    with pytest.raises(rotapipe.InputError, match="divisible"):
        distributed.shard_batch(x, 0, 3)
    with pytest.raises(rotapipe.InputError, match="rank=2"):
        distributed.shard_batch(x, 2, 2)
    # A tokenizer's output (a UserDict that PyTorch's pytree does not open) was refused
    # as holding no tensor: it shards as its dict.
    from collections import UserDict
    encoding = UserDict({"input_ids": x, "attention_mask": torch.ones_like(x)})
    half = distributed.shard_batch(encoding, 1, 2)
    assert torch.equal(half["input_ids"], x[4:]) and half["attention_mask"].shape == x[4:].shape
