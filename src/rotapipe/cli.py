"""The ``rotapipe`` command line: a table from command names to functions.

Each entry of :data:`COMMANDS` is ``name -> (add_arguments, run, help)``; ``run``
takes the parsed arguments and returns the exit code. Today there is one command,
``train``, which trains a tiny GPT-like model on a synthetic task (a smoke run that
proves the install works end to end on this machine's workers). Issue 7 grows it
into the real job (Hugging Face models, data files, checkpoints) in a ``train/``
package; ``plan`` and ``simulate`` join the table later.
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


COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None],
                          Callable[[argparse.Namespace], int], str]] = {
    "train": (_train_arguments, train,
              "train a tiny GPT-like model on a synthetic task (smoke run)"),
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
