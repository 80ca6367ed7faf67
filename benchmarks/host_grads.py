"""Host time of one training call's gradients: arrival, finiteness check, merge.

Every call of a pipeline brings each trainable parameter's gradient to the host (a
download buffer per stage in the compute dtype), checks it (``nonfinite="raise"``,
the default) and merges it into ``param.grad`` (docs/memory.md). On a GPU this is
host work the GPUs wait for: the arrival runs on the host lane while other stages
compute, the check and the merge after the call's last gradient, before the call
returns (``sync``). A GPU check (docs/gpu_check.md) found these passes taking most of
a real call on an H200 (a fresh tensor per pass pays its page faults), which the
emulated backend hides, its workers being as slow as the host.

The parameters are those of a Qwen3-like model (``--layers`` blocks of hidden 2048,
intermediate 6144, GQA 16/8 x 128, a 32k untied embedding and head: 332M parameters at
4 layers), bf16 compute. Three layouts, each in two cases:

- ``bf16, widened twice``: the layout before: staged in bf16, widened into a new fp32
  tensor for the check, then again for the merge;
- ``bf16, scratch check``: staged in bf16, the check widens into one reused buffer
  (what an accumulating call does now);
- ``fp32 on arrival``: widened on arrival into the fp32 tensor that becomes
  ``param.grad`` (what a call that starts a step does now), ``new``: a new tensor
  each call, ``pool``: in the storages of the previous step's gradients once
  ``zero_grad`` dropped them (``HostState.grad_pool``, what the pipeline does);
- ``bounds``: the same two with the finiteness decided on arrival (``CallGrads(bounds=
  True)``, what the pipeline does under ``nonfinite="raise"``): the largest magnitude
  of each arriving gradient (one reduction over bf16) bounds its fp32 sum, so the
  check reads no fp32 gradient;

``first`` is a step's first call (``param.grad`` is None), ``accumulating`` a later
one (merged into the existing ``.grad``). Columns are ms, the best of ``--repeats``:
``arrival`` (host lane, overlapped with compute), ``check`` (the pipeline takes it per
stage at the hand-offs, overlapped with shallower stages' backward, except the last
stage's), ``merge`` and ``end`` (check + merge: what the caller waits for after the
last gradient when all land at once), ``free`` (``zero_grad`` dropping the gradients).

    python benchmarks/host_grads.py [--layers 4 --repeats 3]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from rotapipe.config import OptimizerMode, PrecisionConfig
from rotapipe.model import LayerSet
from rotapipe.runtime.callgrads import CallGrads
from rotapipe.runtime.host import HostState, LossScaler
from rotapipe.runtime.optimizer import HostOptimizer


def qwen3_like(layers: int) -> list[nn.Module]:
    h, i, q, kv, vocab = 2048, 6144, 16 * 128, 8 * 128, 32000
    shapes = [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i), (h,), (h,)]

    def holder(shapes):
        m = nn.Module()
        for k, s in enumerate(shapes):
            m.register_parameter(f"p{k}", nn.Parameter(torch.zeros(s)))
        return m
    return [holder([(vocab, h)])] + [holder(shapes) for _ in range(layers)] + \
        [holder([(h,), (vocab, h)])]


LAYOUTS = {   # name -> (keep the compute dtype, check through one scratch buffer, pool,
              #          bounds on arrival)
    "bf16, widened twice": (True, False, False, False),
    "bf16, scratch check": (True, True, False, False),
    "fp32 on arrival, new": (False, False, False, False),
    "fp32 on arrival, pool": (False, False, True, False),
    "bf16, bounds": (True, True, False, True),
    "fp32, pool, bounds": (False, False, True, True),
}


def one_call(host, opt, downloads, keep: bool, scratch: bool, pool: bool,
             bounds: bool) -> dict[str, float]:
    t = {}
    t0 = time.perf_counter()
    grads = CallGrads(1.0, keep_dtype=keep, pool=host.grad_pool if pool else None,
                      bounds=bounds)
    for pid, g in downloads.items():
        grads.add(pid, g)
    t1 = time.perf_counter()
    known = {pid for pid in grads.pids() if grads.known_finite(pid)}
    assert opt.finite(grads.checked() if scratch else grads.fp32(), known=known)
    t2 = time.perf_counter()
    host.commit(grads, 1.0)
    t3 = time.perf_counter()
    t.update(arrival=t1 - t0, check=t2 - t1, merge=t3 - t2, end=t3 - t1)
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    precision = PrecisionConfig(compute_dtype="bf16")
    host = HostState(LayerSet(qwen3_like(args.layers)), precision)
    opt = HostOptimizer(host, LossScaler(precision), OptimizerMode.SYNC, None)
    gen = torch.Generator().manual_seed(0)
    params = host.layerset.params
    downloads = {pid: torch.randn(params[pid].shape, generator=gen).bfloat16()
                 for pid in host.trainable}
    n = sum(params[pid].numel() for pid in host.trainable)
    print(f"{n / 1e6:.0f}M trainable parameters ({args.layers} Qwen3-like blocks, 32k "
          f"untied embedding and head), bf16 downloads; torch threads "
          f"{torch.get_num_threads()}; ms, the best of {args.repeats}\n")
    cols = ("arrival", "check", "merge", "end", "free")
    print(f"{'layout':22s} {'case':13s} " + " ".join(f"{c:>8s}" for c in cols))
    for name, (keep, scratch, pool, bounds) in LAYOUTS.items():
        for case in ("first", "accumulating"):
            rows = []
            for _ in range(args.repeats):
                host.zero_grad()
                if case == "accumulating":
                    one_call(host, opt, downloads, keep, scratch, pool, bounds)
                t = one_call(host, opt, downloads, keep, scratch, pool, bounds)
                t0 = time.perf_counter()
                host.zero_grad()
                t["free"] = time.perf_counter() - t0
                rows.append(t)
            med = {c: min(r[c] for r in rows) * 1e3 for c in cols}
            print(f"{name:22s} {case:13s} " + " ".join(f"{med[c]:8.0f}" for c in cols))


if __name__ == "__main__":
    main()
