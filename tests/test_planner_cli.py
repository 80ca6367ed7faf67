"""`rotapipe plan`: text and JSON output, the host-RAM verdict, and a 235B MoE config
planned quickly without allocating weights."""

import json
import pathlib
import resource
import time

import pytest

import rotapipe
from rotapipe.cli import main


def _json(capsys, *argv):
    rc = main(["plan", *argv, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_plan_json_for_a_small_model_fits(capsys):
    rc, out = _json(capsys, "qwen3-1.7b", "--hardware", "rtx4090x8", "--seq", "2048",
                    "--global-batch", "16", "--microbatches", "16")
    assert rc == 0 and out["fits"] and out["fits_device"] and out["fits_host"]
    assert out["microbatches"] == 16 and out["tokens_per_microbatch"] == 2048
    assert out["device_bytes"] <= out["device_limit_bytes"]
    assert 0 < out["bubble"] < 1 and 0 < out["mfu"] < 1 and out["tokens_per_s"] > 1000
    assert out["plan"].startswith("F0[0:") and " T[" in out["plan"]
    assert out["longest_seq"] >= 2048 and out["suggestions"] == []
    assert out["host_bytes"]["total"] == sum(v for k, v in out["host_bytes"].items()
                                             if k != "total")


def test_plan_says_how_much_host_ram_and_suggests_lora(capsys):
    rc = main(["plan", "qwen3-32b", "--hardware", "rtx4090x1", "--host-ram", "512",
               "--microbatches", "16", "--layout", "sync"])
    text = capsys.readouterr().out
    assert rc == 3                     # does not fit with the default (sync) layout
    assert "binding constraint: host memory" in text
    assert "needs 7" in text and "GB of host RAM, you have 512" in text
    assert "suggestion: LoRA" in text
    # Without --layout the planner takes the lean layout, which fits, and names it.
    rc = main(["plan", "qwen3-32b", "--hardware", "rtx4090x1", "--host-ram", "512",
               "--microbatches", "16"])
    text = capsys.readouterr().out
    assert rc == 0 and "host layout: lean" in text and "undo_steps=False" in text
    rc, out = _json(capsys, "qwen3-32b", "--hardware", "rtx4090x1", "--host-ram", "512",
                    "--microbatches", "16", "--lora")
    assert rc == 0 and out["fits"] and out["lora"]
    assert out["host_bytes"]["optimizer"] < 2e9   # adapters only: 134M params x 8 bytes


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def test_plan_of_a_235b_moe_is_fast_and_allocates_no_weights(capsys):
    before = _rss()
    t = time.process_time()   # CPU time: robust to other processes on a shared machine
    rc, out = _json(capsys, "qwen3-235b-a22b", "--hardware", "rtx4090x8", "--lora",
                    "--seq", "4096", "--global-batch", "8", "--microbatches", "8",
                    "--host-ram", "1024")
    elapsed = time.process_time() - t
    assert elapsed < 10, f"took {elapsed:.1f} s of CPU"
    assert _rss() - before < 300 * 2**20    # 470 GB of bf16 weights never materialise
    assert rc == 0 and out["fits"] and out["host_bytes"]["weights"] > 400e9


def test_plan_reports_a_layer_that_cannot_fit(capsys):
    rc, out = _json(capsys, "qwen3-32b", "--hardware", "rtx4090x8", "--seq", "131072",
                    "--global-batch", "1")
    assert rc == 3 and not out["fits_device"] and out["binding"] == "device"
    assert "alone needs" in out["device_error"] and "usable device memory" in out["device_error"]
    assert any("longest sequence" in s for s in out["suggestions"])


def test_plan_says_which_pin_mode_it_assumed_and_what_is_page_locked(capsys):
    argv = ["qwen3-1.7b", "--hardware", "rtx4090x2", "--microbatches", "16"]
    rc = main(["plan", *argv])
    text = capsys.readouterr().out
    assert rc == 0 and 'page-locked (pin="register")' in text
    out = {m: _json(capsys, *argv, "--pin", m)[1] for m in ("copy", "register", "off")}
    reg = out["register"]
    assert reg["pin"] == "register"
    host = reg["host_bytes"]
    # The embedding moves by rows (16 x 2048 tokens: 134 MB of rows), gathered into
    # two bounce buffers per worker of one 32 MiB chunk each, in every pin mode.
    assert host["bounce_buffers"] == 2 * 2 * 32 * 2**20
    assert reg["host_pinned_bytes"] == (host["weights"] + host["pinned_buffers"]
                                        + host["checkpoints"] + host["bounce_buffers"])
    # copy: the same page-locked bytes, plus one weight held twice while copied: bounded
    # by the largest layer, the head (151936 x 2048 projection and its 2048 norm)
    assert out["copy"]["host_pinned_bytes"] == reg["host_pinned_bytes"]
    assert out["copy"]["host_bytes"]["transient"] == (151936 + 1) * 2048 * 2
    # off: the weights leave the page-locked set; the pageable weights stream through
    # the same 2 workers x 2 chunks of 32 MiB
    off = out["off"]
    assert off["host_bytes"]["bounce_buffers"] == 2 * 2 * 32 * 2**20
    assert off["host_pinned_bytes"] == reg["host_pinned_bytes"] - host["weights"]
    _, small = _json(capsys, *argv, "--pin", "off", "--copy-chunk-mb", "8")
    assert small["host_bytes"]["bounce_buffers"] == 2 * 2 * 8 * 2**20
    # A call of 128 tokens moves 128 rows of 2048 bf16 values: buffers of that size.
    _, few = _json(capsys, "qwen3-1.7b", "--hardware", "rtx4090x2", "--seq", "128",
                   "--global-batch", "1")
    assert few["host_bytes"]["bounce_buffers"] == 2 * 2 * 128 * 2048 * 2


def test_plan_of_a_named_model_or_a_config_file_does_not_import_torch():
    # The planner is pure arithmetic on a config: `rotapipe plan` (full, LoRA, a
    # config.json path, JSON output) loads neither torch nor transformers, which cost
    # about a second of every run.
    import os
    import pathlib
    import subprocess
    import sys

    src = pathlib.Path(__file__).resolve().parents[1] / "src"
    config = src / "rotapipe" / "data" / "configs" / "qwen3-1.7b.json"
    code = ("import sys; from rotapipe.cli import main\n"
            f"for argv in (['plan', 'qwen3-1.7b', '--microbatches', '16'],"
            f" ['plan', {str(config)!r}, '--lora', '--microbatches', '16', '--json']):\n"
            "    assert main(argv) == 0, argv\n"
            "print('imported', 'torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": str(src)})
    assert "plan: " in out.stdout and '"fits": true' in out.stdout, out.stdout
    assert out.stdout.strip().endswith("imported False False"), out.stdout


def test_plan_lora_example_runs_and_lora_plans_faster_than_full(capsys, monkeypatch):
    """examples/plan_lora.py: a LoRA block's backward and gradient download are shorter
    than full fine-tuning's (frozen weights), its upload the same, and the planned
    LoRA step is shorter."""
    import pathlib
    import re
    import runpy
    import sys

    script = pathlib.Path(__file__).resolve().parents[1] / "examples" / "plan_lora.py"
    monkeypatch.setattr(sys, "argv", [str(script)])
    runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr().out
    rows = re.findall(r"backward +([\d.]+) ms  weight upload +([\d.]+) ms  gradient "
                      r"download +([\d.]+) ms", out)
    (full_bw, full_up, full_dw), (lora_bw, lora_up, lora_dw) = [tuple(map(float, r))
                                                                for r in rows]
    assert lora_bw < 0.6 * full_bw and lora_up == full_up and lora_dw < 0.05 * full_dw
    steps = [float(s) for s in re.findall(r"step ([\d.]+) s", out)]
    assert len(steps) == 2 and steps[1] < steps[0], out


def test_plan_grad_dtype_reaches_the_per_server_table(capsys):
    _, out = _json(capsys, "qwen3-1.7b", "--nodes", "2", "--grad-dtype", "bfloat16")
    assert out["grad_dtype"] == "bfloat16"
    assert [m["layout"] for m in out["servers"]] and all(
        m["layout"] in ("sync", "lean") for m in out["servers"])
    _, f32 = _json(capsys, "qwen3-1.7b", "--nodes", "2")
    none, opt = (out["servers"][i]["sent_bytes_per_step"] for i in (0, 1))
    assert none == f32["servers"][0]["sent_bytes_per_step"]
    assert opt < f32["servers"][1]["sent_bytes_per_step"]


def test_plan_says_when_the_sequence_is_beyond_the_models_positions(capsys):
    assert main(["plan", "qwen3-1.7b", "--seq", "65536", "--global-batch", "1"]) == 0
    out = capsys.readouterr().out
    assert "suggestion: --seq 65,536 is beyond the model's max_position_embeddings " \
           "(40,960)" in out, out
    assert main(["plan", "qwen3-1.7b", "--seq", "40960", "--global-batch", "1"]) == 0
    assert "max_position_embeddings" not in capsys.readouterr().out


def _modes(capsys, *argv):
    rc, out = _json(capsys, "qwen3-1.7b", "--microbatches", "16", "--modes", *argv)
    assert rc == 0
    return out["optimizer"]


def test_plan_prices_each_optimizer_mode_with_the_host_optimizer(capsys):
    """``--modes``: the step of sync (the call, then the whole step), overlap and stale
    (the steady state of pipelined calls) with the host optimizer at
    ``--optimizer-rate``; a free optimizer leaves the call, a slow one binds every mode,
    and clipping makes overlap's next call wait for the whole step."""
    from rotapipe.plan import model_work
    m = _modes(capsys)
    # Qwen3-1.7B's head is tied to its embedding: one tensor, stepped once
    works = model_work("qwen3-1.7b", 2048)
    assert m["params"] == sum(w.params for w in works) - works[0].params
    assert m["rate"] == 5e9 and m["step_ms"] == m["params"] / 5e9 * 1e3
    assert m["sync_ms"] == m["call_ms"] + m["step_ms"]
    # An exact step lasts at least one call; stale hides the fill, drain and steps.
    assert m["stale_ms"] < m["call_ms"] < m["overlap_ms"] < m["sync_ms"]
    free = _modes(capsys, "--optimizer-rate", "1e15")
    assert free["call_ms"] == m["call_ms"] and free["sync_ms"] < 1.0001 * free["call_ms"]
    assert free["stale_ms"] < free["call_ms"] <= free["overlap_ms"] < m["overlap_ms"]
    slow = _modes(capsys, "--optimizer-rate", "2e8")    # 10 s a step against a 0.65 s call
    for mode in ("sync", "overlap", "stale"):
        assert slow["step_ms"] <= slow[f"{mode}_ms"] <= 1.1 * slow["step_ms"] + slow["call_ms"]
    assert slow["stale_ms"] < 1.02 * slow["step_ms"]    # the host lane never idles
    # A clip that takes effect: one whole step once each call is complete, which
    # overlap's next call waits for: about sync.
    clipped = _modes(capsys, "--clip")
    assert clipped["clip"] and clipped["sync_ms"] == m["sync_ms"]
    assert 0.99 * m["sync_ms"] < clipped["overlap_ms"] < 1.01 * m["sync_ms"]
    assert m["stale_ms"] < clipped["stale_ms"] < clipped["overlap_ms"]


def test_plan_prints_the_host_optimizer_and_each_servers_share(capsys):
    """Text: the optimizer's step and sync's always, overlap and stale with
    ``--modes``; LoRA steps its adapters only; with data parallelism (calls one at a
    time) each server's row adds the host step on its share; a rate of 0 is refused."""
    from rotapipe.plan import lora_params
    rc = main(["plan", "qwen3-1.7b", "--microbatches", "16"])
    text = capsys.readouterr().out
    assert rc == 0 and "host optimizer: 1.72e9 parameters at 5e9 per second" in text
    assert "sync (the default optimizer_mode: the call, then the step): 0.99 s" in text
    assert " s a step " not in text
    rc = main(["plan", "qwen3-1.7b", "--microbatches", "16", "--modes"])
    lines = capsys.readouterr().out.splitlines()
    modes = [line.split()[0] for line in lines if line.startswith("  ") and " s a step " in line]
    assert rc == 0 and modes == ["sync", "overlap", "stale"]
    rc, out = _json(capsys, "qwen3-1.7b", "--microbatches", "16", "--lora")
    assert rc == 0 and out["optimizer"]["params"] == sum(lora_params("qwen3-1.7b", 8))
    assert out["optimizer"]["overlap_ms"] is None
    rc, out = _json(capsys, "qwen3-1.7b", "--nodes", "2", "--modes")
    assert rc == 0 and "optimizer" not in out
    # Each server's row: the call, the exposed traffic and the host step on its share
    # (all 1.72e9 parameters unsharded, half of them sharded over 2 servers).
    rows = {m["shard"]: m for m in out["servers"]}
    assert rows["none"]["optimizer_s"] == pytest.approx(1.72e9 / 5e9, rel=0.01)
    assert rows["optimizer"]["optimizer_s"] == pytest.approx(rows["none"]["optimizer_s"] / 2)
    for m in rows.values():
        assert m["step_s"] == pytest.approx(out["step_ms"] / 1e3 + m["exposed_s"] +
                                            m["optimizer_s"])
    with pytest.raises(SystemExit) as exc:
        main(["plan", "qwen3-1.7b", "--optimizer-rate", "0"])
    assert exc.value.code == 2
    assert "--optimizer-rate" in capsys.readouterr().err


def test_plan_modes_example_runs(capsys, monkeypatch):
    """examples/plan_modes.py: a dense model's ``stale`` step is below its ``sync`` step
    by about the host step; GPT-OSS-20B's steps are bound by its host step."""
    import pathlib
    import runpy
    import sys

    script = pathlib.Path(__file__).resolve().parents[1] / "examples" / "plan_modes.py"
    monkeypatch.setattr(sys, "argv", [str(script)])
    runpy.run_path(str(script), run_name="__main__")
    rows = {line.split()[0]: [float(v) for v in line.split()[1:]]
            for line in capsys.readouterr().out.splitlines()[1:]}
    (step, call, sync, overlap, stale) = rows["qwen3-1.7b"]
    assert abs(sync - (call + step)) <= 0.011 and stale < call < overlap < sync
    (step, call, sync, overlap, stale) = rows["gpt-oss-20b"]
    assert call < step <= stale < overlap < sync


def test_plan_says_when_the_cost_model_does_not_count_the_family(capsys, tmp_path):
    """A family the cost model counts block by block plans silently; another one is
    priced as Llama-style blocks, and the output says so (text and JSON)."""
    cfg = json.loads((pathlib.Path(rotapipe.__file__).parent / "data" / "configs" /
                      "qwen3-1.7b.json").read_text())
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**cfg, "model_type": "qwen3_next_of_kin"}))
    assert main(["plan", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("cost model: model_type 'qwen3_next_of_kin' is not a family")
    _, out = _json(capsys, str(path))
    assert out["model_type"] == "qwen3_next_of_kin" and not out["counted_exactly"]
    assert main(["plan", "qwen3-1.7b"]) == 0
    assert "cost model:" not in capsys.readouterr().out
    _, out = _json(capsys, "qwen3-1.7b")
    assert out["model_type"] == "qwen3" and out["counted_exactly"]


def test_plan_lora_names_the_expert_stacks_train_would_also_adapt(capsys):
    """On a family whose fused experts PEFT's all-linear adapts, ``--lora`` says the
    plan prices them frozen and which targets leave the experts frozen; a dense model
    and a family PEFT leaves alone plan silently."""
    assert main(["plan", "qwen3-235b-a22b", "--lora", "--lora-rank", "16"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("note: this plan prices LoRA with the routed experts "
                               "frozen") and "188 fused expert stacks" in lines[1]
    _, out = _json(capsys, "qwen3-235b-a22b", "--lora")
    assert out["lora_folded_expert_stacks"] == 188
    for argv in (["qwen3-1.7b", "--lora"], ["gpt-oss-20b", "--lora"]):
        main(["plan", *argv])
        assert "fused expert stacks" not in capsys.readouterr().out, argv


@pytest.mark.parametrize("name,value", [
    ("optimizer_rate", 1e-300), ("optimizer_rate", float("nan")), ("seq", 2.5),
    ("host_ram", -1), ("host_ram", 1e300), ("chunk_mb", 1e300), ("nodes", True),
    ("network_gbps", 1e-300), ("prefetch", 0), ("prefetch", 10**9), ("inflight_mb", 1e300),
    ("lora_rank", 1e9), ("seq", 10**9), ("memory_fraction", 0)])
def test_analyze_refuses_what_the_command_line_refuses(name, value, capsys):
    """`analyze` from Python checks the same table as `rotapipe plan`'s flags: absurd
    rates said "fits" (1e-300 parameters per second) and a rank of 1e9 planned."""
    from rotapipe._validate import PLAN_LIMITS
    from rotapipe.plan.hardware import hardware
    from rotapipe.planner import analyze

    with pytest.raises(rotapipe.ConfigError, match=f"{name}=.*{PLAN_LIMITS[name].flag}"):
        analyze("qwen3-1.7b", hardware("rtx4090x8"),
                **{"seq": 2048, "global_batch": 16, name: value})
    flag, text = PLAN_LIMITS[name].flag, repr(value)
    if name == "host_ram":                        # in GB on the command line
        flag, text = "--host-ram", repr(value / 1e9)
    with pytest.raises(SystemExit) as exc:
        main(["plan", "qwen3-1.7b", flag, text.replace("True", "1.5")])
    assert exc.value.code == 2 and f"argument {flag}" in capsys.readouterr().err


def test_plan_reads_a_hub_id_from_the_local_cache(tmp_path):
    """``train --model Org/Name`` reads the local Hugging Face cache; ``plan`` and
    ``simulate`` said "no model config" for the same id. They now read its config.json
    from the cache (never the network), and name the download when it is not there."""
    import os
    import subprocess
    import sys

    snap = tmp_path / "hub" / "models--acme--tiny-qwen3" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (tmp_path / "hub" / "models--acme--tiny-qwen3" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--tiny-qwen3" / "refs" / "main").write_text("abc123")
    config = pathlib.Path(rotapipe.__file__).parent / "data" / "configs" / "qwen3-1.7b.json"
    (snap / "config.json").write_text(config.read_text())
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    run = lambda *argv: subprocess.run([sys.executable, "-m", "rotapipe", *argv],  # noqa: E731
                                       capture_output=True, text=True, env=env)
    out = run("plan", "acme/tiny-qwen3", "--microbatches", "16", "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["fits"], out.stderr
    out = run("simulate", "--model", "acme/tiny-qwen3", "--schedules", "1f1b")
    assert out.returncode == 0 and "1f1b" in out.stdout, out.stderr
    out = run("plan", "acme/missing-model")
    assert out.returncode == 2 and "hf download acme/missing-model config.json" in out.stderr
