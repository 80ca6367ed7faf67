"""One rank of the data-parallel tests (run as a script by ``test_distributed.py``).

    python tests/dist_job.py OUT [--kill-at STEP | --hang-at STEP | --mismatch]
                                 [--timeout S] [--overlap] [--shard MODES]

Reads RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT like torchrun sets them (none: one
process). Trains ``tiny_transformer(dropout, tied)`` for ``STEPS`` steps on global
batches of ``GLOBAL`` samples, each rank on its shard, 2 emulated workers, five times:
without and with gradient clipping, with a token-mean loss whose ignored labels differ
per rank (``loss_weight`` counts the rest) over two accumulated calls per step, and with
``optimizer_mode="overlap"`` (``train_step``) without and with clipping. Saves ``{"plain":
..., "clip": ..., "tokens": ..., "overlap": ..., "overlap_clip": ...}`` (state_dict,
losses, all-reduce stats) to ``OUT``.

``--shard optimizer,gradients`` instead trains with ``DataParallelConfig(shard=...)``
(:func:`train_sharded`) for each shard mode, optimizer mode and clipping setting, and
saves ``{(shard, mode, clip): ...}``.

Faults: with ``--mismatch`` rank 1 builds a different model and every rank must fail at
construction (status 4); with ``--exit-before-pipe`` rank 1 exits before it builds its
pipeline and rank 0 fails at construction (status 3). With ``--kill-at S`` rank 1 dies (``os._exit``) inside its
tail stage at step ``S``; with ``--hang-at S`` it sleeps there instead (alive,
heartbeat running); either way it first writes the wall-clock time to ``OUT.fault``.
``--overlap`` runs that training with ``optimizer_mode="overlap"``.
The other ranks print the DistributedError (with ``at=<wall-clock time>``) and exit
with status 3.

``--leave-at S``: rank 1's loss raises at step ``S`` (its call fails, gradient buckets of
rank 0 stay in flight); rank 0 prints its DistributedError and exits through the
interpreter's normal shutdown (``sys.exit(3)``, not ``os._exit``), which it holds open
for 3 s; rank 1 exits (status 1) once rank 0's shutdown began, so that its sockets
close, failing rank 0's collectives still in flight, while rank 0 shuts down.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import rotapipe  # noqa: E402
from rotapipe import distributed  # noqa: E402
from models import emulated, lm_loss, tiny_transformer, token_batch  # noqa: E402

STEPS, GLOBAL, MICROBATCHES, CLIP = 3, 8, 2, 0.05


def optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-3)


def model(widths=(24, 40, 8, 32)):
    return tiny_transformer(dropout=0.1, tied=True, widths=widths)


def masked(labels, step):
    """Ignore a random ~40% of the label positions (-100), different in every row."""
    g = torch.Generator().manual_seed(100 + step)
    return labels.masked_fill(torch.rand(labels.shape, generator=g) < 0.4, -100)


def token_loss(out, labels):
    return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]),
                                             labels.reshape(-1), ignore_index=-100)


def train(info, clip: float | None, microbatches: int, fault: tuple[str, int] | None,
          timeout: float, tokens: bool = False, fault_file: str | None = None,
          widths=(24, 40, 8, 32), overlap: bool = False):
    """``overlap``: ``optimizer_mode="overlap"`` with ``clip_grad_norm=clip``, one
    ``train_step`` per step (the reference runs ``sync``)."""
    calls = {"n": 0}

    def loss_fn(out, labels):
        if fault is not None and info.rank == 1 and calls["n"] == fault[1]:
            with open(fault_file, "w") as f:    # when the fault began (wall clock)
                f.write(repr(time.time()))
            if fault[0] == "kill":
                os._exit(1)   # dies mid-step, in a worker thread, collectives in flight
            if fault[0] == "raise":
                raise ValueError("boom on rank 1")    # the call fails, the rank lives on
            time.sleep(3600)
        return token_loss(out, labels) if tokens else lm_loss(out, labels)

    mode = dict(optimizer_mode="overlap", clip_grad_norm=clip) if overlap else {}
    config = emulated(2, microbatches, data_parallel=rotapipe.DataParallelConfig(
        timeout_s=timeout, heartbeat_s=0.25), **mode)
    losses = []
    weight = (lambda y: float((y != -100).sum())) if tokens else None
    with rotapipe.RoundPipe(model(widths), loss_fn, config=config, optimizer=optimizer,
                            loss_weight=weight) as pipe:
        for step in range(STEPS):
            calls["n"] = step
            # tokens: two accumulated calls per step (token counts differ per call too).
            for seed in (10 + step, 50 + step) if tokens else (10 + step,):
                x, y = token_batch(GLOBAL, seed=seed)
                if tokens:
                    y = masked(y, seed)
                x, y = distributed.shard_batch((x, y), info.rank, info.world_size)
                if overlap:
                    losses.append(pipe.train_step(x, y))
                    continue
                losses.append(pipe.forward_backward(x, y))
            if overlap:
                continue
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(pipe.parameters(), clip)
            pipe.step()
        state = {k: v.clone() for k, v in pipe.state_dict().items()}
        stats = pipe.data_parallel.last if pipe.data_parallel is not None else None
    return {"state": state, "losses": losses, "stats": stats}


SHARD_GLOBAL, SHARD_MODES, SHARD_CLIPS = 12, ("sync", "overlap", "stale"), (None, CLIP)


def train_sharded(info, shard: str, mode: str, clip: float | None, microbatches: int,
                  timeout: float = 20.0, grad_dtype: str = "float32", fault=None,
                  fault_file: str | None = None):
    """3 steps of two calls each (token-mean loss, ignored labels differing per rank),
    ``SHARD_GLOBAL`` samples per call: ``sync`` accumulates with two
    ``forward_backward`` and calls ``step()``, ``overlap`` / ``stale`` end each step
    with ``train_step``. ``shard=None``: no data parallelism (the reference)."""
    calls = {"n": 0}

    def loss_fn(out, labels):
        if fault is not None and info.rank == 1 and calls["n"] == fault[1]:
            with open(fault_file, "w") as f:
                f.write(repr(time.time()))
            os._exit(1)
        return token_loss(out, labels)

    dp = False if shard is None else rotapipe.DataParallelConfig(
        timeout_s=timeout, heartbeat_s=0.25, shard=shard, grad_dtype=grad_dtype)
    config = emulated(2, microbatches, data_parallel=dp, optimizer_mode=mode,
                      clip_grad_norm=clip)
    losses, norms = [], []
    with rotapipe.RoundPipe(model(), loss_fn, config=config, optimizer=optimizer,
                            loss_weight=lambda y: float((y != -100).sum())) as pipe:
        for step in range(STEPS):
            calls["n"] = step
            for k, seed in enumerate((10 + step, 50 + step)):
                x, y = token_batch(SHARD_GLOBAL, seed=seed)
                y = masked(y, seed)
                x, y = distributed.shard_batch((x, y), info.rank, info.world_size)
                last = k == 1
                if last and mode != "sync":
                    losses.append(pipe.train_step(x, y))
                else:
                    losses.append(pipe.forward_backward(x, y))
            if mode == "sync":
                pipe.step()
            norms.append(pipe.last_grad_norm)
        state = {k: v.detach().float().clone() for k, v in pipe.state_dict().items()}
        traffic = pipe._shard.traffic if pipe._shard is not None else None
    return {"state": state, "losses": losses, "norms": norms, "traffic": traffic}


def reshard_phase(info, phase: int, root: str, timeout: float = 20.0):
    """Step ``phase`` of a run that changes world size between steps: resume from the
    shards of phase ``phase - 1`` (any world size), take one step (two accumulated
    calls, no dropout: the result does not depend on how the batch is cut), write this
    rank's shard to ``root/phase<phase>``, and (rank 0) the consolidated masters.
    ``root=""``: no checkpoints (the uninterrupted reference, all phases in a row)."""
    import pathlib
    from rotapipe.train.checkpoint import load_shards, save_consolidated, save_shard
    dp = rotapipe.DataParallelConfig(timeout_s=timeout, heartbeat_s=0.25, shard="gradients") \
        if info.distributed else False
    config = emulated(2, MICROBATCHES, data_parallel=dp)
    pipe = rotapipe.RoundPipe(tiny_transformer(dropout=0.0, tied=True), token_loss,
                              config=config, optimizer=optimizer,
                              loss_weight=lambda y: float((y != -100).sum()))
    with pipe:
        phases = range(phase, phase + 1) if root else range(phase)
        if root and phase > 0:
            distributed.load_shard_state_dicts(
                pipe, pipe.optimizer, load_shards(pathlib.Path(root) / f"phase{phase - 1}"))
        for step in phases:
            for seed in (10 + step, 50 + step):
                x, y = token_batch(SHARD_GLOBAL, seed=seed)
                y = masked(y, seed)
                pipe.forward_backward(*distributed.shard_batch((x, y), info.rank,
                                                               info.world_size))
            pipe.step()
        if root:
            out = pathlib.Path(root) / f"phase{phase}"
            save_shard(out, distributed.shard_state_dict(pipe, pipe.optimizer))
            with distributed.full_weights(pipe):      # every rank: the whole fp32 masters
                torch.save({k: v.clone() for k, v in pipe.state_dict().items()},
                           pathlib.Path(root) / f"full-phase{phase}-rank{info.rank}.pt")
            distributed.barrier()
            if info.is_main:
                save_consolidated(out)
        return {k: v.detach().float().clone() for k, v in pipe.state_dict().items()}


_MARK = None     # --leave-at, rank 0: freed (and written) by the interpreter's shutdown


class _ShutdownMark:
    """Writes ``path`` once the interpreter's shutdown frees it (a module global), then
    holds that shutdown open for ``hold`` seconds (what freeing a large model does)."""

    def __init__(self, path: str, hold: float):
        self.path, self.hold = path, hold

    def __del__(self, open=open, sleep=time.sleep):   # the modules may be gone by then
        with open(self.path, "w") as f:
            f.write("shutting down")
        sleep(self.hold)


def leave(info, step: int, out: str, timeout: float) -> int:
    """``--leave-at``: see the module docstring."""
    global _MARK
    mark = out.replace(f"rank{info.rank}", "rank0") + ".shutdown"     # rank 0's
    try:
        train(info, None, MICROBATCHES, ("raise", step), timeout, fault_file=out + ".fault")
    except rotapipe.DistributedError as exc:
        print(f"rank {info.rank}: DistributedError lost_ranks={list(exc.lost_ranks)}",
              file=sys.stderr, flush=True)
        _MARK = _ShutdownMark(mark, 3.0)
        sys.exit(3)
    except rotapipe.WorkerError as exc:
        print(f"rank {info.rank}: {type(exc).__name__}", file=sys.stderr, flush=True)
        end = time.monotonic() + 60
        while not os.path.exists(mark) and time.monotonic() < end:
            time.sleep(0.01)
        os._exit(1)
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--hang-at", type=int, default=None)
    p.add_argument("--leave-at", type=int, default=None,
                   help="rank 1's loss raises at that step; it exits during rank 0's "
                        "interpreter shutdown")
    p.add_argument("--raise-at", type=int, default=None,
                   help="rank 1's loss raises at that step; the process then waits")
    p.add_argument("--timeout", type=float, default=20.0)
    p.add_argument("--overlap", action="store_true",
                   help='the faulty run uses optimizer_mode="overlap" (train_step)')
    p.add_argument("--shard", default=None,
                   help="comma-separated shard modes: run train_sharded for each")
    p.add_argument("--grad-dtype", default="float32")
    p.add_argument("--reshard", nargs=2, metavar=("PHASE", "ROOT"), default=None,
                   help="run reshard_phase(PHASE, ROOT)")
    p.add_argument("--mismatch", action="store_true",
                   help="rank 1 builds a different model (construction must fail)")
    p.add_argument("--exit-before-pipe", action="store_true",
                   help="rank 1 exits before it builds its pipeline")
    args = p.parse_args()
    # A native abort (SIGABRT, e.g. "terminate called without an active exception")
    # prints every thread's Python stack to stderr, which the test shows.
    faulthandler.enable(all_threads=True)
    torch.set_num_threads(1)
    info = distributed.init_from_env(timeout_s=args.timeout)
    # One process runs the whole batch with the microbatches of every rank.
    mbs = MICROBATCHES if info.distributed else 2 * MICROBATCHES
    fault = ("kill", args.kill_at) if args.kill_at is not None else \
        ("hang", args.hang_at) if args.hang_at is not None else \
        ("raise", args.raise_at) if args.raise_at is not None else None
    t0 = time.monotonic()
    if args.leave_at is not None:
        return leave(info, args.leave_at, args.out, args.timeout)
    if args.exit_before_pipe and info.rank == 1:
        os._exit(1)
    if args.mismatch:
        try:
            train(info, None, mbs, None, args.timeout,
                  widths=(24, 40, 8, 33) if info.rank == 1 else (24, 40, 8, 32))
        except rotapipe.ConfigError as exc:
            print(f"rank {info.rank}: ConfigError: {exc}", file=sys.stderr, flush=True)
            return 4
        return 0
    if args.reshard:
        torch.save(reshard_phase(info, int(args.reshard[0]), args.reshard[1], args.timeout),
                   args.out)
        distributed.shutdown()
        return 0
    if args.shard:
        result = {}
        try:
            for shard in args.shard.split(","):
                for mode in SHARD_MODES:
                    for clip in SHARD_CLIPS:
                        result[(shard, mode, clip)] = train_sharded(
                            info, shard, mode, clip, MICROBATCHES, args.timeout,
                            args.grad_dtype, fault, args.out + ".fault")
        except rotapipe.DistributedError as exc:
            print(f"rank {info.rank}: DistributedError at={time.time()!r} after "
                  f"{time.monotonic() - t0:.1f} s, lost_ranks={list(exc.lost_ranks)}: "
                  f"{exc}", file=sys.stderr, flush=True)
            os._exit(3)
        torch.save(result, args.out)
        distributed.shutdown()
        return 0
    try:
        result = {"plain": train(info, None, mbs, fault, args.timeout,
                                 fault_file=args.out + ".fault", overlap=args.overlap)}
        if fault is None:
            result["clip"] = train(info, CLIP, mbs, None, args.timeout)
            result["tokens"] = train(info, None, mbs, None, args.timeout, tokens=True)
            # Overlapped steps on the reduced gradients; with clipping (every step
            # clips at CLIP) the first step is redone whole after the call, and the
            # later ones are taken whole (overlap stops speculating while it clips).
            result["overlap"] = train(info, None, mbs, None, args.timeout, overlap=True)
            result["overlap_clip"] = train(info, CLIP, mbs, None, args.timeout,
                                           overlap=True)
            result["any_rank"] = (distributed.any_rank(info.rank == 1),
                                  distributed.any_rank(False))
    except rotapipe.DistributedError as exc:
        print(f"rank {info.rank}: DistributedError at={time.time()!r} after "
              f"{time.monotonic() - t0:.1f} s, "
              f"lost_ranks={list(exc.lost_ranks)}: {exc}", file=sys.stderr, flush=True)
        os._exit(3)   # the group is broken: do not wait for its teardown
    except rotapipe.WorkerError as exc:
        if fault is None or fault[0] != "raise":
            raise
        print(f"rank {info.rank}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        time.sleep(3600)   # alive, heartbeat stopped with its pipeline: the test kills it
    torch.save(result, args.out)
    distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
