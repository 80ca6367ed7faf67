"""Host memory of each pin mode (docs/host_memory.md): LoRA on a memory-mapped base.

A random Qwen3-architecture model (about 0.3 GB in bf16 by default) is saved with
``save_pretrained`` (safetensors) to a temporary directory. For each mode (``off``,
``copy``, ``register``), a fresh subprocess loads it with ``rotapipe.adapters.load_hf``
(memory-mapped), adds LoRA adapters with ``peft`` (r=16 on every block linear, the base
frozen), wraps it with ``rotapipe.adapters.wrap_hf`` and trains a few steps on emulated
workers with ``PipeConfig(pin=mode)``, bf16 compute. Reported, from the RSS before
``load_hf`` (sampled every 5 ms by ``rss.py``):

- peak: the peak RSS growth over loading, building and training;
- host: the peak minus the emulated workers' accounted device peaks (their "device"
  memory is host memory here, and would be on the GPU);
- the pool: page-locked staging and bounce buffers (``pinning.stats["buffers_peak"]``).

The check: in mode ``off`` the host growth stays within 1.1x the safetensors file plus
the pool (the base's pages are faulted in once, from the page cache, and never copied).
Emulated workers pin nothing, so ``register`` costs what ``off`` does here; on CUDA it
page-locks the same pages in place. Threads: ``torch.set_num_threads(2)``.

    python benchmarks/pin_memory.py [--layers 8 --hidden 1024 --steps 3]
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile

from rss import run_child

CHILD = f"import sys\nsys.path.insert(0, {str(pathlib.Path(__file__).parent)!r})\n" + r"""
import gc, json, time, torch, transformers
from rss import Sampler, rss   # peak RSS over a block (ru_maxrss counts import peaks)
torch.set_num_threads(2)
import rotapipe, rotapipe.adapters
from rotapipe.runtime.pool import BlockPool
import peft
MODE = {mode!r}


def lora(model):
    torch.manual_seed(0)                       # the same adapter in every mode
    return peft.get_peft_model(model, peft.LoraConfig(
        r={rank}, lora_alpha=2 * {rank}, target_modules={targets!r}))


def train(model, steps, tokens):
    wrapped = rotapipe.adapters.wrap_hf(model)
    cfg = rotapipe.PipeConfig(workers=2, microbatches=2, backend="emulated", pin=MODE,
                              precision=rotapipe.PrecisionConfig("bf16"))
    pipe = wrapped.pipe(cfg)
    pipe.attach_optimizer(torch.optim.AdamW(pipe.parameters(), lr=1e-4))
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, tokens)
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = pipe.forward_backward(wrapped.inputs(ids), ids)
        pipe.step()
    return pipe, loss, (time.perf_counter() - t0) / steps


def device_bytes(pipe):
    # Emulated workers hold their "device" memory in this process: the blocks their
    # pools keep (uploaded weights, download targets), or at least their peaks.
    pooled = sum(v.nbytes for d in pipe.devices for v in vars(d).values()
                 if isinstance(v, BlockPool))
    return max(pooled, sum(pipe.peak_memory()))


# Warm-up on a small model of the same family, so that code pages, thread pools and
# allocator arenas are resident before the baseline.
small = transformers.AutoConfig.from_pretrained({path!r})
small.update(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=32))
pipe, _, _ = train(lora(transformers.AutoModelForCausalLM.from_config(small)), 1, (2, 8))
pipe.close()
del pipe
gc.collect()

def rss_kinds():
    status = dict(l.split(":") for l in open("/proc/self/status") if l.startswith("Rss"))
    return {{k: int(v.split()[0]) * 1024 for k, v in status.items()}}


base, kinds = rss(), rss_kinds()
with Sampler() as s:
    model = lora(rotapipe.adapters.load_hf({path!r}, dtype=torch.bfloat16))
    pipe, loss, step_s = train(model, {steps}, ({batch}, {seq}))
now = rss_kinds()
print(json.dumps(dict(mode=pipe.pin_mode.value, peak=s.peak - base, end=rss() - base,
                      file=now["RssFile"] - kinds["RssFile"],
                      anon=now["RssAnon"] - kinds["RssAnon"],
                      devices=device_bytes(pipe), step_s=step_s, loss=loss,
                      adapter=sum(p.numel() for p in pipe.parameters()),
                      **pipe.pinning.stats)))
pipe.close()
"""


def child(code: str) -> dict:
    # A fixed mmap threshold makes glibc return every freed block over 128 KiB to the
    # system at once (its default threshold grows to 32 MiB and keeps freed
    # activations in the heap), so RSS follows the memory actually in use.
    return run_child(code, MALLOC_MMAP_THRESHOLD_="131072")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj")
    p.add_argument("--modes", default="off,copy,register")
    args = p.parse_args()
    import torch
    import transformers
    cfg = transformers.Qwen3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256), head_dim=64,
        tie_word_embeddings=False)
    mib = 2**20
    rows = []
    with tempfile.TemporaryDirectory() as d:
        torch.manual_seed(0)
        transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(d)
        size = sum(f.stat().st_size for f in pathlib.Path(d).glob("*.safetensors"))
        for mode in args.modes.split(","):
            rows.append(child(CHILD.format(path=d, mode=mode, steps=args.steps,
                                           batch=args.batch, seq=args.seq, rank=args.rank,
                                           targets=args.targets.split(","))))
    print(f"Qwen3-architecture model, {args.layers} layers, hidden {args.hidden}, vocab "
          f"{args.vocab}, bf16: safetensors file {size / mib:.0f} MiB; LoRA r={args.rank} "
          f"on {args.targets}, "
          f"{args.steps} steps of {args.batch}x{args.seq} tokens, 2 emulated workers, "
          "2 microbatches, 2 torch threads\n")
    head = ("mode", "peak MiB", "devices", "host MiB", "x file", "pool", "copied",
            "registered", "pageable", "s/step")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        host = r["peak"] - r["devices"]
        print(f"| {r['mode']} | {r['peak'] / mib:.0f} | {r['devices'] / mib:.0f} | "
              f"{host / mib:.0f} | {host / size:.2f} | {r['buffers_peak'] / mib:.1f} | "
              f"{r['copied'] / mib:.0f} | {r['registered'] / mib:.0f} | "
              f"{r['pageable'] / mib:.0f} | {r['step_s']:.2f} |")
    losses = {r["mode"]: r["loss"] for r in rows}
    same = len(set(losses.values())) == 1
    print(f"\nlast loss per mode (must agree): {losses}: "
          f"{'equal' if same else 'DIFFERENT'}")
    for r in rows:
        print(f"{r['mode']}: at the end RSS growth {r['end'] / mib:.0f} MiB = file-backed "
              f"{r['file'] / mib:.0f} + anonymous {r['anon'] / mib:.0f} MiB; adapter "
              f"{r['adapter'] / 1e6:.2f} M parameters")
    for r in rows:
        if r["mode"] == "off":
            limit = 1.1 * size + r["buffers_peak"]
            host = r["peak"] - r["devices"]
            verdict = "OK" if host <= limit else "OVER"
            print(f"off: host growth {host / mib:.0f} MiB <= 1.1 x file + pool = "
                  f"{limit / mib:.0f} MiB: {verdict}")
    if not same:
        raise SystemExit(f"the pin modes trained differently: {losses}")


if __name__ == "__main__":
    main()
