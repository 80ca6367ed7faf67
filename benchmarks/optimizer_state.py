"""Optimizer-state precision and gradient accumulation: host bytes and time (docs/memory.md).

1. State: AdamW over a stack of ``--layers`` square ``--hidden`` weights, stepped on
   random gradients as the host optimizer steps it (``StatePrecision.step``), for each
   ``PipeConfig.optimizer_state_dtype``: fp32 (``torch.optim.AdamW(fused=True)``),
   bf16 (the same, state widened around each step in groups and rounded back) and int8
   (``bitsandbytes.optim.AdamW8bit``, its CPU kernel). Printed: the optimizer state's
   bytes (every tensor in ``optimizer.state``) and the step time, median of ``--repeat``.
2. Gradients: the peak of fp32 weight-gradient bytes alive on the host
   (tests/gradcount.py: a deterministic count, not RSS) over two optimizer steps of
   1 or 3 training calls each, per optimizer mode, clipping on/off, bf16 compute, in
   copies of the model's fp32 gradients (a 6-layer stack on 2 emulated workers).

    python benchmarks/optimizer_state.py [--layers 8 --hidden 1024 --repeat 5]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "tests"))

import rotapipe  # noqa: E402
from rotapipe.runtime.optstate import StatePrecision, state_bytes  # noqa: E402


def step_times(layers: int, hidden: int, repeat: int) -> list[tuple[str, int, float]]:
    """State bytes and median step time per setting, the settings interleaved in each
    round (a loaded machine slows them alike)."""
    import bitsandbytes as bnb
    makers = {"fp32": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
              "bf16": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
              "int8": lambda ps: bnb.optim.AdamW8bit(ps, lr=1e-3)}
    runs = {}
    for name, make in makers.items():
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(hidden, hidden) * 0.02)
                  for _ in range(layers)]
        opt = make(params)
        states = StatePrecision(name)
        states.attach(opt)
        runs[name] = (params, opt, states, [])
    for _ in range(repeat + 1):       # the first round allocates the state: not timed
        for params, opt, states, times in runs.values():
            for p in params:
                p.grad = torch.randn_like(p) * 1e-3
            t0 = time.perf_counter()
            states.step(opt, params)
            times.append(time.perf_counter() - t0)
    return [(name, state_bytes(opt), statistics.median(times[1:]))
            for name, (_, opt, _, times) in runs.items()]


def grad_copies(calls: int) -> list[tuple[str, str, str, float]]:
    from gradcount import GradCount
    from models import emulated
    rows = []
    dims = [(37, 41), (41, 43), (43, 47), (47, 53), (53, 59), (59, 61)]
    # bf16 compute: on emulated workers fp32 weights and gradients of the workers would
    # be fp32 CPU tensors too; in bf16 only the host's gradients are fp32.
    for dtype in ("bf16",):
        for mode in ("sync", "overlap", "stale"):
            for clip in (None, 1e-3):
                torch.manual_seed(0)
                layers = [torch.nn.Linear(a, b) for a, b in dims]
                config = emulated(2, 2, optimizer_mode=mode, clip_grad_norm=clip,
                                  precision=dtype, check_races=False)
                with rotapipe.RoundPipe(layers, lambda y, t: ((y - t) ** 2).mean(),
                                        config=config) as pipe:
                    pipe.attach_optimizer(torch.optim.AdamW(pipe.parameters(), lr=1e-3))
                    g = torch.Generator().manual_seed(1)
                    with GradCount(pipe) as count:
                        for _ in range(2):
                            for c in range(calls):
                                x, y = torch.randn(8, 37, generator=g), \
                                    torch.randn(8, 61, generator=g)
                                if c < calls - 1:
                                    pipe.forward_backward(x, y)
                                else:
                                    pipe.train_step(x, y)
                        pipe.flush()
                rows.append((dtype, mode, "on" if clip else "off", count.copies))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(2)
    n = args.layers * args.hidden ** 2
    print(f"1. AdamW state over {n / 1e6:.1f}M fp32 parameters "
          f"({args.layers} x {args.hidden}^2), 2 intra-op threads, median of {args.repeat}")
    print(f"{'state':<8}{'state MB':>10}{'B/param':>9}{'vs fp32':>9}{'step ms':>9}"
          f"{'vs fp32':>9}")
    rows = step_times(args.layers, args.hidden, args.repeat)
    b0, t0 = rows[0][1], rows[0][2]
    for name, nbytes, sec in rows:
        print(f"{name:<8}{nbytes / 1e6:>10.1f}{nbytes / n:>9.3f}{nbytes / b0:>9.3f}"
              f"{sec * 1e3:>9.1f}{sec / t0:>9.2f}")
    for calls in (1, 3):
        print(f"\n2. peak fp32 weight gradients alive, in copies of the model's "
              f"(calls per step: {calls})")
        print(f"{'compute':<9}{'mode':<9}{'clip':<6}{'copies':>8}")
        for dtype, mode, clip, copies in grad_copies(calls):
            print(f"{dtype:<9}{mode:<9}{clip:<6}{copies:>8.2f}")


if __name__ == "__main__":
    main()
