"""The ``rotapipe`` command line: a table from command names to functions.

Each entry of :data:`COMMANDS` is ``name -> (add_arguments, run, help)``; ``run``
takes the parsed arguments and returns the exit code. ``train`` is the training job
(:mod:`rotapipe.train`: a config file and a flag per :class:`TrainConfig` field; with
no arguments, the demo). ``simulate`` runs pipeline schedules side by side on a cost model
(:mod:`rotapipe.sim`); ``plan`` says whether a run fits, with which partition and how
fast (:mod:`rotapipe.planner.advise`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from .errors import RotapipeError

__all__ = ["main", "COMMANDS"]


def _train_arguments(p: argparse.ArgumentParser) -> None:
    from .train.config import TrainConfig, field_docs, field_types

    p.add_argument("--config", metavar="FILE", default=None,
                   help="TOML (or YAML/JSON) file of settings; flags override it")
    p.add_argument("--demo", action="store_true",
                   help="the demo, which is also what the defaults do: a small Qwen3 from "
                        "scratch on the Python standard library's source (every GPU, or 2 "
                        "emulated CPU workers)")
    docs, types = field_docs(), field_types()
    defaults = TrainConfig()
    g = p.add_argument_group("settings (rotapipe.train.TrainConfig; every one also a config "
                             "file key)")
    for name, t in types.items():
        flag = "--" + name.replace("_", "-")
        default = getattr(defaults, name)
        text = f"{docs.get(name, '')} (default: {default})".replace("%", "%%")
        if t is bool:
            g.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction,
                           default=argparse.SUPPRESS, help=text)
        else:
            g.add_argument(flag, dest=name, type=_none_or(t), default=argparse.SUPPRESS,
                           metavar=t.__name__.upper(), help=text)


def _none_or(t):
    def convert(text: str):
        return None if text.lower() == "none" else t(text)
    convert.__name__ = t.__name__
    return convert


def train(args: argparse.Namespace) -> int:
    """Run the training job (:func:`rotapipe.train.train`) from a config file and flags."""
    import logging

    from .train import load_config
    from .train import train as run_training
    from .train.config import field_types

    overrides = {k: v for k, v in vars(args).items() if k in field_types()}
    cfg = load_config(args.config, overrides)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    run_training(cfg)              # Ctrl-C: the job saves a checkpoint and returns
    return 0


def _simulate_arguments(p: argparse.ArgumentParser) -> None:
    from .sim import SCHEDULES

    a = p.add_argument
    a("--schedules", default="all",
      help=f"comma-separated subset of {','.join(SCHEDULES)} (aliases: interleaved, "
           "bfs, exact, stale; default: all)")
    a("--devices", type=int, default=None,
      help="pipeline devices (default: the hardware's count, or 8)")
    a("--microbatches", type=int, default=16, help="microbatches per step (default: 16)")
    g = p.add_argument_group("explicit per-layer times (ms per microbatch)")
    g.add_argument("--layers", type=int, help="decoder blocks (the LM head comes on top)")
    g.add_argument("--fwd-ms", type=float, help="forward of one block")
    g.add_argument("--bwd-ms", type=float, help="backward of one block (no recompute)")
    g.add_argument("--recompute-ms", type=float, default=None,
                   help="recompute of one block (default: --fwd-ms)")
    g.add_argument("--head-fwd-ms", type=float, help="forward of the LM head with the loss")
    g.add_argument("--head-bwd-ms", type=float, help="backward of the LM head")
    g.add_argument("--hop-ms", type=float, default=0.0,
                   help="one activation or gradient transfer over one host link "
                        "(device-to-device costs two: down, then up; default: 0)")
    g.add_argument("--upload-ms", type=float, default=0.0,
                   help="weight upload of one block or the head (default: 0)")
    g = p.add_argument_group("a model config on a hardware profile")
    g.add_argument("--model", help="config.json path or a known name (qwen3-1.7b, "
                                   "llama-3.1-8b, qwen3-32b, qwen3-235b-a22b)")
    g.add_argument("--hardware", default="rtx4090x8",
                   help="DEVICExN: rtx4090, a100, a800, h100-pcie (default: rtx4090x8)")
    g.add_argument("--efficiency", type=float, default=None,
                   help="fraction of peak TFLOPS layers reach (default: 0.6)")
    g.add_argument("--fp16-accumulate", action="store_true",
                   help="fp16 math with fp16 accumulation (2x on GeForce cards)")
    g.add_argument("--memory-gib", type=float, default=None,
                   help="device memory to check peaks against (default: the hardware's)")
    a("--seq", type=int, default=2048, help="tokens per sequence (default: 2048)")
    a("--global-batch", type=int, default=None,
      help="sequences per step (default: one per microbatch)")
    a("--virtual-stages", type=int, default=2,
      help="chunks per device of interleaved 1F1B and looped BFS (default: 2)")
    a("--recompute", nargs="?", const="ahead", default="off", metavar="MODE",
      choices=("off", "ahead", "after-grad"),
      help="baselines recompute activations in the backward instead of keeping them "
           "on the device: 'ahead' (ours, the value when MODE is left out: a recompute "
           "may run before its gradient arrives) or 'after-grad' (the paper's "
           "baselines: it waits for the gradient); default off. RoundPipe always "
           "recomputes all but the fused tail")
    a("--calls", type=int, default=4,
      help="overlapping calls simulated for roundpipe-stale (default: 4)")
    a("--out", default=None, help="write a timeline PNG and a Chrome trace per schedule here")


def simulate(args: argparse.Namespace) -> int:
    """Simulate the chosen schedules on explicit times or a model + hardware profile;
    print the table (and the picture and trace paths with ``--out``)."""
    from .errors import ConfigError
    from .plan import ModelCosts, hardware, model_costs
    from .sim import SimConfig, compare, schedule_names, table

    names = schedule_names(args.schedules)
    M = args.microbatches
    batch = args.global_batch or M
    if batch % M:
        raise ConfigError(f"--global-batch {batch} is not a multiple of --microbatches {M}: "
                          "every microbatch gets the same number of sequences")
    limit = int(args.memory_gib * 2**30) if args.memory_gib else None
    if args.model:
        hw = hardware(args.hardware, fp16_accumulate=args.fp16_accumulate,
                      **({"efficiency": args.efficiency} if args.efficiency else {}))
        costs = model_costs(args.model, hw, seq=args.seq, microbatch_size=batch // M)
        devices = args.devices or hw.count
        limit = limit or hw.device.memory_bytes
        what = (f"{args.model} on {hw.name} ({hw.flops / 1e12:.0f} TFLOPS sustained, "
                f"{hw.device.pcie_gbps:g} GB/s per link direction)")
    else:
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
        devices = args.devices or 8
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
    if args.out:
        import pathlib

        from .sim.gantt import draw_gantt
        from .sim.trace import write_trace

        out = pathlib.Path(args.out)
        for r in results:
            png = draw_gantt(r.timeline, out / f"{r.schedule.name}.png", r.report)
            trace = write_trace(r.timeline, out / f"{r.schedule.name}.trace.json")
            print(f"{r.schedule.name}: {png}  {trace}")
    return 0


def _plan_arguments(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("model", help="config.json path, a Hugging Face model folder, or a known name "
                    "(qwen3-1.7b, llama-3.1-8b, qwen3-32b, qwen3-235b-a22b)")
    a("--hardware", default="rtx4090x8",
      help="DEVICExN: rtx4090, a100, a800, h100-pcie (default: rtx4090x8)")
    a("--seq", type=int, default=2048, help="tokens per sequence (default: 2048)")
    a("--global-batch", type=int, default=16, help="sequences per step (default: 16)")
    a("--microbatches", type=int, default=None,
      help="microbatches per step (default: the planner tries every divisor of the "
           "global batch up to 64)")
    a("--lora", action="store_true", help="LoRA fine-tuning instead of full fine-tuning")
    a("--lora-rank", type=int, default=16, help="LoRA rank (default: 16)")
    a("--host-ram", type=float, default=None,
      help="host RAM in GB (default: 64 GB per device, at least 128)")
    a("--stale", action="store_true",
      help="plan for the one-step-stale optimizer (overlapping steps)")
    a("--efficiency", type=float, default=None,
      help="fraction of peak TFLOPS layers reach (default: 0.6)")
    a("--fp16-accumulate", action="store_true",
      help="fp16 math with fp16 accumulation (2x on GeForce cards)")
    a("--memory-fraction", type=float, default=0.9,
      help="share of device memory the plan may use (default: 0.9)")
    a("--pin", choices=("copy", "register", "off"), default="register",
      help="host memory mode of the weights, as PipeConfig.pin: page-locked by a copy, "
           "page-locked in place, or pageable behind bounce buffers (default: register, "
           "the CUDA default)")
    a("--copy-chunk-mb", type=float, default=32.0,
      help="bounce-buffer chunk in MiB with --pin off, as PipeConfig.copy_chunk_mb "
           "(default: 32)")
    a("--json", action="store_true", help="print one JSON object instead of text")


def plan(args: argparse.Namespace) -> int:
    """Plan a model on a hardware profile; print the verdict, partition and prediction.
    Exit code 0 when it fits, 2 when it does not."""
    import json

    from .plan import hardware
    from .plan.hostmem import GB
    from .planner.advise import analyze

    hw = hardware(args.hardware, fp16_accumulate=args.fp16_accumulate,
                  **({"efficiency": args.efficiency} if args.efficiency else {}))
    result = analyze(args.model, hw, seq=args.seq, global_batch=args.global_batch,
                     lora_rank=args.lora_rank if args.lora else None,
                     host_ram=int(args.host_ram * GB) if args.host_ram else None,
                     microbatches=args.microbatches, stale=args.stale,
                     memory_fraction=args.memory_fraction, pin=args.pin,
                     chunk_mb=args.copy_chunk_mb)
    print(json.dumps(result.as_dict(), indent=2) if args.json else result.to_text())
    return 0 if result.fits else 2


COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None],
                          Callable[[argparse.Namespace], int], str]] = {
    "train": (_train_arguments, train,
              "train or fine-tune a causal LM (default: the demo, a small Qwen3 from "
              "scratch on the Python standard library's source)"),
    "simulate": (_simulate_arguments, simulate,
                 "simulate pipeline schedules side by side (bubbles, tokens/s, memory, "
                 "timeline pictures)"),
    "plan": (_plan_arguments, plan,
             "will a model fit a machine (device and host memory), with which partition, "
             "how fast"),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``rotapipe`` command; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="rotapipe", description="RoundPipe pipeline training on stateless workers.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (add_arguments, run, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_arguments(p)
        p.set_defaults(run=run)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except RotapipeError as exc:
        print(f"rotapipe {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"rotapipe {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
