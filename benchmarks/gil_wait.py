"""How long a backward waits for the interpreter lock while another thread runs Python.

On CUDA the runtime runs Python on several threads at once: one dispatcher per GPU
issuing its layers, the host lane handing gradients to the optimizer, the caller. A
backward's C++ work needs the interpreter lock now and then (to free a tensor Python has
seen, to run a saved-tensor hook such as the runtime's activation accounting,
``runtime/kernels.py``), and a thread that waits for it asks the holder to let go only
after the interpreter's switch interval (``sys.setswitchinterval``, 5 ms by default).

This times the backward of a small MLP (60 Linear + GELU layers of width 32, batch 4,
one torch thread, so that the C++ work is short as a GPU's kernel launches are) on the
main thread: alone, beside a thread running pure Python, and beside one running small
torch ops (which release the lock inside each op), with and without a saved-tensor
hook, for each switch interval. Median of ``--repeats`` backwards, ms.

    python benchmarks/gil_wait.py [--intervals-ms 5,0.5,0.1 --repeats 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

import torch


def backward_ms(model: torch.nn.Module, x: torch.Tensor, hook: bool) -> float:
    if hook:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            y = model(x)
    else:
        y = model(x)
    t = time.perf_counter()
    y.sum().backward()
    return (time.perf_counter() - t) * 1e3


def busy(kind: str, stop: threading.Event) -> None:
    a = torch.zeros(64)
    while not stop.is_set():
        if kind == "python":
            s = 0
            for i in range(1000):
                s += i
        else:
            for _ in range(100):
                a.add_(1.0)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--intervals-ms", default="5,0.5,0.1")
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(60)
                                  for m in (torch.nn.Linear(32, 32), torch.nn.GELU())])
    x = torch.randn(4, 32)
    default = sys.getswitchinterval()
    print("backward ms (median of %d); torch threads 1" % args.repeats)
    print(f"{'switch ms':>9s} {'beside':>10s} {'no hook':>9s} {'hook':>9s}")
    try:
        for interval in (float(v) for v in args.intervals_ms.split(",")):
            sys.setswitchinterval(interval / 1e3)
            for kind in ("nothing", "python", "torch ops"):
                stop = threading.Event()
                other = None if kind == "nothing" else \
                    threading.Thread(target=busy, args=(kind, stop), daemon=True)
                if other is not None:
                    other.start()
                try:
                    row = [statistics.median(backward_ms(model, x, hook)
                                             for _ in range(args.repeats))
                           for hook in (False, True)]
                finally:
                    stop.set()
                    if other is not None:
                        other.join()
                print(f"{interval:9g} {kind:>10s} {row[0]:9.2f} {row[1]:9.2f}")
    finally:
        sys.setswitchinterval(default)


if __name__ == "__main__":
    main()
