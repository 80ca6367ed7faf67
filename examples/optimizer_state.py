"""Optimizer state in fp32, bf16 or 8 bits, and gradient accumulation (docs/memory.md).

Trains one tiny transformer three times, with ``PipeConfig.optimizer_state_dtype``
``"fp32"`` (exact), ``"bf16"`` (torch AdamW, moments kept in bf16 between steps) and
``"int8"`` (bitsandbytes' 8-bit AdamW), two calls accumulated per step in bf16 compute,
and prints the optimizer state's bytes and the loss curve of each. Runs on the CPU
(emulated workers) in about a minute:

    python examples/optimizer_state.py
"""

import torch

import rotapipe
from rotapipe.model import tiny
from rotapipe.runtime.optstate import state_bytes

STEPS = 25


def optimizer(state_dtype, params):
    if state_dtype == "int8":
        import bitsandbytes as bnb          # pip install 'rotapipe[qlora]'
        return bnb.optim.AdamW8bit(params, lr=3e-3)
    return torch.optim.AdamW(params, lr=3e-3, fused=True)


def train(state_dtype):
    config = rotapipe.PipeConfig(workers=2, microbatches=2, precision="bf16",
                                 optimizer_mode="overlap", clip_grad_norm=1.0,
                                 optimizer_state_dtype=state_dtype)
    g = torch.Generator().manual_seed(1)
    losses = []
    torch.manual_seed(0)
    with rotapipe.RoundPipe(tiny.tiny_gpt(), tiny.lm_loss, config=config) as pipe:
        opt = optimizer(state_dtype, pipe.parameters())
        pipe.attach_optimizer(opt)
        for _ in range(STEPS):
            pipe.forward_backward(*tiny.stride_batch(8, 32, generator=g))   # accumulated
            losses.append(float(pipe.train_step(*tiny.stride_batch(8, 32, generator=g))))
        pipe.flush()
        return state_bytes(opt), losses


if __name__ == "__main__":
    results = {d: train(d) for d in ("fp32", "bf16", "int8")}
    base, curve = results["fp32"]
    for name, (nbytes, losses) in results.items():
        gap = max(abs(a - b) for a, b in zip(losses, curve))
        print(f"{name}: optimizer state {nbytes / 1e6:.2f} MB ({nbytes / base:.2f}x), "
              f"loss {losses[0]:.4f} -> {losses[-1]:.4f}, largest gap to fp32's curve "
              f"{gap:.4f}")
