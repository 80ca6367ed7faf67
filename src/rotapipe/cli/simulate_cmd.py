"""``rotapipe simulate``: pipeline schedules side by side on a cost model
(:mod:`rotapipe.sim`), from explicit per-layer times or a model config on a hardware
profile, with timeline pictures and Chrome traces (``--out``)."""

from __future__ import annotations

import argparse

from .. import _validate
from .._validate import PLAN_LIMITS, int_flag as _count, real_flag as _real
from ..errors import ConfigError
from .flags import _hardware, _lora, _model_name

MIN_MEMORY_GIB, MAX_MEMORY_GIB = 0.001, 100_000
"""``simulate --memory-gib`` outside this (about 1 MiB to 100 TiB) is a typo, not a
device."""
MAX_MS = 1e6
"""``simulate``'s explicit times (``--fwd-ms``, ``--hop-ms``, ...) above this (17 minutes
for one block and microbatch) are typos; compute times are at least 1e-6 ms (1 ns)."""


def _simulate_arguments(p: argparse.ArgumentParser) -> None:
    from ..plan.hardware import MIN_EFFICIENCY
    from ..sim import SCHEDULES

    a = p.add_argument
    a("--schedules", default="all",
      help=f"comma-separated subset of {','.join(SCHEDULES)} (aliases: interleaved, "
           "bfs, exact, stale; default: all)")
    a("--devices", type=_count(maximum=1024), default=None,
      help="pipeline devices (default: the hardware's count, or 8)")
    a("--microbatches", type=_count(maximum=4096), default=16,
      help="microbatches per step (default: 16)")
    g = p.add_argument_group("explicit per-layer times (ms per microbatch)")
    g.add_argument("--layers", type=_count(maximum=1024),
                   help="decoder blocks (the LM head comes on top)")
    ms, ms0 = _real(1e-6, MAX_MS, low_open=False, unit="ms"), _real(0.0, MAX_MS,
                                                                     low_open=False, unit="ms")
    g.add_argument("--fwd-ms", type=ms, help="forward of one block")
    g.add_argument("--bwd-ms", type=ms, help="backward of one block (no recompute)")
    g.add_argument("--recompute-ms", type=ms0, default=None,
                   help="recompute of one block (default: --fwd-ms)")
    g.add_argument("--head-fwd-ms", type=ms,
                   help="forward of the LM head with the loss")
    g.add_argument("--head-bwd-ms", type=ms, help="backward of the LM head")
    g.add_argument("--hop-ms", type=ms0, default=0.0,
                   help="one activation or gradient transfer over one host link "
                        "(device-to-device costs two: down, then up; default: 0)")
    g.add_argument("--upload-ms", type=ms0, default=0.0,
                   help="weight upload of one block or the head (default: 0)")
    g = p.add_argument_group("a model config on a hardware profile")
    g.add_argument("--model", help="config.json path or a known name (qwen3-1.7b, "
                                   "llama-3.1-8b, qwen3-32b, qwen3-235b-a22b)")
    g.add_argument("--hardware", default="rtx4090x8",
                   help="DEVICExN: rtx4090, a100, a800, h100-pcie (default: rtx4090x8)")
    g.add_argument("--efficiency", type=_real(MIN_EFFICIENCY, 1.0, low_open=False),
                   default=None, help="fraction of peak TFLOPS layers reach, in [0.01, 1] "
                   "(default: 0.6)")
    g.add_argument("--fp16-accumulate", action="store_true",
                   help="fp16 math with fp16 accumulation (2x on GeForce cards)")
    g.add_argument("--memory-gib", type=_real(MIN_MEMORY_GIB, MAX_MEMORY_GIB, low_open=False,
                                              unit="GiB"), default=None,
                   help="device memory to check peaks against, in [0.001, 100000] GiB "
                        "(default: the hardware's)")
    g.add_argument("--lora", action="store_true",
                   help="LoRA on a frozen base, priced as LoRA (as plan --lora): a frozen "
                        "weight's backward computes only its input gradient, only the "
                        "adapters' gradients go down")
    g.add_argument("--lora-rank", type=PLAN_LIMITS["lora_rank"].flag_type(), default=None,
                   help="LoRA rank, with --lora or --qlora (default: 8, as plan and train)")
    g.add_argument("--qlora", action="store_true",
                   help="QLoRA: --lora with the blocks uploaded as NF4")
    g.add_argument("--whole-embedding", action="store_true",
                   help="the token embedding moves whole, for a model that declares no "
                        "lookups (default: by the rows a call looks up, as wrapped "
                        "Hugging Face models do)")
    a("--seq", type=_count(), default=2048, help="tokens per sequence (default: 2048)")
    a("--global-batch", type=_count(), default=None,
      help="sequences per step (default: one per microbatch)")
    a("--virtual-stages", type=_count(maximum=64), default=2,
      help="chunks per device of interleaved 1F1B and looped BFS (default: 2)")
    a("--recompute", nargs="?", const="ahead", default="off", metavar="MODE",
      choices=("off", "ahead", "after-grad"),
      help="baselines recompute activations in the backward instead of keeping them "
           "on the device: 'ahead' (ours, the value when MODE is left out: a recompute "
           "may run before its gradient arrives) or 'after-grad' (the paper's "
           "baselines: it waits for the gradient); default off. RoundPipe always "
           "recomputes all but the fused tail")
    a("--calls", type=_count(2, 64), default=4,
      help="overlapping calls simulated for roundpipe-stale (default: 4)")
    a("--out", default=None, help="write a timeline PNG and a Chrome trace per schedule here")


