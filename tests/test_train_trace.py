"""``rotapipe train --trace``: a Chrome/Perfetto trace of a real 2-worker step that
parses as the documented trace event format and shows the round-robin alternation of
stage jobs between the workers; a bubble ratio in every metrics line."""

from __future__ import annotations

import json

import pytest

from rotapipe import Plan
from rotapipe.train import TrainConfig, train
from train_util import TINY, text_jsonl

pytest.importorskip("transformers")


def test_trace_of_a_two_worker_step_shows_round_robin(tmp_path):
    data = text_jsonl(tmp_path / "t.jsonl", 120)
    out = tmp_path / "o"
    cfg = TrainConfig(**{**TINY, "layers": 4}, data=str(data), out_dir=str(out), steps=3,
                      eval_interval=0, trace=True)
    train(cfg, echo=lambda s: None)
    trace = json.loads((out / "trace.json").read_text())
    assert (out / "timeline.png").stat().st_size > 1000
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert events and all(isinstance(e["ts"], (int, float)) and e["dur"] >= 0 and
                          {"name", "pid", "tid", "cat"} <= e.keys() for e in events)
    meta = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"
            and e["name"] == "process_name"}
    assert {"device 0", "device 1"} <= meta
    # Every stage job ran on worker (job index % 2): the workers alternate.
    compute = [e for e in events if e["cat"] in ("forward", "fused", "recompute",
                                                 "backward")]
    worker_of = {}
    for e in compute:
        worker_of.setdefault(e["args"]["stage"], set()).add(e["pid"])
    jobs = [s.name for s in Plan.from_text(trace["otherData"]["plan"]).jobs()]
    assert len(jobs) >= 4 and set(jobs) == set(worker_of)
    assert [worker_of[name] for name in jobs] == [{j % 2} for j in range(len(jobs))]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "loss" in m]
    assert len(steps) == 3 and all(0.0 <= m["bubble"] < 1.0 for m in steps)
