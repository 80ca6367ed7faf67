"""Timeline pictures, Chrome traces and the ``rotapipe simulate`` command."""

import json
import re

import pytest

from rotapipe.cli import main
from rotapipe.plan import ModelCosts
from rotapipe.sim import SimConfig, build_schedule, simulate
from rotapipe.sim.trace import chrome_trace, write_trace

COSTS = ModelCosts.explicit(6, 2.0, 4.0, head_forward_ms=5.0, head_backward_ms=9.0,
                            hop_ms=0.4, upload_ms=1.0)


def test_trace_is_chrome_json_with_one_process_per_device(tmp_path):
    r = simulate(build_schedule("roundpipe-stale", COSTS, SimConfig(3, 4, calls=2)), COSTS)
    trace = chrome_trace(r.timeline)
    events = trace["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == len(r.timeline.spans)
    names = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "process_name"}
    assert names == {(0, "device 0"), (1, "device 1"), (2, "device 2"), (3, "host")}
    threads = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert threads == {"compute", "upload link", "download link", "host"}
    first = min(spans, key=lambda e: (e["ts"], e["pid"]))
    sp = min(r.timeline.spans, key=lambda s: (s.start, s.worker))
    assert first["ts"] == pytest.approx(sp.start * 1e3) and first["dur"] >= 0
    assert {"kind", "stage", "call"} <= set(spans[0]["args"])
    path = write_trace(r.timeline, tmp_path / "t.json")
    assert json.loads(path.read_text())["traceEvents"] == json.loads(json.dumps(events))


def test_gantt_png_is_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    from rotapipe.sim.gantt import draw_gantt

    for name in ("1f1b", "roundpipe"):
        r = simulate(build_schedule(name, COSTS, SimConfig(3, 4)), COSTS)
        path = draw_gantt(r.timeline, tmp_path / f"{name}.png", r.report)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def _table(out: str) -> dict[str, list[str]]:
    rows = {}
    for line in out.splitlines():
        cells = re.sub(r" \(\d+ calls\)", "", line).split()
        if cells and cells[0] in ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs",
                                  "roundpipe", "roundpipe-stale"):
            rows[cells[0]] = cells
    return rows


def test_simulate_command_with_explicit_times(capsys, tmp_path):
    rc = main(["simulate", "--layers", "28", "--fwd-ms", "7.43", "--bwd-ms", "15.83",
               "--head-fwd-ms", "22.07", "--head-bwd-ms", "43.71", "--hop-ms", "1.6",
               "--devices", "8", "--microbatches", "16", "--schedules", "1f1b,roundpipe,stale",
               "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = _table(out)
    assert list(rows) == ["1f1b", "roundpipe", "roundpipe-stale"]
    bubble = {k: float(v[3].rstrip("%")) for k, v in rows.items()}
    assert 31 <= bubble["1f1b"] <= 42           # the paper's simulated ranges
    assert 3 <= bubble["roundpipe"] <= 19
    assert bubble["roundpipe-stale"] <= 4
    assert rows["1f1b"][9] == "1.00x"
    for name in rows:
        assert (tmp_path / f"{name}.png").exists() and (tmp_path / f"{name}.trace.json").exists()
        assert f"{tmp_path / name}.png" in out


def test_simulate_command_on_a_32b_config(capsys):
    # How long it takes is measured by benchmarks/plan_time.py, not asserted here (a
    # wall-clock bar fails on a loaded machine).
    rc = main(["simulate", "--model", "qwen3-32b", "--hardware", "rtx4090x8"])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = _table(out)
    assert len(rows) == 6 and "OOM" in rows["1f1b"][-1] and "OOM" not in rows["roundpipe"][-1]
    assert re.search(r"qwen3-32b on rtx4090x8 \(99 TFLOPS sustained", out)


def test_simulate_prices_lora_qlora_and_a_whole_embedding_as_the_planner_does(capsys):
    """``--lora`` / ``--qlora`` / ``--whole-embedding`` reach the cost model: the
    RoundPipe step is the simulation of ``model_costs`` with the same adapters,
    quantization and embedding rows, not of full fine-tuning."""
    from rotapipe.plan import hardware, lora_params, model_costs
    from rotapipe.sim import compare
    hw = hardware("rtx4090x8")
    steps = {}
    for flags, kwargs in [((), dict(call_tokens=16 * 2048)),
                          (("--lora", "--lora-rank", "16"),
                           dict(call_tokens=16 * 2048,
                                adapters=lora_params("qwen3-1.7b", 16))),
                          (("--qlora", "--lora-rank", "16"),
                           dict(call_tokens=16 * 2048, quantize="nf4",
                                adapters=lora_params("qwen3-1.7b", 16))),
                          (("--whole-embedding",), {})]:
        assert main(["simulate", "--model", "qwen3-1.7b", "--schedules", "exact",
                     *flags]) == 0
        out = capsys.readouterr().out
        if flags[:1] == ("--lora",):
            assert "qwen3-1.7b (LoRA rank 16) on rtx4090x8" in out
        step = float(_table(out)["roundpipe"][1])
        costs = model_costs("qwen3-1.7b", hw, seq=2048, **kwargs)
        want = compare(costs, SimConfig(8, 16, memory_limit=hw.device.memory_bytes),
                       ("roundpipe",))[0].report.step_ms
        assert step == pytest.approx(want, abs=0.051), flags
        steps[flags] = step
    assert len(set(steps.values())) == 4            # each flag changes the step


@pytest.mark.parametrize("argv, match", [
    (["simulate", "--layers", "4"], "missing --fwd-ms, --bwd-ms"),
    (["simulate", "--layers", "4", "--fwd-ms", "1", "--bwd-ms", "2", "--head-fwd-ms", "1",
      "--head-bwd-ms", "2", "--lora"], "--lora needs --model"),
    (["simulate", "--model", "qwen3-32b", "--schedules", "1f1b,zb-v"], "unknown schedule 'zb-v'"),
    (["simulate", "--model", "qwen3-32b", "--hardware", "v100x8"], "unknown hardware"),
    (["simulate", "--model", "qwen3-32b", "--global-batch", "17"], "not a multiple"),
    (["simulate", "--model", "nope.json"], "no model config"),
])
def test_simulate_command_errors_are_one_line(capsys, argv, match):
    assert main(argv) == 2                       # a wrong flag or setting: usage
    err = capsys.readouterr().err
    assert re.search(match, err) and "Traceback" not in err
