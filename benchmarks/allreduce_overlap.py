"""How much of the data-parallel gradient all-reduce hides behind the backward.

Launches ``--ranks`` processes of itself (gloo on 127.0.0.1), each training the same
GPT-like model on its shard with ``--workers`` emulated workers. Per training call
rotapipe records (``pipe.data_parallel.last``):

- ``busy``: time at least one gradient bucket was in flight (all-reduce launched by a
  stage's optimizer hand-off on the host lane, until gloo completed it), and
- ``exposed``: time after the last backward finished during which a bucket was still in
  flight (what the caller waited for the all-reduce).

``hidden = 1 - sum(exposed) / sum(busy)`` over the measured calls of every rank. Part
of ``exposed`` is not all-reduce work but waiting for the slower rank to finish its
backward (the ranks share this machine's cores, so one is often behind): ``skew`` is
that part (the slowest rank's backward end minus this rank's, from
``ReduceStats.backward_done``), and ``hidden (net)`` counts only the wait after *every*
rank's backward ended. For scale, the same bytes are also all-reduced synchronously
after the run (``serial``: what a reduce-after-backward would add to every step). One
intra-op thread per process (``torch.set_num_threads(1)``).

``--optimizer sync,overlap`` measures each optimizer mode in turn in the same run (a
row each, ``train_step`` per step). ``--emulate qwen3-1.7b`` trains the timed-emulation
stand-in of that model on emulated RTX 4090s instead (:class:`rotapipe.sim.
TimedEmulation`, ``--dilation``): compute, copies and the host optimizer take their
modelled time (times ``--dilation``; the table is in real milliseconds), so the
optimizer's overlap with the backward shows in the step time (the all-reduce moves
the stand-in's small gradients over loopback).

    python benchmarks/allreduce_overlap.py
    python benchmarks/allreduce_overlap.py --dim 384 --layers 12 --steps 8
    python benchmarks/allreduce_overlap.py --emulate qwen3-1.7b --workers 4 \
        --microbatches 8 --optimizer sync,overlap --steps 3 --warmup 1
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import rotapipe
from rotapipe import distributed
from rotapipe.model.tiny import lm_loss, stride_batch, tiny_gpt
from rotapipe.runtime.emulation import TimedEmulation

from _ranks import launch_ranks       # the sibling helper (run from this folder)


def rank_main(args) -> None:
    torch.set_num_threads(1)
    info = distributed.init_from_env(timeout_s=120)
    em = None
    if args.emulate:
        em = TimedEmulation.of(args.emulate, "rtx4090x8", seq=args.emulate_seq,
                               dilation=args.dilation)
        args.vocab, args.seq = 32, 16           # the stand-in's shapes
    for mode in args.optimizer.split(","):
        measure(args, info, mode, em)
    distributed.shutdown()


def measure(args, info, mode: str, em) -> None:
    torch.manual_seed(0)
    model = em.stand_in() if em is not None else \
        tiny_gpt(vocab=args.vocab, dim=args.dim, layers=args.layers, heads=4, seq=args.seq)
    config = rotapipe.PipeConfig(workers=args.workers, microbatches=args.microbatches,
                                 backend="emulated", check_races=False, optimizer_mode=mode,
                                 emulation=em, data_parallel=rotapipe.DataParallelConfig(
                                     enabled=True, bucket_mb=args.bucket_mb))
    gen = torch.Generator().manual_seed(1)
    busy = exposed = net = skew = 0.0
    step_times = []
    with rotapipe.RoundPipe(model, lm_loss, config=config,
                            optimizer=lambda ps: torch.optim.AdamW(ps, fused=True)) as pipe:
        for step in range(args.warmup + args.steps):
            batch = stride_batch(args.batch * info.world_size, args.seq, args.vocab,
                                 generator=gen)
            x, y = distributed.shard_batch(batch)
            t0 = time.perf_counter()
            loss = pipe.train_step(x, y)
            if step >= args.warmup:
                step_times.append(time.perf_counter() - t0)
                last = pipe.data_parallel.last
                every: list = [None] * info.world_size
                dist.all_gather_object(every, (last.busy_s, last.exposed_s,
                                               last.backward_done))
                slowest = max(d for _, _, d in every)
                for b, e, d in every:
                    busy += b
                    exposed += e
                    skew += min(e, slowest - d)
                    net += max(0.0, e - (slowest - d))
        last = pipe.data_parallel.last
        params = sum(p.numel() for p in pipe.parameters())
        # The same bytes, reduced synchronously after the run (no overlap).
        flats = [torch.zeros(int(args.bucket_mb * 2**18)) for _ in
                 range(max(1, last.bytes // int(args.bucket_mb * 2**20)))]
        rest = last.bytes // 4 - sum(f.numel() for f in flats)
        if rest > 0:
            flats.append(torch.zeros(rest))
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            for f in flats:
                dist.all_reduce(f)
        serial = (time.perf_counter() - t0) / args.steps
        pipe.flush()
    if info.is_main:
        n = args.steps * info.world_size   # per rank and call
        what = f"{args.emulate} stand-in, timed (dilation {em.dilation:g}x)" if em \
            else f"{params / 1e6:.1f}M params"
        print(f"optimizer={mode}: ranks {info.world_size} x {args.workers} emulated "
              f"workers, model {what}, {last.buckets} buckets / "
              f"{last.bytes / 2**20:.1f} MiB per call, batch {args.batch}/rank x seq "
              f"{args.seq}, {args.microbatches} microbatches, torch threads 1/process")
        print(f"{'step (ms)':>10} {'busy (ms)':>10} {'exposed (ms)':>13} {'skew (ms)':>10} "
              f"{'serial (ms)':>12} {'hidden':>7} {'hidden (net)':>13}")
        print(f"{1e3 * sorted(step_times)[len(step_times) // 2]:>10.1f} "
              f"{1e3 * busy / n:>10.1f} {1e3 * exposed / n:>13.1f} {1e3 * skew / n:>10.1f} "
              f"{1e3 * serial:>12.1f} {1 - exposed / busy if busy else 1.0:>7.1%} "
              f"{1 - net / busy if busy else 1.0:>13.1%}   (last loss {loss:.3f})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="samples per rank")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--optimizer", default="sync",
                   help="optimizer modes to measure in turn, e.g. sync,overlap")
    p.add_argument("--emulate", default=None,
                   help="timed emulation of this model on RTX 4090s (e.g. qwen3-1.7b)")
    p.add_argument("--emulate-seq", type=int, default=2048)
    p.add_argument("--dilation", type=float, default=4.0)
    args = p.parse_args()
    if "RANK" in os.environ:
        rank_main(args)
        return
    launch_ranks(__file__, args.ranks)


if __name__ == "__main__":
    main()
