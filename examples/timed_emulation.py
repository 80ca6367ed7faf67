"""Run RoundPipe on emulated 8x RTX 4090 at Qwen3-1.7B's shapes (timed emulation) and
compare the measured call with the simulator's prediction for the same schedule.

    python examples/timed_emulation.py
"""

import torch

import rotapipe
from rotapipe.model.tiny import lm_loss, stride_batch
from rotapipe.runtime.emulation import TimedEmulation
from rotapipe.sim import ActionTimes, run

em = TimedEmulation.of("qwen3-1.7b", "rtx4090x8", seq=2048, dilation=3)
torch.manual_seed(0)
model = em.stand_in()                 # as many layers as Qwen3-1.7B: embed, 28 blocks, head
M = 8
pipe = rotapipe.RoundPipe(model, lm_loss, config=rotapipe.PipeConfig(
    workers=8, microbatches=M, backend="emulated", emulation=em, check_races=False))
x, y = stride_batch(M, 16, vocab=32)
predicted = run(pipe.schedule(), ActionTimes(pipe.plan, em.costs)).makespan
for call in range(3):
    loss = pipe.forward_backward(x, y)
    measured = pipe.last_timeline().makespan / em.dilation
    print(f"call {call}: loss {loss:.4f}, {measured:.1f} ms on 8x RTX 4090 "
          f"(simulator: {predicted:.1f} ms, ratio {measured / predicted:.3f}), "
          f"{M * em.costs.tokens / measured * 1e3:,.0f} tokens/s")
pipe.close()
