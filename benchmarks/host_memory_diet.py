"""Host memory of the QLoRA base and of the lean optimizer layout, measured next to the
planner's prediction (docs/memory.md).

1. Frozen base: a random Qwen3-architecture model (bf16, 4 layers of hidden 4096: 1.7 GB
   of model state, so that the ~26 MB no tensor holds is small beside it; see below)
   with LoRA r=16 on every projection of its blocks, wrapped with and without
   ``quantize="nf4"``, 2 emulated workers, ``sync``, 2 training steps (one call each).
   Each variant runs in a fresh process with ``MALLOC_MMAP_THRESHOLD_=65536`` (freed
   tensors go back to the OS, so RSS shows what is held), after a warm-up run of a small
   model of the same kind through the same code (lazy imports, library loads, thread
   arenas). RSS is counted from before the model existed, sampled every 3 ms from the
   pipeline's construction on, less the emulated devices' memory at that moment (on a
   GPU it is GPU memory): their block pools, and the workers' dequantized NF4 weights,
   which are copied into a pool of reused blocks as the CUDA caching allocator would
   keep them (a sample waits while a dequantization is writing its output). Printed per
   term beside the planner (``rotapipe.plan.host_memory`` with one call per step, so
   one fp32 gradient copy, and the largest tensor as the pin-copy transient), then the
   peak (against the planner's total) and what is held after the steps (against the
   planner less its gradients and transient, which are freed by then), and how much of
   that no tensor holds (Python objects, library buffers, allocator), also for the same
   model at a quarter of the hidden size: it does not grow with the model's bytes.
2. Gradients: a plain layer stack trained with ``overlap`` and ``undo_steps=False`` vs
   ``sync``; the peak of live fp32 weight-gradient bytes (each downloaded gradient
   counted until freed), in stages' worth, beside the planner's ``prefetch + 2``.

    python benchmarks/host_memory_diet.py [--layers 4 --hidden 4096 --small-hidden 1024]
"""

from __future__ import annotations

import argparse
import pathlib

from rss import run_child

