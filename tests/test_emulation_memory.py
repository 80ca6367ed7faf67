"""The emulated workers' memory meter counts what a GPU would hold while copies are in
flight (docs/concepts.md, "Copy engines").

On a GPU a chunked weight upload takes each layer's memory when its first chunk is
issued (the caching allocator hands it out then), and a weight-gradient download's
source stays allocated until its last chunk has copied it. A meter that charges the
upload only at its last chunk, or frees the gradients at the download's first chunk,
lets a plan 'fit' on the emulated backend that runs out of memory on the GPU.
"""

from __future__ import annotations

import threading

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

import rotapipe
from rotapipe.runtime.chunks import ChunkedCopies
from rotapipe.runtime.emulated import EmulatedDevice

from models import Residual

DIM, HIDDEN, LAYERS = 64, 256, 8


class Landing(EmulatedDevice):
    """An emulated worker that remembers, per thread, the storages its copies allocate
    (``empty``: where a chunked upload lands)."""

    def __init__(self, index: int):
        super().__init__(index)
        self.allocated = threading.local()

    def empty(self, shape, dtype):
        t = torch.empty(shape, dtype=dtype)
        if getattr(self.allocated, "into", None) is not None:
            self.allocated.into.add(t.untyped_storage().data_ptr())
        return t


def _model() -> tuple[nn.Sequential, int]:
    torch.manual_seed(0)
    model = nn.Sequential(*[Residual(DIM, HIDDEN) for _ in range(LAYERS)])
    return model, sum(p.numel() * p.element_size() for p in model[0].parameters())


def _run(devices, L: int) -> None:
    config = rotapipe.PipeConfig(workers=2, microbatches=2, backend="emulated",
                                 forward_stages=LAYERS - 1, backward_stages=LAYERS - 1,
                                 tail_layers=1, copy_chunk_mb=L / 8 / 2**20)
    model, _ = _model()
    with rotapipe.RoundPipe(model, nn.functional.mse_loss, config=config,
                            devices=devices) as pipe:
        x = torch.randn(16, DIM)
        pipe.forward_backward(x, x)


def _charged_storages(store) -> set[int]:
    with store._lock:
        values = [v[0] for v in store._items.values() if v[3]]
    return {t.untyped_storage().data_ptr() for v in values for t in tree_leaves(v)
            if isinstance(t, torch.Tensor)}


def test_a_weight_upload_is_charged_from_its_first_chunk(monkeypatch):
    """At the start of every chunk of a stage's upload after the first, the device
    memory its earlier chunks allocated is charged (one layer per stage, 8 chunks per
    layer: before the fix, none of it was until the stage's last chunk had run)."""
    _, L = _model()
    devices = [Landing(0), Landing(1)]
    upload = ChunkedCopies.upload
    seen: list[tuple[str, int, bool]] = []

    def watched(self, a):
        chunks = upload(self, a)
        dev, store = self.r.devices[a.worker], self.r.stores[a.worker]
        landed: set[int] = set()
        for i, c in enumerate(chunks):
            def run(copy=c.copy, i=i):
                if i > 0:
                    seen.append((a.key, i, landed <= _charged_storages(store)))
                dev.allocated.into = landed
                try:
                    copy()
                finally:
                    dev.allocated.into = None
            c.copy = run
        return chunks
    monkeypatch.setattr(ChunkedCopies, "upload", watched)
    try:
        _run(devices, L)
    finally:
        for d in devices:
            d.close()
    assert seen, "no upload had more than one chunk"
    uncharged = [(key, i) for key, i, ok in seen if not ok]
    assert not uncharged, uncharged


def test_gradients_stay_charged_until_their_download_ends(monkeypatch):
    """Every chunk of a weight-gradient download after the first still reads the
    stage's gradients on the device: they must still be charged to it."""
    _, L = _model()
    devices = [EmulatedDevice(0), EmulatedDevice(1)]
    download = ChunkedCopies.download
    seen: list[tuple[str, int, bool]] = []

    def watched(self, a):
        chunks = download(self, a)
        store = self.r.stores[a.worker]
        sources: set[int] = set()
        for i, c in enumerate(chunks):
            def run(copy=c.copy, i=i):
                if i == 0:
                    grads = store.get(("wgrad", a.stage))
                    sources.update(g.untyped_storage().data_ptr() for g in grads.values())
                else:
                    seen.append((a.key, i, sources <= _charged_storages(store)))
                copy()
            c.copy = run
        return chunks
    monkeypatch.setattr(ChunkedCopies, "download", watched)
    try:
        _run(devices, L)
    finally:
        for d in devices:
            d.close()
    assert seen, "no download had more than one chunk"
    uncharged = [(key, i) for key, i, ok in seen if not ok]
    assert not uncharged, uncharged


def test_a_download_keeps_what_it_reads_charged_until_its_copy_ends():
    """An activation download pops the worker's tensor (uncharging it) and then copies
    it to the host; on a GPU the caching allocator frees stream-ordered, so that memory
    is held until the copy has completed. The meter keeps it charged until the download
    stream's function returns (with a timed emulation, after the copy's duration).
    Before, it dropped the bytes at the pop: during every activation download of a
    1-worker run the meter read one activation (4 KiB here) less than the GPU holds."""
    from rotapipe.runtime.store import Store
    from rotapipe.schedule import Lane

    dev = EmulatedDevice(0)
    try:
        store = Store("w0", dev)
        key = ("out", "F0", 0, 1)
        store.put(key, dev.upload(torch.zeros(1024)))
        seen: list = []

        def download_act():          # as Kernels._download_act: pop, then copy
            y = store.pop(key)
            seen.append(dev.memory_in_use())
            dev.download(y)
            seen.append(dev.memory_in_use())
        dev.stream(Lane.DOWNLOAD).submit(download_act, seen.append, threading.Event(), "DA")
        assert dev.drain(5)
        assert seen == [4096, 4096], seen
        assert dev.memory_in_use() == 0 and dev.peak_memory() == 4096
    finally:
        dev.close(5)
