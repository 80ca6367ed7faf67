"""The ``rotapipe`` command line: a table from command names to functions.

Each entry of :data:`COMMANDS` is ``name -> (add_arguments, run, help)``; ``run``
takes the parsed arguments and returns the exit code. ``train`` is the training job
(:mod:`rotapipe.train`: a config file and a flag per :class:`TrainConfig` field; with
no arguments, the demo). ``simulate`` runs pipeline schedules side by side on a cost model
(:mod:`rotapipe.sim`); ``plan`` says whether a run fits, with which partition and how
fast (:mod:`rotapipe.planner.advise`).

Exit codes (docs/training.md, "Exit codes"): 0 success; 1 the run failed (bad data,
a damaged checkpoint, a worker error, an I/O error); 2 usage: a flag or setting is
wrong (argparse's own errors, :class:`~rotapipe.errors.ConfigError`); 3 ``plan``: the
run does not fit; 130 interrupted. Every error is one line on stderr, never a
traceback; an unexpected exception says so and suggests ``--debug``, which shows the
traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from . import _validate
from ._validate import PLAN_LIMITS, int_flag as _count, real_flag as _real
from .errors import ConfigError, RotapipeError

__all__ = ["main", "COMMANDS", "EXIT_OK", "EXIT_FAILED", "EXIT_USAGE", "EXIT_NO_FIT"]

EXIT_OK = 0
EXIT_FAILED = 1
"""The run failed: bad data, a damaged checkpoint, a worker or I/O error."""
EXIT_USAGE = 2
"""A flag, config file or setting is wrong (argparse uses 2 for its own errors too)."""
EXIT_NO_FIT = 3
"""``rotapipe plan``: the run does not fit the machine."""
EXIT_INTERRUPTED = 130
MAX_HOST_RAM_GB = PLAN_LIMITS["host_ram"].high / 1e9
"""``plan --host-ram`` above this (a petabyte per server) is a typo, not a machine; below
1 GB neither (and under a byte it read as no value: the default RAM)."""
MAX_LORA_RANK = int(PLAN_LIMITS["lora_rank"].high)
"""``--lora-rank`` of ``plan`` and ``simulate`` at most this, as ``train``'s."""


def _limit(name: str):
    """The flag type of the planner input ``name`` (:data:`~rotapipe._validate.PLAN_LIMITS`:
    ``rotapipe plan`` and :func:`rotapipe.planner.analyze` accept the same values)."""
    return PLAN_LIMITS[name].flag_type()
MIN_MEMORY_GIB, MAX_MEMORY_GIB = 0.001, 100_000
"""``simulate --memory-gib`` outside this (about 1 MiB to 100 TiB) is a typo, not a
device."""
MAX_MS = 1e6
"""``simulate``'s explicit times (``--fwd-ms``, ``--hop-ms``, ...) above this (17 minutes
for one block and microbatch) are typos; compute times are at least 1e-6 ms (1 ns)."""


def _lora(args) -> bool:
    """Whether the run is LoRA (``--lora`` or ``--qlora``); sets ``args.lora_rank`` to its
    default, and refuses a rank given without either (it would be ignored)."""
    lora = args.lora or args.qlora
    if args.lora_rank is not None and not lora:
        raise ConfigError(f"--lora-rank {args.lora_rank} prices LoRA adapters, but the run "
                          "is full fine-tuning: add --lora (or --qlora), or drop --lora-rank")
    if args.lora_rank is None:
        args.lora_rank = 8
    return lora


def _hardware(args):
    """The ``--hardware`` profile of ``plan`` and ``simulate``, with ``--efficiency`` and
    ``--fp16-accumulate``; an empty name is refused here, more than
    :data:`~rotapipe.plan.hardware.MAX_DEVICES` devices by :func:`hardware`."""
    from .plan import hardware

    if not args.hardware.strip():
        raise ConfigError("--hardware is empty: use DEVICExN, e.g. rtx4090x8 or a100x4")
    return hardware(args.hardware, fp16_accumulate=args.fp16_accumulate,
                    **({"efficiency": args.efficiency} if args.efficiency is not None else {}))


def _model_name(name: str) -> str:
    """``--model`` of ``plan`` and ``simulate``: a name that is neither a path nor a known
    model, but close to one, is refused with that name (``qwen3-1.7`` -> ``qwen3-1.7b``);
    the rest is for :func:`rotapipe.plan.configs.load_config` to check."""
    import difflib
    import pathlib

    from .plan.configs import KNOWN_MODELS

    if name.lower() in KNOWN_MODELS or pathlib.Path(name).exists():
        return name
    close = difflib.get_close_matches(name.lower(), KNOWN_MODELS, n=1, cutoff=0.6)
    if close:
        raise ConfigError(f"no model config at {name!r}: did you mean {close[0]!r}? Give "
                          f"a config.json path or one of {', '.join(KNOWN_MODELS)}")
    return name