def simulate(args: argparse.Namespace) -> int:
    """Simulate the chosen schedules on explicit times or a model + hardware profile;
    print the table (and the picture and trace paths with ``--out``)."""
    from ..plan import ModelCosts, lora_params, model_costs
    from ..sim import SCHEDULES, SimConfig, compare, schedule_names, table

    names = schedule_names(args.schedules)
    if not names:
        raise ConfigError(f"--schedules {args.schedules!r} names no schedule: use a "
                          f"comma-separated subset of {', '.join(SCHEDULES)}, or all")
    M = args.microbatches
    batch = args.global_batch if args.global_batch is not None else M
    if batch % M:
        raise ConfigError(f"--global-batch {batch} is not a multiple of --microbatches {M}: "
                          "every microbatch gets the same number of sequences")
    if args.out is not None:
        _check_out_folder(args.out)
    limit = int(args.memory_gib * 2**30) if args.memory_gib is not None else None
    if args.model:
        hw = _hardware(args)
        lora = _lora(args)
        args.model = _model_name(args.model)
        costs = model_costs(args.model, hw, seq=args.seq, microbatch_size=batch // M,
                            call_tokens=None if args.whole_embedding else batch * args.seq,
                            adapters=lora_params(args.model, args.lora_rank) if lora
                            else None, quantize="nf4" if args.qlora else None)
        devices = args.devices if args.devices is not None else hw.count
        limit = limit or hw.device.memory_bytes
        what = (f"{args.model}"
                + (f" ({'QLoRA' if args.qlora else 'LoRA'} rank {args.lora_rank})"
                   if lora else "")
                + f" on {hw.name} ({hw.flops / 1e12:.0f} TFLOPS sustained, "
                f"{hw.device.pcie_gbps:g} GB/s per link direction)")
    else:
        given = [f for f in ("lora", "lora_rank", "qlora", "whole_embedding")
                 if getattr(args, f)]
        if given:
            raise ConfigError(", ".join("--" + f.replace("_", "-") for f in given)
                              + " needs --model: explicit times already say what each "
                              "layer costs")
        missing = [f for f in ("layers", "fwd_ms", "bwd_ms", "head_fwd_ms", "head_bwd_ms")
                   if getattr(args, f) is None]
        if missing:
            raise ConfigError("give --model (a config and --hardware) or explicit times; "
                              "missing " + ", ".join("--" + m.replace("_", "-") for m in missing))
        costs = ModelCosts.explicit(args.layers, args.fwd_ms, args.bwd_ms,
                                    head_forward_ms=args.head_fwd_ms,
                                    head_backward_ms=args.head_bwd_ms,
                                    recompute_ms=args.recompute_ms, hop_ms=args.hop_ms,
                                    upload_ms=args.upload_ms, tokens=args.seq * batch // M)
        devices = args.devices if args.devices is not None else 8
        what = f"{args.layers} blocks + LM head, explicit times"
    config = SimConfig(devices, M, virtual_stages=args.virtual_stages, recompute=args.recompute,
                       calls=args.calls, memory_limit=limit)
    results = compare(costs, config, names)
    keep = "keep activations" if args.recompute == "off" else f"recompute {args.recompute}"
    print(f"{what}; {devices} devices, {M} microbatches of {costs.tokens} tokens; "
          f"baselines {keep}")
    print(table([r.report for r in results]))
    for r in results:
        plan = r.schedule.plan
        print(f"  {r.schedule.name}: {len(plan.forward)} forward stages, tail "
              f"[{plan.tail.start}:{plan.tail.stop}], {len(plan.backward)} backward stages")
    if args.out is not None:
        import pathlib

        from ..sim.gantt import draw_gantt
        from ..sim.trace import write_trace

        out = pathlib.Path(args.out)
        for r in results:
            png = draw_gantt(r.timeline, out / f"{r.schedule.name}.png", r.report)
            trace = write_trace(r.timeline, out / f"{r.schedule.name}.trace.json")
            print(f"{r.schedule.name}: {png}  {trace}")
    return 0


def _check_out_folder(path: str) -> None:
    """``--out`` must be a folder, or a path where one can be made (checked before the
    simulation runs, by making and removing a folder there: write permission does not
    say it, ``/proc`` refuses even root)."""
    import os
    import pathlib

    if not path.strip():
        raise ConfigError("--out is empty: pass the folder the pictures and traces go to, "
                          "or leave --out out")
    out = pathlib.Path(path)
    base = _validate.nearest_existing(out)
    if not base.is_dir():
        what = "is a file" if base == out else f"cannot be made: {str(base)!r} is a file"
        raise ConfigError(f"--out {path!r} {what}: pass a folder")
    if not os.access(base, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {path!r} cannot be written: no write permission on "
                          f"{str(base)!r}")
    reason = _validate.cannot_make_folder(base)
    if reason is not None:
        raise ConfigError(f"--out {path!r} cannot be written (making a folder in "
                          f"{str(base)!r} fails: {reason}): pass a folder on a "
                          "writable file system")