HERE = str(pathlib.Path(__file__).parent)
BASE = f"import sys\nsys.path.insert(0, {HERE!r})\n" + r"""
import gc, json, threading, weakref, torch, transformers, peft, rotapipe, rotapipe.adapters
from rss import rss
from rotapipe.plan import model_costs, hardware
from rotapipe.plan.costs import nf4_bytes
from rotapipe.plan.hostmem import host_memory, lora_params
from rotapipe.model.quant import NF4Weight
from rotapipe.runtime.devices import make_devices
from rotapipe.runtime.callgrads import CallGrads
from rotapipe.runtime.pool import BlockPool
torch.set_num_threads(2)
H, L, QUANT, V = {hidden}, {layers}, {quant!r}, 512


class Live:
    # Bytes of tracked tensors alive now, and their peak (freed: finalizer).
    def __init__(self):
        self.now = self.peak = 0
        self.lock = threading.Lock()

    def add(self, n):
        with self.lock:
            self.now += n
            self.peak = max(self.peak, self.now)

    def track(self, t):
        n = t.untyped_storage().nbytes()
        self.add(n)
        weakref.finalize(t, self.gone, n)

    def gone(self, n):
        with self.lock:
            self.now -= n


class Gate:
    # The sampler reads RSS only while no worker is inside a dequantization: the pages
    # of a weight being dequantized are resident before it is counted as device memory.
    def __init__(self):
        self.cond, self.busy, self.sampling = threading.Condition(), 0, False

    def enter(self):
        with self.cond:
            while self.sampling:
                self.cond.wait()
            self.busy += 1

    def leave(self):
        with self.cond:
            self.busy -= 1
            self.cond.notify_all()

    def sample(self, read):
        with self.cond:
            self.sampling = True
            while self.busy:
                self.cond.wait()
        try:
            return read()
        finally:
            with self.cond:
                self.sampling = False
                self.cond.notify_all()


# A worker's dequantized NF4 weight is device memory. Here it is copied into a pool of
# reused blocks, as the CUDA caching allocator keeps it on a GPU, so the emulated
# devices' memory is a pool whose bytes are subtracted exactly (a freed tensor's pages
# leave RSS some time after the last reference goes, which a per-tensor count races).
grads, gate, deq_pool = Live(), Gate(), BlockPool()
_deq, _add, _get = NF4Weight.dequantize, CallGrads.add, CallGrads.get
def deq(self, *a, **k):
    gate.enter()
    try:
        w = _deq(self, *a, **k)
        out = deq_pool.empty(w.shape, w.dtype).copy_(w)
        del w       # freed (unmapped) inside the gate
        return out
    finally:
        gate.leave()
def add(self, pid, g):      # the call's gradients on the host, as staged
    cur, parts = self.staged.get(pid), len(self.parts.get(pid, ()))
    _add(self, pid, g)
    if len(self.parts.get(pid, ())) > parts:        # kept in the compute dtype
        grads.track(self.parts[pid][-1])
    elif self.staged.get(pid) is not cur:           # a new fp32 gradient
        grads.track(self.staged[pid])
def get(self, pid, *a, **k):    # ... and widened to fp32 (then param.grad)
    narrow = self.narrow(pid)
    g = _get(self, pid, *a, **k)
    if narrow and g is not None:
        grads.track(g)
    return g
NF4Weight.dequantize, CallGrads.add, CallGrads.get = deq, add, get


def build(h, layers):
    cfg = transformers.Qwen3Config(vocab_size=V, hidden_size=h, intermediate_size=3 * h,
                                   num_hidden_layers=layers, num_attention_heads=h // 64,
                                   num_key_value_heads=h // 128, head_dim=64,
                                   max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)     # built in bf16: no fp32 model first
    model = transformers.Qwen3ForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    return cfg, rotapipe.adapters.wrap_hf(model, quantize=QUANT)


pc = rotapipe.PipeConfig(workers=2, microbatches=2, backend="emulated", pin="copy",
                         precision=rotapipe.PrecisionConfig("bf16"))
ids = torch.randint(3, V, (2, 64))


def train(wrapped, devices, steps):
    pipe = wrapped.pipe(pc, devices=devices)
    pipe.attach_optimizer(torch.optim.AdamW(pipe.parameters(), lr=1e-4))
    for _ in range(steps):
        pipe.train_step(wrapped.inputs(ids), ids)
    pipe.flush()
    return pipe


def tensor_bytes(skip):
    # Bytes of every CPU tensor's storage alive now, each storage once, less ``skip``.
    seen = {{}}
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and o.device.type == "cpu":
            st = o.untyped_storage()
            if st.data_ptr() not in skip:
                seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


_, small = build(128, 2)
train(small, make_devices(pc), 1).close()
del small
gc.collect()
grads.peak = 0
devices = make_devices(pc)
def device_bytes():
    return sum(d._device_blocks.nbytes for d in devices) + deq_pool.nbytes
r0 = rss()
cfg, wrapped = build(H, L)
peak, stop = [0], threading.Event()
def sample():
    while not stop.wait(0.003):
        peak[0] = max(peak[0], gate.sample(lambda: rss() - device_bytes()) - r0)
sampler = threading.Thread(target=sample, daemon=True)
sampler.start()
with train(wrapped, devices, 2) as pipe:
    stop.set()
    sampler.join()
    gc.collect()
    held = rss() - device_bytes() - r0
    peak = max(peak[0], held)
    host = pipe.host
    blocks = [b for pool in [deq_pool] + [p for d in devices
                                          for p in (d._device_blocks, d._host_blocks)]
              for bs in pool._blocks.values() for b in bs]
    measured = dict(
        weights=sum({{c.untyped_storage().data_ptr(): c.untyped_storage().nbytes()
                     for view in host.views for c in view}}.values()),
        masters=sum(p.numel() * p.element_size() for p in pipe.parameters()),
        optimizer=sum(v.numel() * v.element_size() for st in pipe.optimizer.state.values()
                      for v in st.values() if isinstance(v, torch.Tensor)),
        gradients=grads.peak,
        downloads=sum(d._host_blocks.nbytes for d in devices),
        tensors=tensor_bytes({{b.data_ptr() for b in blocks}}))
    device = dict(pools=sum(d._device_blocks.nbytes for d in devices),
                  dequantized=deq_pool.nbytes)
    largest = max(nf4_bytes(3 * H * H) if QUANT else 2 * 3 * H * H, 2 * V * H)
    costs = model_costs(cfg.to_dict(), hardware("rtx4090x1"), seq=64)
    pred = host_memory(costs, pipe.plan, 2, 2, trainable_params=lora_params(cfg.to_dict(), 16),
                       quantized=QUANT is not None, pin="copy", staged_grads=False,
                       largest_tensor=largest)
print(json.dumps({{"peak": peak, "held": held, "measured": measured, "device": device,
                  "pred": pred.as_dict()}}))
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
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--small-hidden", type=int, default=1024,
                    help="hidden size of the second bf16 run that shows the bytes in no "
                         "tensor do not grow with the model's size")
    args = ap.parse_args()
    env = {"MALLOC_MMAP_THRESHOLD_": "65536"}
    print(f"1. frozen base, Qwen3 {args.layers} x {args.hidden}, LoRA r=16, bf16, "
          "2 emulated workers, 2 threads; MB (1e6 bytes)")
    rows = {q: run_child(BASE.format(hidden=args.hidden, layers=args.layers, quant=q), **env)
            for q in (None, "nf4")}
    print(f"{'term':<36}" + "".join(f"{q or 'bf16':>10}{'planner':>9}" for q in rows))
    terms = [("weights (compute copies, base)", "weights", "weights"),
             ("fp32 masters", "masters", "masters"),
             ("optimizer state", "optimizer", "optimizer"),
             ("gradients (peak: staged + fp32)", "gradients", "gradients"),
             ("download blocks / staging+ckpts", "downloads", None),
             ("pin-copy transient", None, "transient")]
    for name, got, want in terms:
        line = f"{name:<36}"
        for r in rows.values():
            m = r["measured"][got] if got else None
            p = r["pred"][want] if want else r["pred"]["pinned_buffers"] \
                + r["pred"]["checkpoints"]
            line += (f"{m / 1e6:>10.1f}" if m is not None else f"{'-':>10}") + \
                f"{p / 1e6:>9.1f}"
        print(line)

    def steady(r):      # what the planner says is still held after the steps
        return r["pred"]["total"] - r["pred"]["gradients"] - r["pred"]["transient"]

    def untracked(r):   # resident bytes no tensor holds: Python objects, allocator
        return r["held"] - r["measured"]["tensors"] - r["measured"]["downloads"]

    for name, key, want in (("peak RSS growth, less device", "peak",
                             lambda r: r["pred"]["total"]),
                            ("held after the steps, less device", "held", steady)):
        print(f"{name:<36}" + "".join(f"{r[key] / 1e6:>10.1f}{want(r) / 1e6:>9.1f}"
                                      for r in rows.values())
              + "   ratio " + " ".join(f"{r[key] / want(r):.3f}" for r in rows.values()))
    print(f"{'  of it in no tensor':<36}" + "".join(f"{untracked(r) / 1e6:>10.1f}{'-':>9}"
                                                 for r in rows.values()))
    print("(held: the planner less its gradients and transient, freed by then)")
    print("subtracted (emulated devices): " + "; ".join(
        f"{q or 'bf16'} pools {r['device']['pools'] / 1e6:.1f}, dequantized-weight pool "
        f"{r['device']['dequantized'] / 1e6:.1f}" for q, r in rows.items()))
    print(f"planner's frozen-base bytes: NF4 {rows['nf4']['pred']['weights'] / 1e6:.1f} MB vs "
          f"bf16 {rows[None]['pred']['weights'] / 1e6:.1f} MB (adapters' copies included)")
    small = run_child(BASE.format(hidden=args.small_hidden, layers=args.layers, quant=None),
                      **env)
    big = rows[None]
    print(f"bytes in no tensor, bf16, {args.layers} layers: hidden {args.small_hidden} "
          f"{untracked(small) / 1e6:.1f} MB (model state {small['measured']['tensors'] / 1e6:.1f}), "
          f"hidden {args.hidden} {untracked(big) / 1e6:.1f} MB (model state "
          f"{big['measured']['tensors'] / 1e6:.1f})")
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
