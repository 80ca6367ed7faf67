"""`rotapipe train` unchanged under torchrun: 2 ranks over gloo on loopback train to
the same weights as 1 process with the same global batch; rank 0 alone writes
metrics.jsonl, checkpoints and the export."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from train_util import env, flags, free_port, run_here, text_jsonl

pytest.importorskip("transformers")
if not torch.distributed.is_available():
    pytest.skip("this torch build has no torch.distributed", allow_module_level=True)


def torchrun(args: list[str], nproc: int = 2, timeout: float = 120):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           "-m", "rotapipe", "train", *args]
    return subprocess.run(cmd, env={**env(), "LOGLEVEL": "WARNING"}, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_two_ranks_equal_one_process_and_resume_across_world_sizes(tmp_path):
    """2 ranks end where 1 process with the global batch does; the 2-rank step-2
    checkpoint resumes in 1 process and the 1-process one on 2 ranks, and both end
    there too. Slow (25 s): the default run covers 2 ranks against one process in
    tests/test_distributed.py::test_two_ranks_equal_one_process_with_the_whole_batch and
    a torchrun resume in another world size in
    test_sharded_training_resumes_exactly_and_reshards."""
    import shutil
    data = text_jsonl(tmp_path / "d.jsonl", 300)
    common = dict(data=str(data), steps=3, batch=8, eval_interval=2, save_interval=2,
                  dist_timeout=60, lr=2e-3)
    two = torchrun(flags(out_dir=str(tmp_path / "two"), microbatches=2, **common))
    assert two.returncode == 0, two.stdout + two.stderr
    # rank 0 alone prints: each progress line once
    assert two.stdout.count("exported model to") == 1, two.stdout
    assert "data parallel: 2 ranks" in two.stdout
    one = run_here(flags(out_dir=str(tmp_path / "one"), microbatches=4, **common))
    assert one.returncode == 0, one.stdout + one.stderr

    steps = [json.loads(l)["step"] for l in (tmp_path / "two" / "metrics.jsonl")
             .read_text().splitlines()]
    assert steps == [0, 1, 2, 3]
    m2 = [json.loads(l) for l in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    m1 = [json.loads(l) for l in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    for a, b in zip(m1[1:], m2[1:]):      # the reported loss is the global mean
        assert a["tokens"] == b["tokens"]
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]) + 1e-6
    names = sorted(p.name for p in (tmp_path / "two" / "checkpoints").iterdir())
    assert names == ["step-00000002", "step-00000003"]          # no .tmp- leftovers

    fa = _final(tmp_path / "one")
    fb = _final(tmp_path / "two")
    assert fa.keys() == fb.keys()
    for k in fa:
        torch.testing.assert_close(fb[k], fa[k], rtol=1e-5, atol=1e-6, msg=k)

    # Across world sizes: 2 ranks -> 1 process, 1 process -> 2 ranks, from step 2.
    for src, out, world, mb in (("two", "a", 1, 4), ("one", "b", 2, 2)):
        shutil.copytree(tmp_path / src / "checkpoints" / "step-00000002",
                        tmp_path / out / "checkpoints" / "step-00000002")
        args = flags(out_dir=str(tmp_path / out), microbatches=mb, resume=True, **common)
        then = torchrun(args) if world > 1 else run_here(args)
        assert then.returncode == 0, then.stdout + then.stderr
        assert then.stdout.count("resumed from") == 1, then.stdout
        got = _final(tmp_path / out)
        for k in fa:
            torch.testing.assert_close(got[k], fa[k], rtol=1e-5, atol=1e-6,
                                       msg=f"{src} -> {world}: {k}")
        steps = [json.loads(l)["step"] for l in (tmp_path / out / "metrics.jsonl")
                 .read_text().splitlines()]
        assert steps == [3], (out, steps)


def test_a_batch_that_does_not_split_over_the_ranks_is_one_line(tmp_path):
    data = text_jsonl(tmp_path / "d.jsonl", 100)
    bad = torchrun(flags(data=str(data), out_dir=str(tmp_path / "o"), steps=1, batch=6,
                         microbatches=6))
    assert bad.returncode != 0
    lines = [l for l in bad.stderr.splitlines() if l.startswith("rotapipe train: error")]
    assert lines and "batch=6" in lines[0] and "2 ranks" in lines[0], bad.stderr


def test_a_time_limit_stops_every_rank_at_the_same_step(tmp_path):
    data = text_jsonl(tmp_path / "d.jsonl", 300)
    r = torchrun(flags(data=str(data), out_dir=str(tmp_path / "o"), batch=8, steps=100_000,
                       eval_interval=0, save_interval=0, time_limit=1.0, export=False,
                       dist_timeout=60))
    assert r.returncode == 0, r.stdout + r.stderr
    steps = [json.loads(l)["step"] for l in (tmp_path / "o" / "metrics.jsonl")
             .read_text().splitlines()]
    assert steps == list(range(1, steps[-1] + 1)) and steps[-1] > 1
    ck = sorted(p.name for p in (tmp_path / "o" / "checkpoints").iterdir())
    assert ck == [f"step-{steps[-1]:08d}"]


def _spawn(args: list[str]) -> list[subprocess.Popen]:
    """Two ranks started with torchrun's variables by hand (so a test can signal one)."""
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        e = {**env(), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        procs.append(subprocess.Popen([sys.executable, "-m", "rotapipe", "train", *args],
                                      env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    return procs


def _wait_for_steps(metrics, proc, n: int) -> None:
    import time
    end = time.monotonic() + 60
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= n):
        assert proc.poll() is None and time.monotonic() < end, proc.communicate()
        time.sleep(0.05)


def test_ctrl_c_on_one_rank_stops_both_after_the_same_step(tmp_path):
    import signal
    data = text_jsonl(tmp_path / "d.jsonl", 300)
    procs = _spawn(flags(data=str(data), out_dir=str(tmp_path / "o"), batch=8,
                         steps=100_000, eval_interval=0, save_interval=0, dist_timeout=20))
    try:
        _wait_for_steps(tmp_path / "o" / "metrics.jsonl", procs[0], 2)
        procs[1].send_signal(signal.SIGINT)                 # rank 1 alone gets Ctrl-C
        (out0, err0), (out1, err1) = (p.communicate(timeout=60) for p in procs)
        assert procs[0].returncode == 0 and procs[1].returncode == 0, err0 + err1
        steps = [json.loads(l)["step"] for l in (tmp_path / "o" / "metrics.jsonl")
                 .read_text().splitlines()]
        ck = sorted(p.name for p in (tmp_path / "o" / "checkpoints").iterdir())
        assert ck == [f"step-{steps[-1]:08d}"]
        assert f"stopped at step {steps[-1]}" in out0 and "stopped" not in out1
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()


def test_a_killed_rank_ends_the_other_with_a_one_line_error(tmp_path):
    """Two processes started with torchrun's variables by hand (one torchrun agent would
    stop the survivor itself); SIGKILL rank 1 mid-run: rank 0 exits 1 naming it."""
    import os
    import signal
    import time
    data = text_jsonl(tmp_path / "d.jsonl", 300)
    procs = _spawn(flags(data=str(data), out_dir=str(tmp_path / "o"), batch=8,
                         steps=100_000, eval_interval=0, save_interval=0, dist_timeout=20))
    try:
        _wait_for_steps(tmp_path / "o" / "metrics.jsonl", procs[0], 2)
        procs[1].send_signal(signal.SIGKILL)
        t = time.monotonic()
        out, err = procs[0].communicate(timeout=40)
        assert procs[0].returncode == 1, err
        assert time.monotonic() - t < 25
        lines = [l for l in err.splitlines() if l.startswith("rotapipe train: error")]
        assert len(lines) == 1 and "rank 1" in lines[0], err
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
            p.communicate()



def test_a_rank_short_of_host_ram_stops_every_rank_before_loading(tmp_path):
    """Rank 1's server has 1 kB free (its available_ram replaced in that process
    alone): it refuses the run, and rank 0 stops too, at once, naming rank 1, instead
    of waiting in the next collective until dist_timeout."""
    data = text_jsonl(tmp_path / "d.jsonl", 100)
    args = flags(data=str(data), out_dir=str(tmp_path / "o"), batch=8, steps=2,
                 dist_timeout=120)
    short = ("import sys, rotapipe.runtime.pinning as p; p.machine_ram = lambda: 1000; "
             "p.cgroup_room = lambda: None; from rotapipe.cli import main; "
             "sys.exit(main(['train', *sys.argv[1:]]))")
    port = str(free_port())
    procs = []
    for rank, cmd in ((0, ["-m", "rotapipe", "train"]), (1, ["-c", short])):
        e = {**env(), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
             "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        procs.append(subprocess.Popen([sys.executable, *cmd, *args], env=e,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    try:
        (_, err0), (_, err1) = (p.communicate(timeout=90) for p in procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    errors = [[l for l in err.splitlines() if l.startswith("rotapipe train: error")]
              for err in (err0, err1)]
    assert procs[1].returncode == 2 and "model state needs" in errors[1][0], err1
    assert procs[0].returncode == 2 and errors[0] == [
        "rotapipe train: error: rank 1 refused this run: the model state does not fit the "
        "host RAM there (that rank's error names the settings that fit). Every rank stops "
        "before loading; free memory on that server or shrink the state on all ranks."], err0
    assert not (tmp_path / "o" / "metrics.jsonl").exists()

def _final(out) -> dict:
    return load_file(str(out / "final" / "model.safetensors"))


def test_sharded_training_resumes_exactly_and_reshards(tmp_path):
    """`--shard` under torchrun, 3 steps on 2 ranks (`optimizer`): each checkpoint
    holds one shard per rank and the consolidated fp32 masters (the exported weights).
    Resuming its step-2 checkpoint on 2 ranks ends bit-identical to it. Resharding:
    its step-1 checkpoint resumed in 1 process for steps 2 and 3 ends at its weights
    (fp32 tolerance: the batch is cut into other microbatches). 2 -> 3 -> 1 ranks and
    3-rank shards are tests/test_shard.py::test_resume_reshards_2_to_3_to_1's (the
    library), as is that sharded ranks equal one process with the whole batch."""
    import shutil
    from rotapipe.train.checkpoint import load_shards
    data = text_jsonl(tmp_path / "d.jsonl", 300)
    common = dict(data=str(data), steps=3, batch=12, eval_interval=0, save_interval=1,
                  dist_timeout=60, lr=2e-3)
    a = torchrun(flags(out_dir=str(tmp_path / "a"), microbatches=2, shard="optimizer",
                       **common))
    assert a.returncode == 0, a.stdout + a.stderr
    assert "shard optimizer: each rank holds 1/2" in a.stdout, a.stdout
    got = want = _final(tmp_path / "a")
    ck = tmp_path / "a" / "checkpoints"
    assert sorted(p.name for p in ck.iterdir()) == [f"step-0000000{i}" for i in (1, 2, 3)]
    shards = load_shards(ck / "step-00000003")
    assert [s["rank"] for s in shards] == [0, 1] and all(s["world"] == 2 for s in shards)
    # The consolidated masters are the exported weights (fp32, the model's names).
    masters = load_file(str(ck / "step-00000003" / "masters.safetensors"))
    for k, v in masters.items():
        assert torch.equal(v, got[k]), k

    def resume_from_copy(name: str, step: int, world: int, **extra):
        (tmp_path / name / "checkpoints").mkdir(parents=True)
        shutil.copytree(ck / f"step-{step:08d}",
                        tmp_path / name / "checkpoints" / f"step-{step:08d}")
        args = flags(out_dir=str(tmp_path / name), resume=True, **{**common, **extra})
        r = torchrun(args, nproc=world) if world > 1 else run_here(args)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "resumed from" in r.stdout, r.stdout
        return r

    # Exact resume on the same world size.
    resume_from_copy("c", 2, 2, microbatches=2, shard="optimizer")
    again = _final(tmp_path / "c")
    for k in got:
        assert torch.equal(again[k], got[k]), k
    # 2 -> 1: the step-1 checkpoint in one process, for steps 2 and 3.
    resume_from_copy("b", 1, 1, microbatches=4)
    b = tmp_path / "b"
    final = _final(b)
    for k in want:
        torch.testing.assert_close(final[k], want[k], rtol=1e-5, atol=1e-6, msg=k)
    steps = [json.loads(l)["step"] for l in (b / "metrics.jsonl").read_text().splitlines()]
    assert steps == [2, 3], steps


def test_shard_without_torchrun_is_one_line(tmp_path, capsys):
    from rotapipe.cli import main       # in this process: exit code and stderr
    data = text_jsonl(tmp_path / "d.jsonl", 50)
    rc = main(["train", *flags(data=str(data), out_dir=str(tmp_path / "o"), steps=1,
                               shard="optimizer")])
    err = capsys.readouterr().err
    assert rc == 2
    lines = [l for l in err.splitlines() if l.startswith("rotapipe train: error")]
    assert lines and "torchrun --nproc-per-node" in lines[0] and "--shard" in lines[0], err
    rc = main(["train", *flags(data=str(data), out_dir=str(tmp_path / "o"), steps=1,
                               grad_dtype="bf16")])
    err = capsys.readouterr().err
    assert rc == 2 and "--shard optimizer" in err, err
