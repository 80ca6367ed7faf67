"""Host memory modes of the model state the workers upload (docs/host_memory.md).

A copy engine reads page-locked ("pinned") host memory on its own; from pageable
memory the driver first stages the data through a pinned buffer of its own and the
copy does not overlap the host. :class:`HostPinning` applies one :class:`PinMode` to
every weight a pipeline keeps in host memory and counts the bytes of each kind:

- ``COPY``: a pinned copy (``tensor.pin_memory()``; the original is dropped).
- ``REGISTER``: the existing storage page-locked in place (``cudaHostRegister`` through
  ``torch.cuda.cudart()``): no second copy. Unregistered by :meth:`HostPinning.close`.
- ``OFF``: left pageable (e.g. a memory-mapped safetensors base); uploads stream it
  through a few pinned bounce buffers from :meth:`HostPinning.empty`.

On emulated workers nothing is page-locked: ``COPY`` still makes a real copy (so RSS
shows what it costs), ``REGISTER`` and :meth:`~HostPinning.empty` only record the
storages as pinned, so tests and the accounting see the same thing CUDA would do.
:func:`resolve_pin` picks the mode for ``PipeConfig(pin=None)``.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import pathlib
import threading
import weakref

import torch

from ..config import PinMode

__all__ = ["HostPinning", "resolve_pin", "mapped_frozen_bytes", "available_ram",
           "machine_ram", "cgroup_room"]

log = logging.getLogger(__name__)

_PINNED_KINDS = ("copied", "registered", "buffers")

FIT_FRACTION = 0.8
"""Auto rule: a memory-mapped frozen base is pinned only when its bytes fit in this
share of ``MemAvailable`` (the rest is left for masters, optimizer state, activations)."""


class HostPinning:
    """Applies one host memory mode to a pipeline's weights and accounts the bytes.

    Storages are tracked by their address while they live (a finalizer forgets them),
    so :meth:`is_pinned` answers for any view of a kept or allocated tensor.
    Thread-safe: :meth:`empty` is called from worker and dispatcher threads.
    """

    def __init__(self, mode: PinMode | str, cuda: bool):
        self.mode = PinMode(mode)
        self.cuda = cuda
        self._lock = threading.Lock()
        self._kinds: dict[int, str] = {}        # storage address -> kind (see stats)
        self._stats = dict(copied=0, registered=0, pageable=0, buffers=0, buffers_peak=0)
        # Registered storages stay referenced until unregistered: freeing registered
        # memory would leave the range locked and break a later registration there. The
        # finalizer (close, or garbage collection of self) unregisters them.
        self._registered: dict[int, torch.UntypedStorage] = {}
        self._closer = weakref.finalize(self, _unregister_all, self._registered, cuda)
        self._warned = False

    # -- model state ---------------------------------------------------------------------
    def keep(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (a CPU model-state tensor the workers upload) treated per mode: a pinned
        copy (``COPY``), the same tensor page-locked in place (``REGISTER``; a pinned
        copy with a logged warning if the driver refuses), or the same tensor, pageable
        (``OFF``). Tensors already pinned are returned as they are."""
        if self.is_pinned(t):
            return t
        if self.mode is PinMode.COPY:
            return self._copy(t)
        st = t.untyped_storage()
        if self.mode is PinMode.REGISTER:
            if not self._register(st):
                return self._copy(t)
            return t
        self._record(st, "pageable")
        return t

    def new(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A new model-state tensor (e.g. a bf16 compute copy of an fp32 master), page-
        locked per mode without a second copy: pinned allocation (``COPY``), allocated
        then registered (``REGISTER``: no power-of-two rounding of the pinned caching
        allocator), pageable (``OFF``). Undefined contents."""
        if self.mode is PinMode.COPY:
            out = torch.empty(shape, dtype=dtype, pin_memory=self.cuda)
            self._record(out.untyped_storage(), "copied")
            return out
        return self.keep(torch.empty(shape, dtype=dtype))

    def is_pinned(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage is page-locked (on emulated workers: recorded so)."""
        if t.device.type != "cpu":
            return False
        kind = self._kinds.get(t.untyped_storage().data_ptr())
        return kind in _PINNED_KINDS or (self.cuda and kind is None and t.is_pinned())

    # -- staging and bounce buffers ------------------------------------------------------
    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """New page-locked host memory for staging or bounce buffers (pool it: pinned
        allocations are slow), counted in ``stats["buffers"]`` while it lives."""
        out = torch.empty(shape, dtype=dtype, pin_memory=self.cuda)
        self._record(out.untyped_storage(), "buffers")
        return out

    @property
    def stats(self) -> dict[str, int]:
        """Bytes: ``copied`` (model state pinned by copying), ``registered`` (pinned in
        place), ``pageable`` (model state left pageable), ``buffers`` (live staging and
        bounce memory from :meth:`empty`) and ``buffers_peak`` (its peak)."""
        with self._lock:
            return dict(self._stats)

    def close(self) -> None:
        """Unregister every registered storage (CUDA); idempotent. Call it only when no
        copy reads them any more. The tensors stay valid, pageable."""
        self._closer()
        with self._lock:
            for key in [k for k, v in self._kinds.items() if v == "registered"]:
                del self._kinds[key]
            self._stats["registered"] = 0

    # -- internals -----------------------------------------------------------------------
    def _copy(self, t: torch.Tensor) -> torch.Tensor:
        if self.cuda:
            out = t.pin_memory()
        else:       # a real copy, so that RSS shows what COPY costs
            out = torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t)
        self._record(out.untyped_storage(), "copied")
        return out

    def _register(self, st: torch.UntypedStorage) -> bool:
        """Page-lock ``st`` in place; ``False`` when the driver refuses (then warn)."""
        if st.nbytes() == 0:
            return True
        if self.cuda:
            err = int(torch.cuda.cudart().cudaHostRegister(st.data_ptr(), st.nbytes(), 0))
            if err != 0:
                _clear_cuda_error()
                if not self._warned:
                    self._warned = True
                    log.warning(
                        "cudaHostRegister of %.1f MiB at 0x%x failed with cudaError %d "
                        "(%s): pinning by copy instead (pin='copy'); set pin='off' to keep "
                        "the weights pageable", st.nbytes() / 2**20, st.data_ptr(), err,
                        torch.cuda.cudart().cudaGetErrorString(err))
                return False
        with self._lock:
            self._registered[st.data_ptr()] = st
        self._record(st, "registered")
        return True

    def _record(self, st: torch.UntypedStorage, kind: str) -> None:
        key, n = st.data_ptr(), st.nbytes()
        with self._lock:
            if key in self._kinds:
                return
            self._kinds[key] = kind
            self._stats[kind] += n
            if kind == "buffers":
                self._stats["buffers_peak"] = max(self._stats["buffers_peak"],
                                                  self._stats["buffers"])
        if kind != "registered":     # registered storages are referenced until close
            f = weakref.finalize(st, _forget, weakref.ref(self), key, kind, n)
            f.atexit = False


