"""Host bytes per rank and bytes sent per step, for each data-parallel shard mode.

Launches ``--ranks`` processes of itself (gloo on 127.0.0.1), each training the same
GPT-like model on its shard of the global batch with one emulated worker, for each
mode in turn (a row each, same data, same initial weights):

- ``none``: full fp32 masters, AdamW state and gradients on every rank; gradients
  all-reduced after every call,
- ``optimizer`` / ``gradients`` (``DataParallelConfig(shard=...)``), and the same with
  ``grad_dtype=bfloat16``.

Columns (per rank, rank 0 shown; every rank holds the same amounts up to one element
per parameter):

- ``masters+opt (MiB)``: bytes of the fp32 tensors the optimizer steps plus its state
  (AdamW's two moments; the step counters are scalars), summed over the tensors'
  storages after the run, and ``vs none``, its ratio to the unsharded run;
- ``grads (MiB)``: fp32 gradient bytes the rank holds between the two accumulated calls
  of a step (``none``: ``param.grad``; ``optimizer``: the full local sum; ``gradients``:
  its pieces);
- ``sent/step (MiB)``: bytes this rank sends per optimizer step. Sharded modes: counted
  from the all-to-alls rotapipe issues (every chunk but the rank's own). ``none``: the
  all-reduced bytes per call times ``2 (W - 1) / W`` (what a ring all-reduce sends;
  gloo picks its own algorithm, so this is a model, not a count);
- ``step (ms)``: median wall time of a step (two calls) on this shared CPU;
- ``loss``: the mean loss of the last step; ``|d loss|``: the largest difference from
  the fp32 run of the same mode over every step (the bf16 gradients' effect).

One intra-op thread per process. ``--accum`` calls per step (``forward_backward``, then
``train_step``).

    python benchmarks/shard_memory.py --ranks 2
    python benchmarks/shard_memory.py --ranks 3 --steps 20
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import rotapipe
from rotapipe import distributed
from rotapipe.model.tiny import lm_loss, stride_batch, tiny_gpt

from _ranks import launch_ranks       # the sibling helper (run from this folder)

MODES = (("none", "float32"), ("optimizer", "float32"), ("gradients", "float32"),
         ("optimizer", "bfloat16"), ("gradients", "bfloat16"))


def _bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def measure(args, info, shard: str, grad_dtype: str) -> dict:
    torch.manual_seed(0)
    model = tiny_gpt(vocab=args.vocab, dim=args.dim, layers=args.layers, heads=4,
                     seq=args.seq)
    dp = rotapipe.DataParallelConfig(enabled=True, bucket_mb=args.bucket_mb, shard=shard,
                                     grad_dtype=grad_dtype)
    config = rotapipe.PipeConfig(workers=1, microbatches=args.microbatches,
                                 backend="emulated", check_races=False, data_parallel=dp)
    gen = torch.Generator().manual_seed(1)
    losses, times, grads, reduced = [], [], 0, 0
    with rotapipe.RoundPipe(model, lm_loss, config=config,
                            optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-3)) as pipe:
        for step in range(args.warmup + args.steps):
            if step == args.warmup and pipe._shard is not None:
                pipe._shard.reset_traffic()
            t0 = time.perf_counter()
            for call in range(args.accum):
                x, y = distributed.shard_batch(stride_batch(
                    args.batch * info.world_size, args.seq, args.vocab, generator=gen))
                if call < args.accum - 1:
                    pipe.forward_backward(x, y)
                    if call == 0:
                        grads = _grad_bytes(pipe)
                    if pipe.data_parallel.last is not None:
                        reduced = pipe.data_parallel.last.bytes
                else:
                    loss = pipe.train_step(x, y)
            if step >= args.warmup:
                times.append(time.perf_counter() - t0)
            losses.append(loss)
        state = [v for s in pipe.optimizer.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor) and v.dim() > 0]
        held = _bytes(list(pipe.parameters()) + state)
        W = info.world_size
        if pipe._shard is not None:
            sent = pipe._shard.traffic.total / args.steps
        else:
            sent = args.accum * reduced * 2 * (W - 1) / W
    return {"held": held, "grads": grads, "sent": sent, "loss": losses[-1],
            "losses": losses, "step": sorted(times)[len(times) // 2]}


def _grad_bytes(pipe) -> int:
    if pipe._shard is None:
        return _bytes([p.grad for p in pipe.parameters() if p.grad is not None])
    s = pipe._shard
    return _bytes([q.grad for q in s.masters.values() if q.grad is not None]
                  + list(s.local.values()))


def rank_main(args) -> None:
    torch.set_num_threads(1)
    info = distributed.init_from_env(timeout_s=300)
    rows = {(shard, dt): measure(args, info, shard, dt) for shard, dt in MODES}
    distributed.shutdown()
    if not info.is_main:
        return
    params = sum(p.numel() for p in tiny_gpt(vocab=args.vocab, dim=args.dim,
                                             layers=args.layers, heads=4,
                                             seq=args.seq).parameters())
    print(f"{info.world_size} ranks x 1 emulated worker, {params / 1e6:.2f}M params "
          f"(tiny_gpt dim {args.dim}, {args.layers} layers), AdamW, {args.accum} calls "
          f"per step, batch {args.batch}/rank/call, {args.steps} steps after "
          f"{args.warmup} warm-up, torch threads 1/process")
    print(f"{'shard':>10} {'grads in':>9} {'masters+opt (MiB)':>18} {'vs none':>8} "
          f"{'grads (MiB)':>12} {'sent/step (MiB)':>16} {'vs none':>8} {'step (ms)':>10} "
          f"{'loss':>8} {'|d loss|':>9}")
    base = rows[("none", "float32")]
    for (shard, dt), r in rows.items():
        ref = rows[(shard, "float32")] if shard != "none" else r
        dl = max(abs(a - b) for a, b in zip(r["losses"], ref["losses"]))
        print(f"{shard:>10} {dt:>9} {r['held'] / 2**20:>18.2f} "
              f"{r['held'] / base['held']:>8.3f} {r['grads'] / 2**20:>12.2f} "
              f"{r['sent'] / 2**20:>16.2f} {r['sent'] / base['sent']:>8.3f} "
              f"{1e3 * r['step']:>10.1f} {r['loss']:>8.4f} {dl:>9.2e}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=4, help="samples per rank per call")
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--accum", type=int, default=2, help="calls per optimizer step")
    p.add_argument("--bucket-mb", type=float, default=4.0)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=1)
    args = p.parse_args()
    if "RANK" in os.environ:
        rank_main(args)
        return
    launch_ranks(__file__, args.ranks)


if __name__ == "__main__":
    main()
