"""Does ``rotapipe plan --modes`` price the optimizer modes as the runtime runs them?

Runs one model's planned plan (emulated 8x RTX 4090, sequence 2048, 16 microbatches,
the embedding moving by rows) under timed emulation in each optimizer mode, one mode
after the other, and prints the runtime's step (the wall time between ``train_step``
returns, after warm-up) beside what :func:`rotapipe.planner.optimizer_modes` prices for
the same plan and host optimizer rate. ``--clip C`` sets ``clip_grad_norm`` (``1e-9``:
a clip that takes effect at every step, which ``--modes --clip`` prices); the default
runs without one.

    python benchmarks/mode_prices.py                 # about 3 minutes on 2 cores
    python benchmarks/mode_prices.py --clip 1e-9

Timed emulation charges the host optimizer the same rate the price uses, so the ratio
measures the runtime's own overhead around the modelled work (docs/planning.md, "The
optimizer modes' steps").
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

import rotapipe
from rotapipe.model.tiny import lm_loss, stride_batch
from rotapipe.planner import optimizer_modes
from rotapipe.planner.autoplan import OPTIMIZER_RATE
from rotapipe.runtime.emulation import TimedEmulation
from rotapipe.sim import ActionTimes, run
from timed_emulation import DEVICES, WARMUP, planned


def step_ms(em, choice, mode: str, microbatches: int, steps: int,
            clip: float | None) -> float:
    """Emulated ms per step between ``train_step`` returns, after ``WARMUP`` steps."""
    torch.manual_seed(0)
    model = em.stand_in()
    config = rotapipe.PipeConfig(workers=DEVICES, microbatches=microbatches,
                                 backend="emulated", emulation=em, optimizer_mode=mode,
                                 grain=choice.grain.value, check_races=False,
                                 clip_grad_norm=clip)
    pipe = rotapipe.RoundPipe(model, lm_loss, config=config, plan=choice.plan,
                              lookups={model[0].tok: lambda ids: ids})
    pipe.attach_optimizer(torch.optim.AdamW(pipe.parameters(), lr=1e-4))
    x, y = stride_batch(microbatches, 16, 32)
    with pipe:
        for _ in range(WARMUP):
            pipe.train_step(x, y)
        t0 = time.perf_counter()
        for _ in range(steps):
            pipe.train_step(x, y)
        return (time.perf_counter() - t0) / steps / em.dilation * 1e3


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-1.7b")
    ap.add_argument("--microbatches", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--clip", type=float, default=None,
                    help="clip_grad_norm (1e-9: a clip that takes effect at every step)")
    ap.add_argument("--optimizer-rate", type=float, default=OPTIMIZER_RATE)
    ap.add_argument("--min-action-ms", type=float, default=20.0)
    args = ap.parse_args(argv)
    M = args.microbatches
    em0 = TimedEmulation.of(args.model, "rtx4090x8", seq=2048, call_tokens=2048 * M,
                            optimizer_params_per_s=args.optimizer_rate)
    choice = planned(em0.costs, M)
    priced = optimizer_modes(choice, DEVICES, args.optimizer_rate,
                             clip=args.clip is not None)
    call = run(rotapipe.roundpipe_schedule(choice.plan, DEVICES, M),
               ActionTimes(choice.plan, choice.costs))
    em = replace(em0, costs=choice.costs).calibrated(choice.plan, call.schedule,
                                                     min_action_ms=args.min_action_ms)
    print(f"{args.model}, clip {args.clip}, dilation {em.dilation:.2f}")
    print(f"{'mode':8s} {'runtime ms':>11s} {'priced ms':>10s} {'rt/priced':>9s}")
    for mode in ("sync", "overlap", "stale"):
        got = step_ms(em, choice, mode, M, args.steps, args.clip)
        want = getattr(priced, f"{mode}_ms")
        print(f"{mode:8s} {got:11.1f} {want:10.1f} {got / want:9.3f}", flush=True)


if __name__ == "__main__":
    main()