def _forget(ref, key: int, kind: str, nbytes: int) -> None:
    """A tracked storage was freed: forget its address (it may be reused)."""
    self = ref()
    if self is None:
        return
    with self._lock:
        if self._kinds.get(key) == kind:
            del self._kinds[key]
            if kind == "buffers":
                self._stats["buffers"] -= nbytes


def _unregister_all(registered: dict, cuda: bool) -> None:
    if cuda:
        cudart = torch.cuda.cudart()
        for ptr in registered:
            cudart.cudaHostUnregister(ptr)
    registered.clear()


def _clear_cuda_error() -> None:
    """Reset the runtime's last error after a refused registration, so that torch's next
    launch check does not report it. ``torch.cuda.cudart()`` has no binding for
    ``cudaGetLastError``; call the already loaded libcudart (best effort)."""
    try:
        with open("/proc/self/maps") as f:
            libs = {line.split()[-1] for line in f if "libcudart.so" in line}
        for lib in libs:
            ctypes.CDLL(lib).cudaGetLastError()
    except (OSError, AttributeError):
        pass


# -- the auto rule -----------------------------------------------------------------------
def resolve_pin(pin: PinMode | str | None, cuda: bool, layerset, *,
                dtype: torch.dtype | None = None, available: int | None = None) -> PinMode:
    """The host memory mode of a pipeline: ``pin`` when given, else

    1. ``OFF`` when the frozen weights (``requires_grad=False``, already in the compute
       ``dtype``) that are memory-mapped from a file (:func:`mapped_frozen_bytes`) do
       not fit in ``FIT_FRACTION`` of the available RAM (``available``, default
       :func:`available_ram`): pinning them either way would lock that much RAM;
    2. ``REGISTER`` on CUDA when a test registration of one page succeeds;
    3. ``COPY`` otherwise (emulated workers, or a driver that refuses registration).
    """
    if pin is not None:
        mode = PinMode(pin)
        log.info("host memory mode %r (as configured)", mode.value)
        return mode
    mapped = mapped_frozen_bytes(layerset, dtype)
    if mapped:
        ram = available_ram() if available is None else available
        if ram is not None and mapped > FIT_FRACTION * ram:
            log.info("host memory mode 'off': the memory-mapped frozen weights (%.2f GiB) "
                     "do not fit in %.0f%% of the available RAM (%.2f GiB); they stay "
                     "pageable", mapped / 2**30, FIT_FRACTION * 100, ram / 2**30)
            return PinMode.OFF
    if cuda:
        if _registration_works():
            log.info("host memory mode 'register' (CUDA; pinned in place)")
            return PinMode.REGISTER
        log.info("host memory mode 'copy': the driver refuses cudaHostRegister")
        return PinMode.COPY
    log.info("host memory mode 'copy' (emulated workers)")
    return PinMode.COPY