def _plain(text: str) -> str:
    """Docstring text as plain help text (no reStructuredText literals)."""
    return text.replace("``", "")


def _train_arguments(p: argparse.ArgumentParser) -> None:
    from .train.config import CHOICES, REPORT_TO, TrainConfig
    from .train.settings import field_docs, field_types

    p.add_argument("--config", metavar="FILE", default=None,
                   help="TOML (or YAML/JSON) file of settings; flags override it")
    p.add_argument("--demo", action="store_true",
                   help="the demo, which is also what the defaults do: a small Qwen3 from "
                        "scratch on the Python standard library's source (every GPU, or 2 "
                        "emulated CPU workers)")
    p.add_argument("--recipe", metavar="NAME", default=None,
                   help="a named recipe shipped with rotapipe (full, lora: fine-tuning "
                        "settings for a pretrained --model); --config and flags override it")
    import dataclasses

    docs, types = field_docs(), field_types()
    # The fields' declared defaults, without building a TrainConfig (that imports torch,
    # which --help and argument errors do not need).
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    g = p.add_argument_group("settings (rotapipe.train.TrainConfig; every one also a config "
                             "file key)")
    choices = {**CHOICES, "report_to": REPORT_TO}
    for name, t in types.items():
        flag = "--" + name.replace("_", "-")
        default = defaults[name]
        if hasattr(default, "value"):                  # an enum member: its value
            default = default.value
        text = _plain(f"{docs.get(name, '')} (default: {default})").replace("%", "%%")
        if name == "resume":       # --resume, --resume auto, --no-resume
            g.add_argument(flag, dest=name, nargs="?", const=True, type=_resume_mode,
                           default=argparse.SUPPRESS, metavar="auto", help=text)
            g.add_argument("--no-resume", dest=name, action="store_false",
                           default=argparse.SUPPRESS)
        elif t is bool:
            g.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction,
                           default=argparse.SUPPRESS, help=text)
        elif name in choices:           # checked (in any case) by TrainConfig
            g.add_argument(flag, dest=name, type=str, default=argparse.SUPPRESS,
                           metavar="{" + ",".join(choices[name]) + "}", help=text)
        else:
            metavar = {"model": "DIR|ORG/NAME", "resume_from_adapter": "DIR",
                       "out_dir": "DIR"}.get(name, t.__name__.upper())
            g.add_argument(flag, dest=name, type=_none_or(t), default=argparse.SUPPRESS,
                           metavar=metavar, help=text)


def _resume_mode(text: str) -> str:
    if text.strip().lower() != "auto":
        raise argparse.ArgumentTypeError(f"{text!r}: use --resume (the latest checkpoint, "
                                         "which must exist) or --resume auto (it, if any)")
    return "auto"


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
    from .train.settings import check_lora_flags, field_types

    overrides = {k: v for k, v in vars(args).items() if k in field_types()}
    base = load_config(recipe_path(args.recipe)) if args.recipe else None
    cfg = load_config(args.config, overrides, base=base)
    # As plan's --lora-rank: a LoRA flag that would be ignored (no LoRA, or an adapter
    # resumed with another shape) is refused.
    check_lora_flags(cfg, overrides)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    run_training(cfg)              # Ctrl-C: the job saves a checkpoint and returns
    return 0


def recipe_path(name: str):
    """The TOML file of the recipe ``name`` (``rotapipe/recipes/NAME.toml``)."""
    import difflib
    import pathlib

    folder = pathlib.Path(__file__).parent / "recipes"
    path = folder / f"{name}.toml"
    if not path.is_file():
        names = sorted(f.stem for f in folder.glob("*.toml"))
        close = difflib.get_close_matches(name, names, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"--recipe {name!r} is not a recipe: {hint}use one of "
                          f"{', '.join(names)} (or --config FILE)")
    return path


