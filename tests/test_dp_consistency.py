"""Data-parallel ranks must hold the same weights and seed (rotapipe.pipe.consistency).

Before, only the trained parameters' shapes were compared: a rank that seeded its model
differently trained a model of its own with no error (2 ranks, 2 steps later:
embedding sums 6.94 and 33.67), and so did a rank with another ``PipeConfig.seed``
(other dropout streams), or one that alone loaded a state dict.

The 2-rank scenarios run in one launch of this file as a script (``_job``), each rank
recording what every scenario raised; the tests read those records.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import rotapipe  # noqa: E402
from rotapipe.errors import ConfigError  # noqa: E402
from rotapipe.pipe.consistency import WeightCheck, checksum, checksums  # noqa: E402
from models import emulated, lm_loss, tiny_transformer, token_batch  # noqa: E402

SHARDS = ("none", "optimizer")


# -- in process ------------------------------------------------------------------------
def test_checksums_see_every_bit_and_not_the_thread_count():
    t = torch.randn(3_000_000)          # 12 MB: several chunks when CHUNK is small
    one = checksums([t], threads=1)
    assert checksums([t], threads=4) == one
    u = t.clone()
    u[1_234_567] = torch.nextafter(u[1_234_567], torch.tensor(float("inf")))   # one ulp
    assert checksum(u) != one[0]
    assert checksum(t.to(torch.bfloat16)) != checksum(t.to(torch.float16))
    assert checksum(t.view(1000, 3000)) != one[0]                # shape counts
    # A broadcast placeholder (an NF4 parameter's) is read as its one element, not
    # materialized (65,536 x 65,536 fp32 would be 16 GiB).
    big = torch.full((1,), float("nan")).expand(65536, 65536)
    assert checksum(big) == checksum(torch.full((1,), float("nan")).expand(65536, 65536))
    assert checksum(big) != checksum(torch.zeros(1).expand(65536, 65536))


def test_chunked_checksums_match_across_thread_counts(monkeypatch):
    import rotapipe.pipe.consistency as c
    monkeypatch.setattr(c, "CHUNK", 1 << 16)
    ts = [torch.randn(100_000), torch.randn(7), torch.zeros(0), torch.ones(3, dtype=torch.bool)]
    assert checksums(ts, threads=1) == checksums(ts, threads=3)


def _check(model, seed=0) -> WeightCheck:
    layerset = rotapipe.model.LayerSet(model)
    return WeightCheck(layerset, type("Host", (), {"quantized": {}})(), seed, lambda: 0)


def test_compare_names_the_first_differing_parameter_and_the_fix():
    a, b = _check(tiny_transformer()), _check(tiny_transformer())
    same = [a.payload(), b.payload()]
    a.compare(same, [0, 1])
    with torch.no_grad():
        b.layerset.params[3].add_(1e-3)
    with pytest.raises(ConfigError) as e:
        a.compare([a.payload(), b.payload()], [0, 1])
    msg = str(e.value)
    assert f"parameter {a.layerset.param_names[3]} differs between rank 0 and rank 1" \
        in msg and "1 of" in msg and "Seed the model identically" in msg, msg
    s = _check(tiny_transformer(), seed=7)
    with pytest.raises(ConfigError, match=r"PipeConfig.seed is 0 on rank 0 but 7 on rank 2"):
        a.compare([a.payload(), a.payload(), s.payload()], [0, 1, 2])


def test_one_rank_group_skips_the_comparison(one_rank_group):
    """A one-rank group builds, loads and trains as before, reading no weight (one
    rank has nothing to compare with)."""
    dp = rotapipe.DataParallelConfig(enabled=True, timeout_s=10)
    with rotapipe.RoundPipe(tiny_transformer(), lm_loss,
                            config=emulated(2, 2, data_parallel=dp)) as pipe:
        pipe.attach_optimizer(torch.optim.AdamW(pipe.parameters(), lr=1e-2))
        x, y = token_batch(4)
        pipe.train_step(x, y)
        pipe.load_state_dict({k: v.clone() for k, v in pipe.state_dict().items()})
        pipe.train_step(x, y)
        assert pipe._agree.loads == 1 and pipe._agree.checked == 0


# -- two ranks ---------------------------------------------------------------------------
def _scenarios(info, shard: str) -> dict[str, str]:
    """Each scenario: ``"ok"`` or the message it raised (the same ConfigError on both
    ranks is what the tests want)."""
    dp = rotapipe.DataParallelConfig(timeout_s=20, heartbeat_s=0.25, shard=shard)
    x, y = rotapipe.distributed.shard_batch(token_batch(8), info.rank, info.world_size)
    out = {}

    def run(name, fn):
        try:
            fn()
            out[name] = "ok"
        except ConfigError as exc:
            out[name] = str(exc)

    def build(model_seed=0, seed=0):
        return rotapipe.RoundPipe(tiny_transformer(seed=model_seed), lm_loss,
                                  config=emulated(2, 2, data_parallel=dp, seed=seed),
                                  optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))

    def different_init():
        with build(model_seed=info.rank):
            pass

    def different_seed():
        with build(seed=info.rank):
            pass

    def load_on_one_rank(then_step: bool):
        with build() as pipe:
            pipe.train_step(x, y)
            other = {k: v.clone() for k, v in pipe.state_dict().items()}
            if info.rank == 1:
                with torch.no_grad():
                    for v in other.values():
                        v.mul_(1.5)
                pipe.load_state_dict(other)
            try:
                if then_step:
                    pipe.step()
                else:
                    pipe.forward_backward(x, y)
            finally:
                # Fixed: every rank loads the same state, and trains on.
                same = {k: v.clone() for k, v in tiny_transformer(seed=5).state_dict().items()}
                pipe.load_state_dict(same)
                pipe.train_step(x, y)

    def pipeline_state_on_one_rank():
        with build() as pipe:
            pipe.train_step(x, y)
            if info.rank == 1:
                pipe.load_pipeline_state({**pipe.pipeline_state(), "calls": 7})
            pipe.train_step(x, y)

    def same_load_everywhere():
        with build() as pipe:
            pipe.load_state_dict(tiny_transformer(seed=3).state_dict())
            pipe.train_step(x, y)

    run("different_init", different_init)
    run("different_seed", different_seed)
    run("load_then_call", lambda: load_on_one_rank(False))
    if shard != "none":
        run("load_then_step", lambda: load_on_one_rank(True))
    run("pipeline_state", pipeline_state_on_one_rank)
    run("same_load", same_load_everywhere)
    return out


def _job(out_path: str) -> None:
    torch.set_num_threads(1)
    info = rotapipe.distributed.init_from_env(timeout_s=60)
    result = {shard: _scenarios(info, shard) for shard in SHARDS}
    with open(out_path, "w") as f:
        json.dump(result, f)
    rotapipe.distributed.shutdown()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    import subprocess
    from test_distributed import _finish
    from train_util import free_port
    tmp = tmp_path_factory.mktemp("dp_consistency")
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, __file__, str(tmp / f"rank{r}.json")],
        env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK="0",
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    for p in procs:
        rc, err = _finish(p, 240)
        assert rc == 0, err
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("shard", SHARDS)
def test_ranks_seeding_their_models_differently_fail_at_construction(two_ranks, shard):
    for rank in two_ranks:
        msg = rank[shard]["different_init"]
        assert "parameter 0.emb.weight differs between rank 0 and rank 1" in msg, msg
        assert "Seed the model identically on every rank" in msg, msg


@pytest.mark.parametrize("shard", SHARDS)
def test_ranks_with_different_pipe_seeds_fail_at_construction(two_ranks, shard):
    for rank in two_ranks:
        msg = rank[shard]["different_seed"]
        assert "PipeConfig.seed is 0 on rank 0 but 1 on rank 1" in msg, msg


@pytest.mark.parametrize("shard", SHARDS)
def test_a_state_dict_loaded_on_one_rank_fails_the_next_call_on_every_rank(two_ranks, shard):
    """Rank 1 alone loads other weights: the next ``forward_backward`` (and, sharded, a
    bare ``step()``, whose all-gather would mix the ranks' weights) raises on both
    ranks; loading the same state everywhere then trains on."""
    for rank in two_ranks:
        for scenario in ("load_then_call",) + (("load_then_step",) if shard != "none" else ()):
            msg = rank[shard][scenario]
            assert "after a load on some rank" in msg and \
                "parameter 0.emb.weight differs between rank 0 and rank 1" in msg and \
                "Load the same checkpoint on every rank" in msg, (scenario, msg)
        assert rank[shard]["same_load"] == "ok"


@pytest.mark.parametrize("shard", SHARDS)
def test_a_pipeline_state_loaded_on_one_rank_fails_the_next_call(two_ranks, shard):
    for rank in two_ranks:
        msg = rank[shard]["pipeline_state"]
        assert "pipe.calls is 1 on rank 0 but 7 on rank 1" in msg, msg


if __name__ == "__main__":
    _job(sys.argv[1])
