"""Choosing ``PipeConfig.copy_chunk_mb``: RoundPipe's step time against the weight-chunk
size, simulated and measured in timed emulation, on emulated 8x RTX 4090.

Smaller chunks shorten the longest wait of a critical copy behind a weight chunk;
each chunk costs one gated issue (the dispatcher sees the previous chunk complete,
then issues the next), which leaves the copy engine idle for a moment. The simulator
charges no such gap, the runtime pays it for real: ``rt/sim`` shows what the chunks
cost. Settings: as ``benchmarks/timed_emulation.py`` (the planner's plan, 16
microbatches of one 2048-token sequence, the embedding moving by the call's rows,
pipelined calls with the ``overlap`` optimizer, whose steady-state step is compared
with the simulator's, dilation so that the shortest compute action lasts
``--min-action-ms``), gating on.

    python benchmarks/chunk_size.py
    python benchmarks/chunk_size.py --models qwen3-32b --chunks 16,32,64
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch

import rotapipe
from rotapipe.runtime.emulation import TimedEmulation
from rotapipe.sim import ActionTimes
from timed_emulation import (DEVICES, WARMUP, loss_period, measure, pipelined_sim,
                             planned)

MIB = 2**20


def bench(model: str, args) -> None:
    M = args.microbatches
    em0 = TimedEmulation.of(model, "rtx4090x8", seq=2048, optimizer_params_per_s=5e9,
                            call_tokens=2048 * M)
    choice = planned(em0.costs, M)
    costs, plan = choice.costs, choice.plan
    schedule = rotapipe.roundpipe_schedule(plan, DEVICES, M)
    dilation = replace(em0, costs=costs).calibrated(
        plan, schedule, min_action_ms=args.min_action_ms).dilation
    layer_mb = max(l.weight_bytes for l in costs.layers) / MIB
    print(f"\n{model}: plan {plan.to_text()}, dilation {dilation:.2f}x, largest layer "
          f"{layer_mb:,.0f} MiB")
    print(f"{'chunk MiB':>9s} {'chunks/step':>11s} {'sim ms':>8s} {'runtime ms':>10s} "
          f"{'rt/sim':>7s}")
    for mb in args.chunks:
        chunk = int(mb * MIB)
        t = ActionTimes(plan, costs, chunk)
        n = sum(len(t(a)) for a in schedule.actions if a.kind.value in ("UW", "DW"))
        em = replace(em0, costs=costs, dilation=dilation)
        # overlap runs pipelined calls: compare steady-state steps.
        sim = pipelined_sim(em, plan, "overlap", M, WARMUP + args.steps, chunk)
        sim_ms = loss_period(sim, plan, args.steps)
        row = measure(f"{mb:g}", em, plan, None, "overlap", choice.grain.value, M,
                      args.steps, sim, chunk_mb=mb)
        print(f"{mb:9g} {n:11d} {sim_ms:8.1f} {row['ratio'] * sim_ms:10.1f} "
              f"{row['ratio']:7.3f}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen3-1.7b,qwen3-32b")
    ap.add_argument("--chunks", default="8,16,32,64,256",
                    type=lambda s: [float(x) for x in s.split(",")])
    ap.add_argument("--microbatches", type=int, default=16)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--min-action-ms", type=float, default=20.0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    for model in args.models.split(","):
        bench(model.strip(), args)


if __name__ == "__main__":
    main()
