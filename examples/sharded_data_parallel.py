"""Data parallelism with the host optimizer state sharded across ranks (ZeRO 1/2).

Runs 2 ranks of itself on this machine (gloo on 127.0.0.1; on real servers launch
the same script with torchrun, one process per server), each with 2 emulated workers:

1. trains a small GPT for a few steps with ``DataParallelConfig(shard="gradients")``:
   each rank holds the fp32 masters and AdamW state of half of every parameter;
2. writes a checkpoint: one shard file per rank plus the consolidated fp32 masters;
3. resumes that checkpoint in one process without data parallelism (the shards are
   cut again for the new world size) and trains one more step.

    python examples/sharded_data_parallel.py [--shard optimizer] [--grad-dtype bfloat16]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import socket
import subprocess
import sys
import tempfile

import torch

import rotapipe
from rotapipe import distributed
from rotapipe.model.tiny import lm_loss, stride_batch, tiny_gpt
from rotapipe.train.checkpoint import load_shards, save_consolidated, save_shard

VOCAB, SEQ, GLOBAL = 64, 16, 8


def model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return tiny_gpt(vocab=VOCAB, dim=64, layers=4, seq=SEQ)


def build(shard: str | None, grad_dtype: str) -> rotapipe.RoundPipe:
    dp = rotapipe.DataParallelConfig(shard=shard, grad_dtype=grad_dtype) if shard \
        else False
    config = rotapipe.PipeConfig(workers=2, microbatches=2, backend="emulated",
                                 data_parallel=dp, clip_grad_norm=1.0)
    return rotapipe.RoundPipe(model(), lm_loss, config=config,
                              optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-3))


def batch(step: int):
    return stride_batch(GLOBAL, SEQ, VOCAB, generator=torch.Generator().manual_seed(step))


def rank_main(args) -> None:
    info = distributed.init_from_env(timeout_s=120)
    with build(args.shard, args.grad_dtype) as pipe:
        held = sum(q.numel() for q in pipe.parameters())
        total = sum(p.numel() for p in model().parameters())   # the whole model
        for step in range(args.steps):
            x, y = distributed.shard_batch(batch(step))
            loss = pipe.train_step(x, y)
            if info.is_main:
                print(f"step {step}: loss {loss:.4f} (global mean), grad norm "
                      f"{pipe.last_grad_norm:.3f}")
        traffic = pipe._shard.traffic             # internal counters, not public API
        print(f"rank {info.rank}: steps {held:,} of {total:,} fp32 master elements "
              f"({held / total:.0%}); sent {traffic.scatter_bytes / 2**20:.2f} MiB of "
              f"gradients, {traffic.gather_bytes / 2**20:.2f} MiB of weights")
        out = pathlib.Path(args.ckpt)
        save_shard(out, distributed.shard_state_dict(pipe, pipe.optimizer))
        distributed.barrier()                     # every shard is written
        if info.is_main:
            print(f"checkpoint: {sorted(p.name for p in out.iterdir())}")
            save_consolidated(out)
    distributed.shutdown()


def resume(args) -> None:
    """One process, no data parallelism: the 2 ranks' shards become whole tensors."""
    with build(None, "float32") as pipe:
        distributed.load_shard_state_dicts(pipe, pipe.optimizer,
                                           load_shards(pathlib.Path(args.ckpt)))
        loss = pipe.train_step(*batch(args.steps))
        print(f"resumed on 1 process: step {args.steps}: loss {loss:.4f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shard", default="gradients", choices=("optimizer", "gradients"))
    p.add_argument("--grad-dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--ckpt", default=None)
    args = p.parse_args()
    if "RANK" in os.environ:
        rank_main(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        args.ckpt = str(pathlib.Path(tmp) / "step-4")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        argv = [a for a in sys.argv[1:]] + ["--ckpt", args.ckpt]
        procs = [subprocess.Popen([sys.executable, __file__, *argv],
                                  env=dict(os.environ, RANK=str(r), WORLD_SIZE="2",
                                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
                 for r in range(2)]
        if max(p.wait() for p in procs):
            sys.exit(1)
        resume(args)


if __name__ == "__main__":
    main()
