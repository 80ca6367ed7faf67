"""Run RoundPipe on emulated 8x RTX 4090 at Qwen3-1.7B's shapes (timed emulation) and
compare the measured call with the simulator's prediction for the same schedule.

The dilation (real seconds per emulated second) is calibrated to the plan, as
``benchmarks/timed_emulation.py`` does it: the shortest compute action lasts 20 ms of
real time, so Python's cost of issuing an action stays small against it even on a
loaded machine (``TimedEmulation.calibrated``).

    python examples/timed_emulation.py                    # shortest action 20 ms
    python examples/timed_emulation.py --min-action-ms 60  # a busier machine
"""

import argparse
import statistics
from dataclasses import replace

import torch

import rotapipe
from rotapipe.model.tiny import lm_loss, stride_batch
from rotapipe.runtime.emulation import TimedEmulation
from rotapipe.sim import ActionTimes, run

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--min-action-ms", type=float, default=20.0,
                help="real ms the shortest compute action lasts (sets the dilation)")
ap.add_argument("--calls", type=int, default=4, help="calls (the first is a warm-up)")
args = ap.parse_args()
torch.set_num_threads(1)              # the stand-in's layers are tiny: no intra-op threads
M = 8
em = TimedEmulation.of("qwen3-1.7b", "rtx4090x8", seq=2048)
cfg = rotapipe.PipeConfig(workers=8, microbatches=M, backend="emulated", emulation=em,
                          check_races=False)
torch.manual_seed(0)
model = em.stand_in()                 # as many layers as Qwen3-1.7B: embed, 28 blocks, head
with rotapipe.RoundPipe(model, lm_loss, config=cfg) as probe:   # the plan it will run
    plan, schedule = probe.plan, probe.schedule()
em = em.calibrated(plan, schedule, min_action_ms=args.min_action_ms)
predicted = run(schedule, ActionTimes(plan, em.costs)).makespan
print(f"{len(plan.jobs())} stage jobs; dilation {em.dilation:.1f}x (the shortest compute action "
      f"takes {args.min_action_ms:g} ms of real time)")
torch.manual_seed(0)
pipe = rotapipe.RoundPipe(em.stand_in(), lm_loss, config=replace(cfg, emulation=em),
                          plan=plan)
x, y = stride_batch(M, 16, vocab=32)
ratios = []
for call in range(args.calls):
    loss = pipe.forward_backward(x, y)
    pipe.zero_grad()
    measured = pipe.last_timeline().makespan / em.dilation
    print(f"call {call}: loss {loss:.4f}, {measured:.1f} ms on 8x RTX 4090 "
          f"(simulator: {predicted:.1f} ms, ratio {measured / predicted:.3f}), "
          f"{M * em.costs.tokens / measured * 1e3:,.0f} tokens/s"
          + (" (warm-up)" if call == 0 else ""))
    ratios.append(measured / predicted)
pipe.close()
if len(ratios) > 1:
    print(f"runtime / simulator after the warm-up: median {statistics.median(ratios[1:]):.3f}"
          f" (the runtime's scheduling overhead on this machine)")
