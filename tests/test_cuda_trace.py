"""``benchmarks/cuda_trace.py``: the summary of a CUDA call's profiler trace, on a
synthetic trace whose answer is known."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from cuda_trace import load, summarize  # noqa: E402


def _x(name, cat, tid, ts, dur):
    return {"ph": "X", "name": name, "cat": cat, "tid": tid, "pid": 1, "ts": ts, "dur": dur}


TRACE = {"traceEvents": [
    {"ph": "M", "name": "thread_name", "tid": 7, "args": {"name": "pt_autograd_0"}},
    # The dispatcher (tid 5): two launches 40 us apart, then 42 ms of host work.
    _x("cudaLaunchKernel", "cuda_runtime", 5, 1000, 10),
    _x("cudaLaunchKernel", "cuda_runtime", 5, 1050, 10),
    _x("cudaRuntimeGetVersion", "cuda_runtime", 5, 1100, 1),
    _x("cudaMemsetAsync", "cuda_runtime", 5, 43101, 5),
    # The autograd thread (tid 7): one 3 ms gap.
    _x("cudaLaunchKernel", "cuda_runtime", 7, 50000, 10),
    _x("cudaLaunchKernel", "cuda_runtime", 7, 53010, 10),
    # GPU: two overlapping kernels (busy 3 ms, not 4), one 2 ms copy, last done at 60 ms.
    _x("k1", "kernel", 99, 2000, 2000),
    _x("k2", "kernel", 98, 3000, 2000),
    _x("copy", "gpu_memcpy", 97, 58000, 2000),
    # The caller, on the CPU, until 100 ms.
    _x("forward_backward", "python_function", 1, 0, 100000),
]}


def test_summary_of_a_known_trace(tmp_path):
    text = summarize(TRACE)
    lines = text.splitlines()
    assert lines[0] == "traced 100.0 ms"
    assert lines[1].startswith("GPU: kernels busy 3.0 ms (2 kernels), copies 2.0 ms, "
                               "memsets 0.0 ms; first at 2.0 ms, last done at 60.0 ms, "
                               "40.0 ms of host time after it"), lines[1]
    dispatcher = lines.index(next(l for l in lines if l.startswith("thread 5:")))
    assert "4 CUDA calls" in lines[dispatcher] and "1 gaps of 1 ms or more, 42.0 ms" \
        in lines[dispatcher], lines[dispatcher]
    assert lines[dispatcher + 1].split() == ["42.00", "ms", "after", "cudaRuntimeGetVersion",
                                             "(at", "1.1", "ms),", "before",
                                             "cudaMemsetAsync"]
    autograd = next(l for l in lines if l.startswith("pt_autograd_0:"))
    assert "2 CUDA calls" in autograd and "1 gaps of 1 ms or more, 3.0 ms" in autograd
    # The command line reads a saved trace, gzipped or not.
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(TRACE))
    assert load(str(path)) == TRACE
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cuda_trace.py"),
                          str(path)], capture_output=True, text=True, check=True).stdout
    assert out.strip() == text


def test_a_trace_without_gpu_work_says_so():
    cpu_only = {"traceEvents": [_x("f", "python_function", 1, 0, 5000)]}
    assert summarize(cpu_only).splitlines()[1] == "GPU: no kernels or copies in the trace"
    assert summarize({"traceEvents": []}) == "no complete events in the trace"
