"""Host-side issue overhead of the real executor, on a backend that does no work.

A *null backend* (``NullDevice`` below, kept here rather than in the library) has
streams that run every action body inline on the dispatcher thread, as the CUDA backend
does, and events that are complete the moment they are recorded; uploads and downloads
return their tensor and allocations are only counted. The real
``rotapipe.runtime.executor.Executor`` walks the RoundPipe schedule of one training
call with a no-op body, so what is measured is the executor's own cost: its threads,
dependency waits, event records and submits. On CUDA that cost is paid on the host
while the GPUs run; it is hidden as long as it is a small fraction of the step.

Settings: the Qwen3-1.7B, Llama-3.1-8B and Qwen3-32B shapes at sequence 2048, one
sequence per microbatch, 16 microbatches, 8 workers, with the plan the planner picks
for 8x RTX 4090 (22.5 GiB usable each; as ``benchmarks/timed_emulation.py``). The
simulated step time is the simulator's makespan of the same schedule on that hardware.

Columns:

- ``actions``: actions in one call's schedule; ``threads``: dispatcher threads that
  issued them (threads whose body ran an action), ``/dev``: of those, per device;
  ``alive``: the most Python threads alive at once during a call (sampled in the body);
- ``issue ms``: host seconds for one call (median of ``--repeats`` after a warm-up),
  ``k act/s``: actions issued per second;
- ``sim ms``: the simulated GPU step; ``issue/sim``: the fraction of the step the host
  spends issuing (goal: under 5%);
- chunked copies: weight uploads (``UW``) and weight-gradient downloads (``DW``) move in
  chunks of at most ``--chunk-mb`` MiB that never span two layers, one executor issue
  per chunk. ``+chunks`` is the number of issues that adds per call; ``chunked ms``
  is measured with them (``Executor.run(..., chunks=)``, gated as by default).

    python benchmarks/issue_overhead.py
    python benchmarks/issue_overhead.py --models qwen3-32b --repeats 9 --side-inputs

Torch threads are set to 1 (the body does no tensor work); the machine's core count
matters, since every dispatcher thread competes for the GIL.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import threading
import time
from contextlib import nullcontext

import torch

import rotapipe
from rotapipe.runtime.backend import Device, HostStream
from rotapipe.runtime.executor import Chunk, Executor
from rotapipe.schedule import HOST, ActionKind as K, Lane
from rotapipe.runtime.emulation import TimedEmulation
from rotapipe.sim import ActionTimes, run as simulate
from timed_emulation import DEVICES, planned

MIB = 2**20


# -- the null backend ------------------------------------------------------------------

class NullStream(HostStream):
    """Runs each submitted body now, on the calling (dispatcher) thread, like CUDA's
    ``submit`` (the host lane's stream); waits are free and every event is complete
    when recorded."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def wait(self, event):
        return None


class NullDevice(Device):
    """A worker that does no work: copies return their tensor, memory is only counted."""

    def __init__(self, index: int):
        self.index = index
        self.torch_device = torch.device("cpu")
        self.budget = None
        self._streams = {lane: NullStream(f"null{index}.{lane.value}")
                         for lane in Lane if lane is not Lane.HOST}
        self._lock = threading.Lock()
        self.used = self.peak = 0

    def stream(self, lane):
        return self._streams[lane]

    def upload(self, host, dtype=None):
        return host if dtype is None else host.to(dtype)

    def download(self, dev):
        return dev

    def empty(self, shape, dtype):
        return torch.empty(shape, dtype=dtype)

    def empty_host(self, shape, dtype):
        return torch.empty(shape, dtype=dtype)

    def seeded(self, seed):
        return nullcontext()

    def drain(self, timeout=None):
        return True

    def allocate(self, nbytes, what):
        with self._lock:
            self.used += nbytes
            self.peak = max(self.peak, self.used)

    def free(self, nbytes):
        with self._lock:
            self.used -= nbytes


# -- chunked copies --------------------------------------------------------------------

def chunk_counts(schedule, costs, chunk_bytes: int) -> dict[str, int]:
    """Chunks of each ``UW``/``DW`` action: per layer of its stage, ceil(bytes / chunk)
    (a chunk never spans two layers; weight gradients are as large as the weights)."""
    stages = {s.name: s for s in schedule.plan.jobs()}
    out = {}
    for a in schedule.actions:
        if a.kind in (K.UPLOAD_WEIGHTS, K.DOWNLOAD_WGRAD):
            s = stages[a.stage]
            out[a.key] = sum(max(1, math.ceil(costs.layers[l].weight_bytes / chunk_bytes))
                             for l in range(s.start, s.stop))
    return out


def chunk_lists(counts: dict[str, int], body):
    """``Executor.run``'s ``chunks=``: ``counts[key]`` no-op chunks per chunked copy,
    each calling ``body(action, index)`` (one executor issue per chunk)."""
    def chunks(a):
        n = counts.get(a.key)
        return None if n is None else [Chunk(lambda a=a, i=i: body(a, i)) for i in range(n)]
    return chunks


# -- measuring -------------------------------------------------------------------------

def one_call(executor, schedule, body, chunks=None) -> float:
    kw = {} if chunks is None else {"chunks": chunk_lists(chunks, body)}
    t0 = time.perf_counter()
    executor.run(schedule, body, **kw)
    return time.perf_counter() - t0


def timed(executor, schedule, repeats: int, chunks=None) -> tuple[float, int]:
    """Median seconds of one call after a warm-up, and body calls per call."""
    calls = [0]

    def body(action, *chunk):       # the no-op body (one call per chunk, if chunked)
        calls[0] += 1

    one_call(executor, schedule, body, chunks)          # warm-up
    calls[0] = 0
    times = [one_call(executor, schedule, body, chunks) for _ in range(repeats)]
    return statistics.median(times), calls[0] // repeats


def census(executor, schedule) -> tuple[dict[int, set[str]], int]:
    """Which threads issued each worker's actions, and the most threads alive at once
    (``threading.active_count`` sampled every 16th action, in an untimed call)."""
    issuers: dict[int, set[str]] = {}
    peak, n = [threading.active_count()], [0]
    lock = threading.Lock()

    def body(action, *chunk):
        name = threading.current_thread().name
        with lock:
            issuers.setdefault(action.worker, set()).add(name)
            n[0] += 1
            if n[0] % 16 == 0:
                peak[0] = max(peak[0], threading.active_count())

    executor.run(schedule, body)
    return issuers, peak[0]


def plan_summary(plan) -> str:
    tail = f"{plan.tail}" + (f" x{plan.tail_jobs} jobs" if plan.tail_jobs > 1 else "")
    return (f"{len(plan.forward)} forward stages, tail {tail}, {len(plan.backward)} "
            f"backward stages, {plan.num_layers} layers")


def bench(model: str, args) -> dict:
    M = args.microbatches
    # The embedding moves by the call's rows, as in timed_emulation.py.
    em = TimedEmulation.of(model, "rtx4090x8", seq=args.seq, call_tokens=args.seq * M)
    choice = planned(em.costs, M)
    schedule = rotapipe.roundpipe_schedule(choice.plan, DEVICES, M,
                                           side_inputs=args.side_inputs)
    sim_ms = simulate(schedule, ActionTimes(choice.plan, choice.costs)).makespan
    executor = Executor([NullDevice(i) for i in range(DEVICES)])
    issue_s, _ = timed(executor, schedule, args.repeats)
    issuers, alive = census(executor, schedule)
    chunks = chunk_counts(schedule, choice.costs, int(args.chunk_mb * MIB))
    extra = sum(chunks.values()) - len(chunks)
    chunked_s, body_calls = timed(executor, schedule, args.repeats, chunks)
    assert body_calls == len(schedule.actions) + extra, (body_calls, extra)
    workers = [w for w in issuers if w != HOST]
    return dict(model=model, actions=len(schedule.actions),
                threads=len(set().union(*issuers.values())),
                per_dev=max(len(issuers[w]) for w in workers), alive=alive,
                issue_ms=issue_s * 1e3, rate=len(schedule.actions) / issue_s,
                sim_ms=sim_ms, ratio=issue_s * 1e3 / sim_ms, copies=len(chunks),
                extra=extra, chunked_ms=chunked_s * 1e3,
                chunked_ratio=chunked_s * 1e3 / sim_ms,
                plan=plan_summary(choice.plan), grain=choice.grain.value)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen3-1.7b,llama-3.1-8b,qwen3-32b")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--microbatches", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per model")
    ap.add_argument("--chunk-mb", type=float, default=32.0,
                    help="chunk size of weight uploads and weight-gradient downloads")
    ap.add_argument("--side-inputs", action="store_true",
                    help="schedule with per-microbatch side-input uploads (UZ), as a "
                         "Hugging Face model has")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"null backend, {DEVICES} workers, {args.microbatches} microbatches, seq "
          f"{args.seq}, plan for {DEVICES}x RTX 4090; {os.cpu_count()} CPUs, torch threads "
          f"1; chunks of {args.chunk_mb:g} MiB")
    rows = [bench(m.strip(), args) for m in args.models.split(",")]
    print(f"\n{'model':13s} {'actions':>7s} {'threads':>7s} {'/dev':>4s} {'alive':>5s} "
          f"{'issue ms':>8s} {'k act/s':>7s} {'sim ms':>8s} {'issue/sim':>9s} | "
          f"{'UW+DW':>5s} {'+chunks':>7s} {'chunked ms':>10s} {'/sim':>6s}")
    for r in rows:
        print(f"{r['model']:13s} {r['actions']:7d} {r['threads']:7d} {r['per_dev']:4d} "
              f"{r['alive']:5d} {r['issue_ms']:8.1f} {r['rate'] / 1e3:7.1f} "
              f"{r['sim_ms']:8.1f} {r['ratio']:9.2%} | {r['copies']:5d} {r['extra']:7d} "
              f"{r['chunked_ms']:10.1f} {r['chunked_ratio']:6.2%}")
    print("\nthreads: dispatcher threads that issued actions (host lane included); /dev: "
          "the most on one device; alive: all Python threads, sampled during a call")
    for r in rows:
        print(f"{r['model']}: grain {r['grain']}, plan {r['plan']}")


if __name__ == "__main__":
    main()
