"""Choosing and creating the worker devices for a pipeline."""

from __future__ import annotations

import torch

from ..config import BackendKind, PipeConfig
from ..errors import ConfigError
from .backend import Device


def make_devices(config: PipeConfig) -> list[Device]:
    """Devices for ``config``: every CUDA GPU (``workers`` of them, if given) with
    ``backend='auto'`` and a GPU present, else ``workers`` (default 2) emulated ones."""
    kind = config.backend
    if kind is BackendKind.AUTO and config.emulation is not None:
        kind = BackendKind.EMULATED
    if kind is BackendKind.AUTO:
        kind = BackendKind.CUDA if torch.cuda.is_available() else BackendKind.EMULATED
    if kind is BackendKind.CUDA:
        if not torch.cuda.is_available():
            raise ConfigError("backend='cuda' but no CUDA GPU is visible: use "
                              "backend='emulated' or 'auto'")
        n = torch.cuda.device_count()
        workers = config.workers or n
        if workers > n:
            raise ConfigError(f"workers={workers} but only {n} CUDA GPUs are visible: "
                              f"lower workers to {n} or use backend='emulated'")
        from .cuda import CudaDevice
        return _built(lambda i: CudaDevice(i, config.device_memory), workers)
    from .emulated import EmulatedDevice
    return _built(lambda i: EmulatedDevice(i, config.device_memory), config.workers or 2)


def _built(make, n: int) -> list[Device]:
    """``n`` devices; if one cannot be built (no thread left to start, a device that
    fails), those already built are closed before the error goes up."""
    devices = []
    try:
        for i in range(n):
            devices.append(make(i))
    except BaseException:
        for d in devices:
            d.stop()
        for d in devices:
            d.close()
        raise
    return devices
