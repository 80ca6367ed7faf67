"""The ``rotapipe`` command line: a table from command names to functions.

Each entry of :data:`COMMANDS` is ``name -> (add_arguments, run, help)``; ``run``
takes the parsed arguments and returns the exit code. Today there is one command,
``train``, which trains a tiny GPT-like model on a synthetic task (a smoke run that
proves the install works end to end on this machine's workers). Issue 7 grows it
into the real job (Hugging Face models, data files, checkpoints) in a ``train/``
package. ``simulate`` runs pipeline schedules side by side on a cost model
(:mod:`rotapipe.sim`); ``plan`` joins the table later.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence

import torch

from .config import BackendKind, PipeConfig, PrecisionConfig, RecomputeGrain
from .errors import RotapipeError

__all__ = ["main", "COMMANDS"]


def _train_arguments(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--workers", type=int, default=None,
      help="workers (default: every CUDA GPU, else 2 emulated CPU workers)")
    a("--backend", choices=[k.value for k in BackendKind], default="auto",
      help="auto: CUDA GPUs when present, else emulated CPU workers (default: auto)")
    a("--microbatches", type=int, default=4, help="microbatches per step (default: 4)")
    a("--steps", type=int, default=60, help="optimizer steps (default: 60)")
    a("--batch", type=int, default=32, help="sequences per step (default: 32)")
    a("--seq", type=int, default=32, help="tokens per sequence (default: 32)")
    a("--dim", type=int, default=64, help="model width (default: 64)")
    a("--layers", type=int, default=4, help="transformer blocks (default: 4)")
    a("--heads", type=int, default=4, help="attention heads (default: 4)")
    a("--vocab", type=int, default=64, help="vocabulary size (default: 64)")
    a("--lr", type=float, default=5e-3, help="AdamW learning rate (default: 5e-3)")
    a("--grain", choices=[g.value for g in RecomputeGrain], default="stage",
      help="backward recompute grain (default: stage)")
    a("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
      help="compute dtype; masters stay fp32, fp16 uses dynamic loss scaling "
           "(default: fp32)")
    a("--seed", type=int, default=0, help="init, data and dropout seed (default: 0)")
    a("--log-every", type=int, default=5, help="print every N steps (default: 5)")


def train(args: argparse.Namespace) -> int:
    """Train ``tiny_gpt`` on ``stride_batch`` sequences; print loss and tokens/s."""
    from .model.tiny import lm_loss, stride_batch, tiny_gpt
    from .pipe import RoundPipe

    torch.manual_seed(args.seed)
    model = tiny_gpt(args.vocab, args.dim, args.layers, args.heads, args.seq)
    config = PipeConfig(workers=args.workers, microbatches=args.microbatches,
                        grain=args.grain, backend=args.backend, seed=args.seed,
                        precision=PrecisionConfig(compute_dtype=args.dtype))
    data = torch.Generator().manual_seed(args.seed)
    with RoundPipe(model, lm_loss, config=config) as pipe:
        pipe.attach_optimizer(torch.optim.AdamW(pipe.parameters(), lr=args.lr, fused=True))
        kind = "CUDA GPU" if pipe.devices[0].torch_device.type == "cuda" else "emulated CPU"
        n_params = sum(p.numel() for p in pipe.parameters())
        print(f"tiny GPT: {args.layers + 2} layers, {n_params / 1e6:.2f}M parameters, "
              f"{args.dtype}; {len(pipe.devices)} {kind} workers, "
              f"{args.microbatches} microbatches, grain={args.grain}")
        print(f"plan: {pipe.plan.to_text()}")
        losses: list[float] = []
        start = last = time.perf_counter()
        last_step = 0
        for step in range(1, args.steps + 1):
            x, y = stride_batch(args.batch, args.seq, args.vocab, generator=data)
            losses.append(pipe.forward_backward(x, y))
            stepped = pipe.step()
            if step % args.log_every == 0 or step in (1, args.steps) or not stepped:
                now = time.perf_counter()
                rate = (step - last_step) * args.batch * args.seq / (now - last)
                note = "" if stepped else "  (step skipped: fp16 overflow, scale lowered)"
                print(f"step {step:4d}  loss {losses[-1]:.4f}  {rate:8.0f} tokens/s{note}",
                      flush=True)
                last, last_step = now, step
        took = time.perf_counter() - start
    tokens = args.steps * args.batch * args.seq
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {args.steps} steps; "
          f"{took:.1f} s, {tokens / took:.0f} tokens/s")
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
    a("--recompute", action="store_true",
      help="baselines recompute activations in the backward (default: keep them on "
           "the device); RoundPipe always recomputes all but the fused tail")
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
    print(f"{what}; {devices} devices, {M} microbatches of {costs.tokens} tokens; "
          f"baselines {'recompute' if args.recompute else 'keep activations'}")
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


COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None],
                          Callable[[argparse.Namespace], int], str]] = {
    "train": (_train_arguments, train,
              "train a tiny GPT-like model on a synthetic task (smoke run)"),
    "simulate": (_simulate_arguments, simulate,
                 "simulate pipeline schedules side by side (bubbles, tokens/s, memory, "
                 "timeline pictures)"),
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