def mapped_frozen_bytes(layerset, dtype: torch.dtype | None = None) -> int:
    """Bytes of the frozen parameters of ``layerset`` (of ``dtype``, when given) whose
    storage lies in a file mapping of this process (``/proc/self/maps``, Linux; 0
    elsewhere). ``load_hf`` gives such weights: ``transformers`` memory-maps
    safetensors files. A frozen weight of another dtype is converted (copied) when the
    pipeline is built, so it would not stay mapped."""
    ranges = _file_mappings()
    if not ranges:
        return 0
    starts = [lo for lo, _ in ranges]
    seen: set[int] = set()
    total = 0
    for p in layerset.params:
        if p.requires_grad or (dtype is not None and p.dtype != dtype) \
                or p.device.type != "cpu":
            continue
        st = p.untyped_storage()
        ptr = st.data_ptr()
        if ptr in seen:
            continue
        i = bisect.bisect_right(starts, ptr) - 1
        if i >= 0 and ptr < ranges[i][1]:
            seen.add(ptr)
            total += st.nbytes()
    return total


def _file_mappings() -> list[tuple[int, int]]:
    """Sorted ``(start, end)`` address ranges of this process's file-backed mappings."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.readlines()
    except OSError:
        return []
    out = []
    for line in lines:
        fields = line.split(maxsplit=5)
        # address perms offset dev inode [path]; inode 0 is anonymous memory, and
        # "[heap]", "[stack]"... are not files.
        if len(fields) < 6 or fields[4] == "0" or fields[5].startswith("["):
            continue
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        out.append((lo, hi))
    out.sort()
    return out


def available_ram() -> int | None:
    """Bytes of RAM available to new allocations of this process: the machine's
    (``psutil`` when installed, else ``MemAvailable`` of ``/proc/meminfo``), or less
    where a memory cgroup of this process (a container's or a batch job's limit:
    :func:`cgroup_room`) leaves less; ``None`` when nothing answers."""
    known = [n for n in (machine_ram(), cgroup_room()) if n is not None]
    return min(known) if known else None


def machine_ram() -> int | None:
    """The machine's available RAM (``psutil``, else ``MemAvailable``), or ``None``."""
    try:
        import psutil
        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


