"""Count the fp32 weight gradients alive on the host while a pipeline trains.

Deterministic, not RSS: at each moment the gradients can peak (every optimizer step,
``overlap``'s per stage included, and the merge of an accumulating call) it walks every live
tensor object (``gc.get_objects``) and counts the bytes of distinct storages that are
fp32, shaped like a trainable parameter, and none of the pipeline's other state: not a
master, a compute copy, optimizer state, an undo snapshot, nor alive before the run
(reference cycles are collected first). On emulated workers in fp32 the workers'
weights and gradients are fp32 CPU tensors too: measure with a bf16 or fp16 compute
dtype, where only host tensors are fp32.
Used by tests/test_accumulation.py and benchmarks/optimizer_state.py.
"""

from __future__ import annotations

import gc
import weakref

import torch

from rotapipe.runtime.host import HostState
from rotapipe.runtime.stepping import Snapshot
from rotapipe.runtime.optstate import StatePrecision


class GradCount:
    """``with GradCount(pipe) as count: ...``; then ``count.peak`` (bytes) and
    ``count.copies`` (the peak over the model's fp32 gradient bytes)."""

    def __init__(self, pipe):
        self.pipe = pipe
        params = pipe.layerset.params
        self.trainable = [params[pid] for pid in pipe.host.trainable]
        self.shapes = {tuple(p.shape) for p in self.trainable}
        self.model_bytes = 4 * sum(p.numel() for p in self.trainable)
        self.peak = 0
        self.samples = 0
        self._undo = []

    @property
    def copies(self) -> float:
        return self.peak / self.model_bytes

    def _grad_like(self):
        for o in gc.get_objects():
            if issubclass(type(o), torch.Tensor) and o.dtype == torch.float32 \
                    and tuple(o.shape) in self.shapes and o.numel():
                yield o

    def _known(self) -> set[int]:
        """Storages of everything that is not a gradient."""
        host, opt = self.pipe.host, self.pipe.optimizer
        known = {p.untyped_storage().data_ptr() for p in self.trainable}
        for view in host.views:
            known |= {t.untyped_storage().data_ptr() for t in view if t.numel()}
        if opt is not None:
            for st in opt.state.values():
                known |= {v.untyped_storage().data_ptr() for v in st.values()
                          if isinstance(v, torch.Tensor) and v.numel()}
        for o in gc.get_objects():
            if type(o) is Snapshot:
                for _, w, state in o.items:
                    known.add(w.untyped_storage().data_ptr())
                    for v in (state or {}).values():
                        if isinstance(v, torch.Tensor) and v.numel():
                            known.add(v.untyped_storage().data_ptr())
        return known

    def sample(self) -> int:
        # Garbage in reference cycles is freed by the collector, not at once: count
        # what is reachable (deterministic), not what the collector has yet to free.
        gc.collect()
        known = self._known() | {t.untyped_storage().data_ptr() for t in
                                 (r() for r in self._before) if t is not None}
        seen: dict[int, int] = {}
        for t in self._grad_like():
            ptr = t.untyped_storage().data_ptr()
            if ptr not in known:
                seen[ptr] = max(seen.get(ptr, 0), t.untyped_storage().nbytes())
        live = sum(seen.values())
        self.peak = max(self.peak, live)
        self.samples += 1
        return live

    def __enter__(self):
        gc.collect()
        # Weak references: a storage freed later may have its address reused.
        self._before = [weakref.ref(t) for t in self._grad_like()]
        # Everything alive now (the test process's whole heap) moves to the permanent
        # generation: each sample's collection and walk then see only what the run made
        # since, which is what they count (the tensors above are excluded anyway).
        gc.freeze()
        meter = self

        def patch(owner, name, before):
            orig = getattr(owner, name)

            def wrapped(*a, **k):
                if before:
                    meter.sample()
                out = orig(*a, **k)
                if not before:
                    meter.sample()
                return out
            setattr(owner, name, wrapped)
            self._undo.append((owner, name, orig))

        patch(StatePrecision, "step", True)        # the gradients a step reads
        patch(HostState, "commit", True)           # an accumulating call's merge
        return self

    def __exit__(self, *exc):
        gc.unfreeze()
        for owner, name, orig in reversed(self._undo):
            setattr(owner, name, orig)
        self._undo.clear()
