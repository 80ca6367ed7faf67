"""Host memory of the QLoRA base and of the lean optimizer layout, measured next to the
planner's prediction (docs/memory.md).

1. Frozen base: a random Qwen3-architecture model (bf16) with LoRA r=16 on every
   projection of its blocks, wrapped with and without ``quantize="nf4"``, 2 emulated
   workers, 2 training steps. Each variant runs in a fresh process with
   ``MALLOC_MMAP_THRESHOLD_=65536`` (freed tensors go back to the OS, so RSS shows what
   is held). Printed: RSS after the steps over the process before the model existed,
   and the planner's host bytes (``rotapipe.plan.host_memory``) for the same model.
2. Gradients: a plain layer stack trained with ``overlap`` and ``undo_steps=False`` vs
   ``sync``; the peak of live fp32 weight-gradient bytes (each downloaded gradient
   counted until freed), in stages' worth, beside the planner's ``prefetch + 2``.

    python benchmarks/host_memory_diet.py [--layers 8 --hidden 1024]
"""

from __future__ import annotations

import argparse
import pathlib

from rss import run_child

HERE = str(pathlib.Path(__file__).parent)
BASE = f"import sys\nsys.path.insert(0, {HERE!r})\n" + r"""
import json, torch, transformers, peft, rotapipe, rotapipe.adapters
from rss import rss
from rotapipe.plan import model_costs, hardware
from rotapipe.plan.hostmem import host_memory, lora_params
torch.set_num_threads(2)
H, L, QUANT = {hidden}, {layers}, {quant!r}
cfg = transformers.Qwen3Config(vocab_size=512, hidden_size=H, intermediate_size=3 * H,
                               num_hidden_layers=L, num_attention_heads=H // 64,
                               num_key_value_heads=H // 128, head_dim=64,
                               max_position_embeddings=128, tie_word_embeddings=False)
r0 = rss()
torch.manual_seed(0)
model = transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16)
model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules=[
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
wrapped = rotapipe.adapters.wrap_hf(model, quantize=QUANT)
pc = rotapipe.PipeConfig(workers=2, microbatches=2, backend="emulated", pin="copy",
                         precision=rotapipe.PrecisionConfig("bf16"))
ids = torch.randint(3, 512, (2, 64))
with wrapped.pipe(pc) as pipe:
    pipe.attach_optimizer(torch.optim.AdamW(pipe.parameters(), lr=1e-4))
    for _ in range(2):
        pipe.train_step(wrapped.inputs(ids), ids)
    pipe.flush()
    held = rss() - r0
    plan, M = pipe.plan, 2
    costs = model_costs(cfg.to_dict(), hardware("rtx4090x1"), seq=64)
    pred = host_memory(costs, plan, M, 2, trainable_params=lora_params(cfg.to_dict(), 16),
                       quantized=QUANT is not None, pin="copy")
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
print(json.dumps({{"held": held, "pred": pred.total, "pred_weights": pred.weights,
                  "frozen": frozen}}))
"""

GRADS = f"import sys\nsys.path.insert(0, {HERE!r})\n" + r"""
import json, weakref, torch, rotapipe
from torch import nn
from rotapipe.runtime.store import Store
torch.set_num_threads({threads})
live = peak = 0
put = Store.put
def counting(store, key, value, what=None, extra_bytes=0):
    global live, peak
    if store.device is None and isinstance(key, tuple) and key[0] == "wgrad":
        for t in value.values():
            n = t.numel() * t.element_size()
            live += n
            peak = max(peak, live)
            def free(n=n):
                global live
                live -= n
            weakref.finalize(t, free)
    return put(store, key, value, what, extra_bytes)
Store.put = counting
torch.manual_seed(0)
layers = [nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(24)]
cfg = rotapipe.PipeConfig(workers=2, microbatches=4, backend="emulated",
                          optimizer_mode={mode!r}, undo_steps={undo}, prefetch={prefetch},
                          forward_stages=6, backward_stages=24)
with rotapipe.RoundPipe(layers, lambda y, t: ((y - t) ** 2).mean(), config=cfg,
                        optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3)) as pipe:
    for s in range(4):
        x = torch.randn(16, 256)
        pipe.train_step(x, x)
    pipe.flush()
    stage = 4 * (256 * 256 + 256)
    total = 4 * sum(p.numel() for p in pipe.parameters())
print(json.dumps({{"peak": peak, "stage": stage, "total": total}}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    args = ap.parse_args()
    env = {"MALLOC_MMAP_THRESHOLD_": "65536"}
    print(f"1. frozen base, Qwen3 {args.layers} x {args.hidden}, LoRA r=16, bf16, "
          "2 emulated workers, 2 threads")
    print(f"{'base':<8}{'RSS held MB':>12}{'planner MB':>12}{'ratio':>8}")
    rows = {}
    for quant in (None, "nf4"):
        r = run_child(BASE.format(hidden=args.hidden, layers=args.layers, quant=quant),
                      **env)
        rows[quant] = r
        print(f"{quant or 'bf16':<8}{r['held'] / 1e6:>12.1f}{r['pred'] / 1e6:>12.1f}"
              f"{r['held'] / r['pred']:>8.2f}")
    print(f"planner's frozen-base bytes: NF4 {rows['nf4']['pred_weights'] / 1e6:.1f} MB vs "
          f"bf16 {rows[None]['pred_weights'] / 1e6:.1f} MB (adapters' copies included)")
    print("\n2. fp32 weight gradients alive on the host at once (24 layers of 256x256, "
          "24 backward stages, 4 train_steps)")
    print(f"{'mode':<28}{'threads':>8}{'peak KB':>10}{'stages':>8}{'planner':>9}")
    for mode, undo, prefetch, threads in (("sync", True, 1, 2), ("overlap", True, 1, 2),
                                          ("overlap", False, 1, 2),
                                          ("overlap", False, 2, 2),
                                          ("overlap", False, 1, 1)):
        r = run_child(GRADS.format(mode=mode, undo=undo, prefetch=prefetch,
                                   threads=threads))
        name = f"{mode}{'' if undo else ' lean'} prefetch {prefetch}"
        planner = "all" if undo else f"{prefetch + 2}"
        print(f"{name:<28}{threads:>8}{r['peak'] / 1e3:>10.0f}"
              f"{r['peak'] / r['stage']:>8.1f}{planner:>9}")


if __name__ == "__main__":
    main()