def _simulate_arguments(p: argparse.ArgumentParser) -> None:
    from .plan.hardware import MIN_EFFICIENCY
    from .sim import SCHEDULES

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
    g.add_argument("--lora-rank", type=_count(maximum=MAX_LORA_RANK), default=None,
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
    from .plan import ModelCosts, lora_params, model_costs
    from .sim import SCHEDULES, SimConfig, compare, schedule_names, table

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

        from .sim.gantt import draw_gantt
        from .sim.trace import write_trace

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


def _plan_arguments(p: argparse.ArgumentParser) -> None:
    from .plan.hardware import MIN_EFFICIENCY

    a = p.add_argument
    what = ("config.json path, a Hugging Face model folder, or a known name (qwen3-1.7b, "
            "llama-3.1-8b, qwen3-32b, qwen3-235b-a22b)")
    a("model", nargs="?", default=None, help=what + "; the same as --model")
    a("--model", dest="model_flag", metavar="MODEL", default=None,
      help="the model, as in train and simulate")
    a("--hardware", default="rtx4090x8",
      help="DEVICExN: rtx4090, a100, a800, h100-pcie (default: rtx4090x8)")
    a("--seq", type=_limit("seq"), default=2048, help="tokens per sequence (default: 2048)")
    a("--global-batch", type=_limit("global_batch"), default=16, help="sequences per step (default: 16)")
    a("--microbatches", type=_limit("microbatches"), default=None,
      help="microbatches per step (default: the planner tries every divisor of the "
           "global batch up to 64)")
    a("--lora", action="store_true", help="LoRA fine-tuning instead of full fine-tuning")
    a("--lora-rank", type=_limit("lora_rank"), default=None,
      help="LoRA rank, with --lora or --qlora (default: 8, as train)")
    a("--qlora", action="store_true",
      help="QLoRA: LoRA on a frozen base held and uploaded as NF4 (implies --lora)")
    a("--layout", choices=("sync", "overlap", "lean", "stale"), default=None,
      help="host layout of the optimizer side (docs/memory.md; default: stale with "
           "--stale, else the first of sync and lean that fits the host RAM)")
    a("--prefetch", type=_limit("prefetch"), default=1,
      help="PipeConfig.prefetch, for the lean layout's gradient count (default: 1)")
    a("--optimizer-state", choices=("fp32", "bf16", "int8"), default="fp32",
      help="how the optimizer state is kept (PipeConfig.optimizer_state_dtype, "
           "docs/optimizer.md; default: fp32)")
    a("--host-ram", type=_real(1.0, MAX_HOST_RAM_GB, low_open=False, unit="GB"),
      default=None, help="host RAM in GB, in [1, 1e6] (default: 64 GB per device, at "
      "least 128)")
    a("--stale", action="store_true",
      help="plan for the one-step-stale optimizer (overlapping steps)")
    a("--optimizer-rate", type=_limit("optimizer_rate"), default=None,
      help="host optimizer throughput in parameters per second, in [1e6, 1e15], for each "
           "optimizer mode's step (default: 5e9, fused CPU AdamW on a server)")
    a("--modes", action="store_true",
      help="also simulate the steady state of pipelined overlap and stale calls on the "
           "plan (sync is always priced)")
    a("--clip", action="store_true",
      help="price the optimizer modes with a global-norm clip (clip_grad_norm: the "
           "whole step at the last hand-off)")
    a("--efficiency", type=_real(MIN_EFFICIENCY, 1.0, low_open=False), default=None,
      help="fraction of peak TFLOPS layers reach, in [0.01, 1] (default: 0.6)")
    a("--fp16-accumulate", action="store_true",
      help="fp16 math with fp16 accumulation (2x on GeForce cards)")
    a("--memory-fraction", type=_limit("memory_fraction"), default=0.9,
      help="share of device memory the plan may use, in [0.01, 1] (default: 0.9)")
    a("--pin", choices=("copy", "register", "off"), default="register",
      help="host memory mode of the weights, as PipeConfig.pin: page-locked by a copy, "
           "page-locked in place, or pageable behind bounce buffers (default: register, "
           "the CUDA default)")
    a("--copy-chunk-mb", type=_limit("chunk_mb"), default=32.0,
      help="bounce-buffer chunk in MiB with --pin off, as PipeConfig.copy_chunk_mb, in "
           "[0.01, 65536] (default: 32)")
    a("--nodes", type=_limit("nodes"), default=1,
      help="data-parallel servers (default: 1); host RAM is then per server, for each "
           "DataParallelConfig.shard mode")
    a("--network-gbps", type=_limit("network_gbps"), default=25.0,
      help="link rate between servers in Gb/s, in [0.01, 1e5], for the communication "
           "time per step (default: 25)")
    a("--inflight-mb", type=_limit("inflight_mb"), default=100.0,
      help="with --nodes: MiB of gradient buffers each server keeps in flight before "
           "the backward waits, as DataParallelConfig.inflight_mb, in [0.01, 1e6] "
           "(default: 100, 4 x bucket_mb)")
    a("--grad-dtype", choices=("float32", "bfloat16"), default="float32",
      help="with --nodes: dtype the sharded modes send gradients in, as "
           "DataParallelConfig.grad_dtype (default: float32)")
    a("--json", action="store_true", help="print one JSON object instead of text")


def plan(args: argparse.Namespace) -> int:
    """Plan a model on a hardware profile; print the verdict, partition and prediction.
    Exit code 0 when it fits, :data:`EXIT_NO_FIT` (3) when it does not."""
    import json

    from .plan.hostmem import GB
    from .planner.advise import analyze

    if (args.model is None) == (args.model_flag is None):
        raise ConfigError("give the model once: rotapipe plan --model MODEL (or rotapipe "
                          "plan MODEL)" + (", not both" if args.model else ""))
    model = _model_name(args.model or args.model_flag)
    lora = _lora(args)
    hw = _hardware(args)
    result = analyze(model, hw, seq=args.seq, global_batch=args.global_batch,
                     lora_rank=args.lora_rank if lora else None,
                     qlora=args.qlora, layout=args.layout, prefetch=args.prefetch,
                     optimizer_state=args.optimizer_state,
                     host_ram=int(args.host_ram * GB) if args.host_ram is not None else None,
                     microbatches=args.microbatches, stale=args.stale,
                     memory_fraction=args.memory_fraction, pin=args.pin,
                     chunk_mb=args.copy_chunk_mb, nodes=args.nodes,
                     network_gbps=args.network_gbps, inflight_mb=args.inflight_mb,
                     grad_dtype=args.grad_dtype, modes=args.modes, clip=args.clip,
                     **({} if args.optimizer_rate is None else
                        {"optimizer_rate": args.optimizer_rate}))
    print(json.dumps(result.as_dict(), indent=2) if args.json else result.to_text())
    return EXIT_OK if result.fits else EXIT_NO_FIT


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
    """Entry point of the ``rotapipe`` command; returns the exit code (argparse's own
    usage errors and ``--help`` raise ``SystemExit``, with code 2 and 0)."""
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show the traceback of an error")
    parser = argparse.ArgumentParser(
        prog="rotapipe", description="RoundPipe pipeline training on stateless workers.",
        parents=[debug], epilog="exit codes: 0 success, 1 the run failed, 2 a flag or "
        "setting is wrong, 3 (plan) does not fit, 130 interrupted")
    from . import __version__
    parser.add_argument("--version", action="version", version=f"rotapipe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    # Only the chosen command's flags are built: they import torch and the library, which
    # `rotapipe --help` and `--version` do not need.
    argv = sys.argv[1:] if argv is None else list(argv)
    chosen = next((a for a in argv if a in COMMANDS), None)
    for name, (add_arguments, run, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, parents=[debug])
        if name == chosen:
            add_arguments(p)
        p.set_defaults(run=run)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print(f"rotapipe {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        if getattr(args, "debug", False):
            raise
        code, message = _error_line(exc)
        print(f"rotapipe {args.command}: error: {message}", file=sys.stderr)
        return code


_HF_EXTRAS = ("transformers", "peft", "safetensors", "tokenizers", "huggingface_hub")


def _error_line(exc: Exception) -> tuple[int, str]:
    """``(exit code, message)`` of an error that ends a command: the library's own
    messages as they are; an OS error as its reason and path; anything else, which is a
    bug, as one line that points to ``--debug``."""
    if isinstance(exc, ConfigError):
        return EXIT_USAGE, str(exc)
    if isinstance(exc, RotapipeError):
        return EXIT_FAILED, str(exc)
    if isinstance(exc, OSError) and exc.strerror:
        where = f": {exc.filename}" if exc.filename else ""
        return EXIT_FAILED, f"{exc.strerror}{where}"
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        top = exc.name.split(".")[0]
        if top in _HF_EXTRAS:
            return EXIT_FAILED, (f"{top} is not installed: pip install 'rotapipe[hf]' (the "
                                 "Hugging Face extras: transformers, peft, safetensors)")
        return EXIT_FAILED, f"the {top!r} package is not installed: pip install {top}"
    if isinstance(exc, MemoryError):
        return EXIT_FAILED, "out of host memory: use a smaller model, batch or sequence"
    first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
    return EXIT_FAILED, (f"unexpected {type(exc).__name__}{': ' + first if first else ''} "
                         "(run with --debug for the traceback)")


if __name__ == "__main__":
    sys.exit(main())
