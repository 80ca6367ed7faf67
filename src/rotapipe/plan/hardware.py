"""Hardware profiles: a device (compute, memory, host link) and a machine of several.

Small frozen data objects: add your own with ``DeviceProfile(...)`` and
``Hardware(device, count)``. Numbers are dense tensor-core peaks from the vendors'
data sheets and host-link bandwidths achieved in practice (not the PCIe line rate).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import MappingProxyType

from .._validate import integer
from ..errors import ConfigError

__all__ = ["DeviceProfile", "Hardware", "DEVICES", "hardware", "layer_chunks",
           "MIN_EFFICIENCY", "MAX_DEVICES"]

MAX_DEVICES = 1024
"""The most devices of one :class:`Hardware` (``--hardware DEVICExN``, ``simulate
--devices``): more is a typo, and a billion devices made ``plan`` run for minutes."""

MIN_EFFICIENCY = 0.01
"""The lowest :attr:`Hardware.efficiency`: layers at 1% of the peak are a typo (``0.6``
written ``0.006``), and at ``1e-300`` every time the planner prints has 300 digits."""


@dataclass(frozen=True)
class DeviceProfile:
    """One accelerator."""

    name: str
    """Short name, e.g. ``rtx4090``."""
    memory_gib: float
    """Device memory in GiB."""
    tflops: float
    """Dense bf16/fp16 tensor throughput with fp32 accumulation, TFLOPS."""
    tflops_fp16_accumulate: float
    """Dense fp16 throughput with fp16 accumulation, TFLOPS (GeForce cards double it)."""
    pcie_gbps: float
    """Host link bandwidth achieved per direction, GB/s (uploads and downloads overlap)."""
    p2p: bool = False
    """Whether devices copy to each other directly (NVLink / PCIe P2P)."""
    memory_gbps: float = 0.0
    """Device memory bandwidth, GB/s (informational)."""

    def __post_init__(self):
        for field in ("memory_gib", "tflops", "tflops_fp16_accumulate", "pcie_gbps"):
            if not getattr(self, field) > 0:
                raise ConfigError(f"DeviceProfile {self.name!r}: {field} must be > 0, got "
                                  f"{getattr(self, field)}")

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * 2**30)


@dataclass(frozen=True)
class Hardware:
    """``count`` identical devices in one machine and how well layers use them."""

    device: DeviceProfile
    count: int
    """Devices (pipeline workers)."""
    efficiency: float = 0.6
    """Fraction of the peak tensor throughput a transformer layer reaches (large bf16
    matmuls reach 0.6-0.75; attention and norms pull it down)."""
    fp16_accumulate: bool = False
    """Compute in fp16 with fp16 accumulation (the paper's setting on RTX 4090)."""

    def __post_init__(self):
        integer("Hardware.count", self.count, maximum=MAX_DEVICES)
        if not MIN_EFFICIENCY <= self.efficiency <= 1:
            raise ConfigError(f"Hardware.efficiency={self.efficiency!r}: use a fraction of "
                              f"the peak TFLOPS in [{MIN_EFFICIENCY:g}, 1] (e.g. 0.6)")

    @property
    def name(self) -> str:
        return f"{self.device.name}x{self.count}"

    @property
    def flops(self) -> float:
        """Sustained FLOP/s of one device for layer math."""
        peak = self.device.tflops_fp16_accumulate if self.fp16_accumulate else self.device.tflops
        return peak * 1e12 * self.efficiency

    @property
    def link_bytes_per_s(self) -> float:
        return self.device.pcie_gbps * 1e9


DEVICES = MappingProxyType({
    "rtx4090": DeviceProfile("rtx4090", 24.0, 165.2, 330.3, 25.0, p2p=False,
                             memory_gbps=1008.0),
    "a100-80gb": DeviceProfile("a100-80gb", 80.0, 312.0, 312.0, 25.0, p2p=True,
                               memory_gbps=2039.0),
    "a800-80gb": DeviceProfile("a800-80gb", 80.0, 312.0, 312.0, 25.0, p2p=True,
                               memory_gbps=2039.0),
    "h100-pcie": DeviceProfile("h100-pcie", 80.0, 756.0, 756.0, 50.0, p2p=True,
                               memory_gbps=2000.0),
})
"""Known devices by name."""

_ALIASES = MappingProxyType({"4090": "rtx4090", "a100": "a100-80gb", "a800": "a800-80gb",
                             "h100": "h100-pcie"})


def hardware(name: str, **overrides) -> Hardware:
    """A named machine: ``DEVICExN`` (``rtx4090x8``, ``a100x8``, ``h100-pciex4``) or a
    device name alone (one device). ``overrides`` set :class:`Hardware` fields."""
    text = name.strip().lower()
    # A bare device name first: "rtx4090" must not read as "rt" x 4090.
    m = re.fullmatch(r"(.+?)(?:x(\d+))?", text)
    dev, count = (text, 1) if text in DEVICES or text in _ALIASES else \
        (m.group(1), int(m.group(2) or 1))
    dev = _ALIASES.get(dev, dev)
    if dev not in DEVICES:
        known = ", ".join(sorted(DEVICES) + sorted(_ALIASES))
        raise ConfigError(f"unknown hardware {name!r}: use DEVICExN with DEVICE one of "
                          f"{known} (e.g. rtx4090x8), or build a Hardware yourself")
    if not 1 <= count <= MAX_DEVICES:
        raise ConfigError(f"hardware {name!r} has {count:,} devices: use DEVICExN with N in "
                          f"[1, {MAX_DEVICES:,}] (e.g. rtx4090x8), or the device name alone "
                          "for one")
    unknown = sorted(set(overrides) - {"efficiency", "fp16_accumulate"})
    if unknown:
        raise ConfigError(f"hardware({name!r}, {', '.join(unknown)}=...): a Hardware has no "
                          "such field; override efficiency or fp16_accumulate (the device's "
                          "own numbers: build a DeviceProfile and Hardware(device, count))")
    return Hardware(DEVICES[dev], count, **overrides)


def layer_chunks(nbytes: int, chunk_bytes: int) -> int:
    """Chunks a layer's ``nbytes`` of weights (or weight gradients) move in over a copy
    engine: the fewest such that none exceeds ``chunk_bytes``, at least one (the
    runtime's gated chunks, ``rotapipe.runtime.transfer``, and the simulator's)."""
    return max(1, -(-int(nbytes) // int(chunk_bytes)))
