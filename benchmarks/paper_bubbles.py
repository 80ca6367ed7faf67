"""RoundPipe's bubble with the exact optimizer on the paper's five models, against the
issue-16 goal (about 0.75x the paper's own simulated bubbles).

For each model: the planner's plan (``rotapipe plan MODEL --microbatches 16``: 8x RTX
4090, sequence 2048, one sequence per microbatch, full fine-tuning, Qwen3-235B-A22B
with LoRA rank 16; the planner's cost model, fp16 without fp16 accumulation unless
``--fp16-accumulate``; LoRA priced as LoRA: a frozen weight's backward computes only
its input gradient, and only the adapters' gradients go down), simulated for one
call: once with the fused tail as one job (``tail_jobs=(1,)``) and once with the
planner free to split it into up to 8 jobs (one per worker). A split tail's extra
jobs each upload the head's weights and download their gradients; the simulator
charges both. Both runs include the planner's re-cut
candidates (thin first stages, local search on the job-grain estimate). Also the wall
and CPU time of ``analyze`` (what ``rotapipe plan`` runs, longest-sequence search
included; on a shared machine the CPU time is the figure to read), and the bubble of
the same plan in the exact mode's pipelined calls (``overlap``: six calls, steady
state between the last five losses, no optimizer time, a LoRA base uploaded without
waiting for the optimizer: ``roundpipe_stale_schedule(staleness=0, frozen=...)``).

    python benchmarks/paper_bubbles.py [--fp16-accumulate] [--rounds R]

``--rounds R`` adds a column: the planner's plan run as ``R`` accumulating calls of
``16 / R`` microbatches (what the exact mode runs for ``forward_backward`` calls
followed by ``train_step``: nothing is stepped between them, so no call waits for an
update), its bubble over the whole makespan.

GPT-OSS-20B is the shipped config (``gpt-oss-20b``). The last column's planning time
runs in this process (``rotapipe plan`` adds about 0.1 s of imports: no torch).
"""

from __future__ import annotations

import argparse
import time

from rotapipe.plan import hardware
from rotapipe.planner import analyze
from rotapipe.planner.advise import _costs, _trainable
from rotapipe.planner.autoplan import PlannerConfig, choose_plan
from rotapipe.schedule import roundpipe_stale_schedule
from rotapipe.schedule.actions import COMPUTE_PASSES
from rotapipe.schedule.timeline import Resource
from rotapipe.sim import ActionTimes, run
from rotapipe.sim.report import steady_bubble

# (name, config, LoRA rank, the paper's simulated exact-mode bubble, the goal)
MODELS = [("Qwen3-1.7B", "qwen3-1.7b", None, 19.1, 14.0),
          ("Llama-3.1-8B", "llama-3.1-8b", None, 14.3, 10.0),
          ("GPT-OSS-20B", "gpt-oss-20b", None, 14.0, 10.0),
          ("Qwen3-32B", "qwen3-32b", None, 6.7, 5.0),
          ("Qwen3-235B-A22B LoRA", "qwen3-235b-a22b", 16, 3.3, 2.5)]
M, SEQ = 16, 2048
CALLS = 6


def pipelined_bubble(choice) -> float:
    """Idle share of a worker's time in the steady state of ``CALLS`` exact overlapping
    calls of ``choice``'s plan (per call: the period between consecutive losses)."""
    plan, costs = choice.plan, choice.costs
    s = roundpipe_stale_schedule(plan, 8, M, calls=CALLS, staleness=0, frozen=costs.frozen)
    return steady_bubble(run(s, ActionTimes(plan, costs)), plan, CALLS - 2)[1]


def rounds_bubble(choice, rounds: int) -> float:
    """Idle share of ``rounds`` accumulating calls of ``M / rounds`` microbatches of
    ``choice``'s plan, over their whole makespan."""
    plan, costs = choice.plan, choice.costs
    s = roundpipe_stale_schedule(plan, 8, M // rounds, calls=rounds, staleness=rounds,
                                 frozen=costs.frozen)
    tl = run(s, ActionTimes(plan, costs))
    busy = sum(sp.end - sp.start for sp in tl.spans
               if sp.resource == Resource.COMPUTE and sp.action.kind in COMPUTE_PASSES)
    return 1 - busy / (8 * tl.makespan)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fp16-accumulate", action="store_true")
    ap.add_argument("--rounds", type=int, default=0)
    args = ap.parse_args(argv)
    hw = hardware("rtx4090x8", fp16_accumulate=args.fp16_accumulate)
    print(f"8x RTX 4090 ({hw.flops / 1e12:.0f} TFLOPS sustained), seq {SEQ}, {M} "
          "microbatches, exact optimizer, one call simulated")
    head = (f"{'model':22s} {'1 tail job':>18s} {'planner':>24s} {'paper':>6s} "
            f"{'goal':>6s} {'met':>4s} {'plan s':>7s} {'cpu s':>6s} {'pipelined':>9s}"
            + (f" {f'{args.rounds} rounds':>9s}" if args.rounds else ""))
    print(head)
    print(f"{'':22s} {'step ms':>9s} {'bubble':>8s} {'step ms':>9s} {'bubble':>8s} "
          f"{'tail':>6s}")
    for name, model, lora, paper, goal in MODELS:
        t0, c0 = time.perf_counter(), time.process_time()
        a = analyze(model, hw, seq=SEQ, global_batch=M, microbatches=M, lora_rank=lora)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        c = a.choice
        trainable, grads = _trainable(model, hw, lora)    # as analyze() plans LoRA
        one = choose_plan(lambda m: _costs(model, hw, SEQ, adapters=trainable,
                                           global_batch=M),
                          PlannerConfig(8, a.device_limit, (M,), grad_bytes=grads))
        best = c.report
        met = "yes" if 100 * best.bubble.total <= goal else "no"
        print(f"{name:22s} {one.step_ms:9.1f} {100 * one.report.bubble.total:7.1f}% "
              f"{best.step_ms:9.1f} {100 * best.bubble.total:7.1f}% "
              f"{'x' + str(c.plan.tail_jobs):>6s} {paper:5.1f}% {goal:5.1f}% {met:>4s} "
              f"{seconds:7.2f} {cpu:6.2f} {100 * pipelined_bubble(c):8.1f}%"
              + (f" {100 * rounds_bubble(c, args.rounds):8.1f}%" if args.rounds else ""))


if __name__ == "__main__":
    main()
