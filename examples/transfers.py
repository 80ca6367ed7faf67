"""Host memory modes and gated weight chunks, side by side on emulated workers.

1. The same tiny model trained with ``pin="copy"``, ``"register"`` and ``"off"``:
   equal losses, different host memory (``pipe.pinning.stats``).
2. A PCIe-bound shape under timed emulation (one worker; each layer's weights take
   20 ms to upload, a forward 4 ms): the call with gated chunks (the default) and
   with ``gate_copies=False``, where activation uploads wait behind whole weight
   prefetches, as a GPU's copy engine makes them.

    python examples/transfers.py
"""

import torch

import rotapipe
from rotapipe.model.tiny import lm_loss, stride_batch, tiny_gpt
from rotapipe.plan import LayerCost, ModelCosts, even_plan
from rotapipe.runtime.emulation import TimedEmulation

x, y = stride_batch(8, 16, vocab=64)
curves = {}
for pin in ("copy", "register", "off"):
    torch.manual_seed(0)
    pipe = rotapipe.RoundPipe(tiny_gpt(64, 64, 4, seq=16), lm_loss, config=rotapipe.PipeConfig(
        workers=2, microbatches=4, backend="emulated", pin=pin))
    pipe.attach_optimizer(torch.optim.AdamW(pipe.parameters(), lr=1e-3))
    losses = [pipe.train_step(x, y) for _ in range(3)]
    stats = {k: v for k, v in pipe.pinning.stats.items() if v}
    print(f"pin={pin:8s} losses {' '.join(f'{l:.6f}' for l in losses)}  host bytes {stats}")
    pipe.close()
    curves[pin] = losses
assert curves["copy"] == curves["register"] == curves["off"], curves   # bit for bit

layers = 8
costs = ModelCosts(tuple(LayerCost(f"layer{i}", 4.0, 8.0, 4.0, 20.0, 2.0, weight_bytes=2**20)
                         for i in range(layers)), tokens=16)
em = TimedEmulation(costs, dilation=1.0)
for gate in (True, False):
    torch.manual_seed(0)
    pipe = rotapipe.RoundPipe(em.stand_in(), lm_loss, plan=even_plan(layers, 2, 2, 2),
                              config=rotapipe.PipeConfig(
                                  workers=1, microbatches=4, backend="emulated",
                                  emulation=em, gate_copies=gate, copy_chunk_mb=0.25))
    xs, ys = stride_batch(4, 16, vocab=32)
    pipe.forward_backward(xs, ys)                       # warm-up
    pipe.forward_backward(xs, ys)
    print(f"gate_copies={gate!s:5s}: call {pipe.last_timeline().makespan:.0f} ms")
    pipe.close()