UNLIMITED = 1 << 62
"""A cgroup v1 memory limit at or above this is "no limit" (the kernel writes the
largest page-aligned 64-bit value there)."""


def cgroup_room(root: str | pathlib.Path = "/") -> int | None:
    """Bytes this process may still allocate under the memory limits of its cgroup and
    every cgroup above it (the kernel's out-of-memory killer acts on the first limit
    reached), or ``None`` without a limit. At each limited level: the limit minus the
    usage, plus the inactive file cache the kernel reclaims before it kills (the
    "working set" Kubernetes evicts on). Reads cgroup v2 (``memory.max``,
    ``memory.current``, ``memory.stat``) and v1 (``memory.limit_in_bytes``,
    ``memory.usage_in_bytes``); ``root`` is the file system root (tests pass a fake
    tree)."""
    root = pathlib.Path(root)
    rooms = []
    for mount, path, v2 in _memory_cgroups(root):
        level = path
        while True:
            room = _level_room(mount / level.relative_to("/"), v2)
            if room is not None:
                rooms.append(room)
            if level == level.parent:
                break
            level = level.parent
    return max(0, min(rooms)) if rooms else None


def _memory_cgroups(root: pathlib.Path):
    """``(mount point, this process's cgroup under it, v2?)`` for each memory cgroup
    hierarchy mounted, from ``/proc/self/mountinfo`` and ``/proc/self/cgroup``."""
    try:
        groups = (root / "proc/self/cgroup").read_text().splitlines()
        mounts = (root / "proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    where = {}                          # "memory" (v1) or "" (v2) -> cgroup path
    for line in groups:
        parts = line.split(":", 2)
        if len(parts) == 3:
            for name in parts[1].split(",") if parts[1] else [""]:
                where[name] = parts[2]
    found = []
    for line in mounts:
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        fs_type, _, options = line.split(" - ", 1)[1].split()[:3]
        v2 = fs_type == "cgroup2"
        if not v2 and not (fs_type == "cgroup" and "memory" in options.split(",")):
            continue
        path = where.get("" if v2 else "memory")
        if path is None:
            continue
        # The mount shows the hierarchy from its root (a container sees its own cgroup
        # as "/"): this process's cgroup relative to that root.
        mroot, point = pathlib.PurePosixPath(fields[3]), fields[4]
        rel = pathlib.PurePosixPath(path)
        rel = "/" / rel.relative_to(mroot) if rel.is_relative_to(mroot) else \
            pathlib.PurePosixPath("/")
        found.append((root / point.lstrip("/"), rel, v2))
    return found


def _level_room(d: pathlib.Path, v2: bool) -> int | None:
    """Room under one cgroup's memory limit, or ``None`` (no limit, or unreadable)."""
    try:
        limit = (d / ("memory.max" if v2 else "memory.limit_in_bytes")).read_text().strip()
        if limit == "max" or int(limit) >= UNLIMITED:
            return None
        used = int((d / ("memory.current" if v2 else "memory.usage_in_bytes")).read_text())
    except (OSError, ValueError):
        return None
    inactive = 0
    try:
        stats = dict(line.split() for line in (d / "memory.stat").read_text().splitlines()
                     if line.count(" ") == 1)
        inactive = int(stats.get("inactive_file" if v2 else "total_inactive_file",
                                 stats.get("inactive_file", 0)))
    except (OSError, ValueError):
        pass
    return int(limit) - used + inactive


def _registration_works() -> bool:
    """Whether the driver page-locks ordinary host memory in place (one page, undone)."""
    try:
        probe = torch.empty(4096, dtype=torch.uint8)
        cudart = torch.cuda.cudart()
        if int(cudart.cudaHostRegister(probe.data_ptr(), probe.numel(), 0)) != 0:
            _clear_cuda_error()
            return False
        cudart.cudaHostUnregister(probe.data_ptr())
        return True
    except (RuntimeError, AttributeError):
        return False
