"""The planner's host-memory prediction against a real run's resident set growth.

A random Qwen3-architecture model is built (fp32 parameters: they become the masters),
wrapped, and trained for 2 steps with AdamW on emulated CPU workers in bf16 compute.
The peak RSS growth over the process baseline (after imports and a warm-up run of a
tiny model through the same code, which loads what is loaded lazily, before the model) is
compared with :func:`rotapipe.plan.hostmem.host_memory` for the pipeline's plan plus
the emulated devices' peak memory (on emulated workers device buffers are host RAM),
with one call per step (``staged_grads=False``: what the run does). It runs with
``MALLOC_MMAP_THRESHOLD_=65536`` (it re-executes itself with it), so that freed tensors
go back to the OS: glibc's default raises its mmap threshold up to 32 MB as large
blocks are freed, and then keeps freed tensors below that size in its heap, which RSS
counts. ``benchmarks/host_memory_diet.py`` is the careful version (a warm-up run first,
device memory subtracted as measured, per term).

    python benchmarks/planner_host_memory.py [--layers 6 --hidden 1024]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch

from rss import Sampler, rss


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--json", action="store_true", help="also print the numbers as JSON")
    args = p.parse_args()
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:      # see the module docstring
        os.execve(sys.executable, [sys.executable, *sys.argv],
                  {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
    torch.set_num_threads(2)
    import transformers

    import rotapipe
    import rotapipe.adapters
    from rotapipe.plan import hardware, model_costs
    from rotapipe.plan.hostmem import host_memory

    cfg = dict(model_type="qwen3", vocab_size=args.vocab, hidden_size=args.hidden,
               intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
               num_attention_heads=args.hidden // 64,
               num_key_value_heads=max(1, args.hidden // 256), head_dim=64,
               tie_word_embeddings=False)

    def run(cfg, vocab):
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**cfg))
        wrapped = rotapipe.adapters.wrap_hf(model)
        pc = rotapipe.PipeConfig(workers=args.workers, microbatches=args.microbatches,
                                 backend="emulated",
                                 precision=rotapipe.PrecisionConfig("bf16"))
        pipe = wrapped.pipe(pc)
        pipe.attach_optimizer(torch.optim.AdamW(pipe.parameters(), lr=1e-4))
        ids = torch.randint(0, vocab, (args.batch, args.seq))
        for _ in range(2):
            pipe.forward_backward(wrapped.inputs(ids), ids)
            pipe.step()
        return pipe

    tiny = dict(cfg, vocab_size=512, hidden_size=128, intermediate_size=384,
                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
    run(tiny, 512).close()
    gc.collect()
    base = rss()
    with Sampler() as s:
        torch.manual_seed(0)
        pipe = run(cfg, args.vocab)
    measured = s.peak - base
    costs = model_costs(cfg, hardware("rtx4090"), seq=args.seq,
                        microbatch_size=args.batch // args.microbatches)
    host = host_memory(costs, pipe.plan, args.microbatches, args.workers,
                       staged_grads=False)
    devices = sum(pipe.peak_memory())
    predicted = host.total + devices
    params = sum(q.numel() for q in pipe.parameters())
    print(f"random Qwen3, {args.layers} blocks of hidden {args.hidden}, vocab {args.vocab} "
          f"({params / 1e9:.2f}B parameters, fp32 masters); bf16 compute, "
          f"{args.workers} emulated workers, {args.microbatches} microbatches of "
          f"{args.batch // args.microbatches} x {args.seq} tokens, AdamW, 2 steps of one "
          f"call; torch threads {torch.get_num_threads()}; plan {pipe.plan.to_text()}")
    print(f"{'term':18s} {'GB':>8s}")
    for name, value in host.as_dict().items():
        if value and name != "total":
            print(f"{name:18s} {value / 1e9:8.3f}")
    print(f"{'emulated devices':18s} {devices / 1e9:8.3f}")
    print(f"{'predicted':18s} {predicted / 1e9:8.3f}")
    print(f"{'measured (RSS)':18s} {measured / 1e9:8.3f}   "
          f"prediction {predicted / measured - 1:+.1%}")
    if args.json:
        print(json.dumps(dict(measured=measured, predicted=predicted, host=host.as_dict(),
                              devices=devices, plan=pipe.plan.to_text(),
                              error=predicted / measured - 1)))
    pipe.close()


if __name__ == "__main__":
    main()
