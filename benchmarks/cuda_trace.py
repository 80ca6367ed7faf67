"""Where a CUDA call's time went, from a torch.profiler Chrome trace.

``benchmarks/gpu_check.py --trace PATH`` records one real ``forward_backward`` call with
``torch.profiler`` (CPU and CUDA activities) and prints this summary; run it again on a
saved trace with ``python benchmarks/cuda_trace.py PATH``. It answers the first
questions a call far slower than the simulator raises:

- how long the GPU was busy (kernels, as the union of their intervals; copies and
  memsets as sums), and when its first and last work ran within the call;
- for every thread that called the CUDA runtime or driver (the dispatchers, the
  autograd engine's device threads, the host lane): how many calls, how long inside
  them, and the longest gaps between two of its calls with the calls on either side.
  A thread issuing kernels back to back has gaps of microseconds; a gap of
  milliseconds is host work between launches: Python, a library building something
  (cuDNN graphs after ``cudaRuntimeGetVersion``), or a wait for the interpreter lock
  (``benchmarks/gil_wait.py``).
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict

from rotapipe.runtime.allreduce import interval_union

_GPU = ("kernel", "gpu_memcpy", "gpu_memset")
_API = ("cuda_runtime", "cuda_driver")


def load(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def summarize(trace: dict, top: int = 5, gap_ms: float = 1.0) -> str:
    """The summary as text (times in ms from the first event of the trace)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    if not events:
        return "no complete events in the trace"
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    t0 = min(e["ts"] for e in events)
    t1 = max(e["ts"] + e.get("dur", 0) for e in events)
    lines = [f"traced {(t1 - t0) / 1e3:.1f} ms"]
    gpu = [e for e in events if e.get("cat") in _GPU]
    if gpu:
        kernels = [(e["ts"], e["ts"] + e["dur"]) for e in gpu if e["cat"] == "kernel"]
        sums = {c: sum(e["dur"] for e in gpu if e["cat"] == c) / 1e3 for c in _GPU}
        first = min(e["ts"] for e in gpu)
        last = max(e["ts"] + e["dur"] for e in gpu)
        lines.append(
            f"GPU: kernels busy {interval_union(kernels) / 1e3:.1f} ms ({len(kernels)} kernels), "
            f"copies {sums['gpu_memcpy']:.1f} ms, memsets {sums['gpu_memset']:.1f} ms; "
            f"first at {(first - t0) / 1e3:.1f} ms, last done at {(last - t0) / 1e3:.1f} ms, "
            f"{(t1 - last) / 1e3:.1f} ms of host time after it")
    else:
        lines.append("GPU: no kernels or copies in the trace")
    by_thread: dict[int, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("cat") in _API:
            by_thread[e["tid"]].append(e)
    for tid, calls in sorted(by_thread.items(), key=lambda kv: -len(kv[1])):
        calls.sort(key=lambda e: e["ts"])
        gaps = sorted(((b["ts"] - a["ts"] - a.get("dur", 0), a, b)
                       for a, b in zip(calls, calls[1:])), key=lambda g: -g[0])
        long = [g for g in gaps if g[0] >= gap_ms * 1e3]
        inside = sum(e.get("dur", 0) for e in calls) / 1e3
        lines.append(
            f"{names.get(tid, f'thread {tid}')}: {len(calls)} CUDA calls, {inside:.1f} ms inside "
            f"them, from {(calls[0]['ts'] - t0) / 1e3:.1f} to {(calls[-1]['ts'] - t0) / 1e3:.1f}"
            f" ms; {len(long)} gaps of {gap_ms:g} ms or more, {sum(g[0] for g in long) / 1e3:.1f}"
            " ms in all")
        for g, a, b in gaps[:top]:
            if g < gap_ms * 1e3:
                break
            lines.append(f"    {g / 1e3:7.2f} ms after {a['name']} (at "
                         f"{(a['ts'] - t0) / 1e3:.1f} ms), before {b['name']}")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", help="a Chrome trace from torch.profiler (.json or .json.gz)")
    ap.add_argument("--top", type=int, default=5, help="gaps listed per thread")
    ap.add_argument("--gap-ms", type=float, default=1.0, help="the shortest gap counted")
    args = ap.parse_args(argv)
    print(summarize(load(args.trace), args.top, args.gap_ms))


if __name__ == "__main__":
    main()
