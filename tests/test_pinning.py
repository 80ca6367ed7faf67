"""Host memory modes (runtime/pinning.py) on emulated workers: what each mode does to a
tensor and counts, the auto rule, staging of user inputs, and exactness per mode."""

from __future__ import annotations

import gc
import mmap

import pytest
import torch
from torch import nn

import rotapipe
from rotapipe import PinMode
from rotapipe.model import LayerSet
from rotapipe.runtime import pinning as pinning_mod
from rotapipe.runtime.pinning import HostPinning, mapped_frozen_bytes, resolve_pin
from rotapipe.runtime.pool import BlockPool
from models import emulated, lm_loss, tiny_transformer
from test_exactness import (OPTIMIZERS, assert_bitwise_equal, assert_close_trained,
                            reference, run, step_batches, train_pipe, train_reference)

NBYTES = 1000 * 4


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("mode", list(PinMode))
def test_keep_per_mode(mode):
    pin = HostPinning(mode, cuda=False)
    t = torch.randn(1000)
    kept = pin.keep(t)
    assert torch.equal(kept, t)
    # Only COPY makes a second storage; REGISTER and OFF keep the caller's.
    assert (_storage(kept) == _storage(t)) == (mode is not PinMode.COPY)
    assert pin.is_pinned(kept) == (mode is not PinMode.OFF)
    assert pin.is_pinned(kept[10:]) == pin.is_pinned(kept)      # by storage, any view
    want = {PinMode.COPY: "copied", PinMode.REGISTER: "registered",
            PinMode.OFF: "pageable"}[mode]
    stats = pin.stats
    assert stats[want] == NBYTES
    assert sum(stats[k] for k in ("copied", "registered", "pageable")) == NBYTES
    assert stats["buffers"] == 0
    # Keeping a kept tensor (or a view of it) again counts nothing and copies nothing.
    assert pin.keep(kept) is kept
    assert pin.stats == stats
    pin.close()
    pin.close()                                                 # idempotent
    assert pin.stats["registered"] == 0


def test_copy_is_a_real_copy():
    pin = HostPinning("copy", cuda=False)
    t = torch.zeros(8)
    kept = pin.keep(t)
    t.add_(1)
    assert kept.sum() == 0
    assert not pin.is_pinned(t)


def test_new_is_allocated_in_its_mode():
    for mode, kind in [("copy", "copied"), ("register", "registered"), ("off", "pageable")]:
        pin = HostPinning(mode, cuda=False)
        c = pin.new((10, 100), torch.bfloat16)
        assert c.dtype == torch.bfloat16 and c.shape == (10, 100)
        assert pin.stats[kind] == 2000
        assert pin.is_pinned(c) == (mode != "off")


def test_buffers_are_accounted_while_they_live():
    pin = HostPinning("off", cuda=False)
    a = pin.empty((256,), torch.float32)
    b = pin.empty((2, 64), torch.float64)
    assert pin.is_pinned(a) and pin.is_pinned(b[1])
    assert pin.stats["buffers"] == 2048
    del a
    gc.collect()
    assert pin.stats["buffers"] == 1024 and pin.stats["buffers_peak"] == 2048
    # A freed address may be reused by pageable memory: it is forgotten.
    del b
    gc.collect()
    assert pin.stats["buffers"] == 0


def test_block_pool_allocates_through_pinning():
    pin = HostPinning("off", cuda=False)
    pool = BlockPool(pinning=pin)
    x = pool.empty((1 << 15,), torch.float32)         # 128 KiB: a pooled block
    assert pin.is_pinned(x) and pin.stats["buffers"] == 1 << 17
    del x
    y = pool.empty((1 << 15,), torch.float32)         # the same block, reused
    assert pin.stats["buffers"] == 1 << 17
    assert pin.is_pinned(pool.empty((3,), torch.int64))   # small: not pooled, still pinned
    del y


# -- the auto rule -----------------------------------------------------------------------

def _mapped_model(tmp_path, n: int = 4096):
    """A two-layer model whose frozen first weight lives in a file mapping (as
    ``transformers`` memory-maps safetensors), and its mapping's size in bytes."""
    path = tmp_path / "weights.bin"
    path.write_bytes(torch.randn(n).numpy().tobytes())
    f = open(path, "r+b")
    mm = mmap.mmap(f.fileno(), 0)
    f.close()
    weight = torch.frombuffer(mm, dtype=torch.float32).view(64, n // 64)
    a = nn.Linear(n // 64, 64, bias=False)
    a.weight = nn.Parameter(weight, requires_grad=False)
    return [a, nn.Linear(64, 8)], n * 4, mm


def test_auto_on_emulated_is_copy():
    layers = [nn.Linear(4, 4), nn.Linear(4, 4)]
    assert resolve_pin(None, False, LayerSet(layers)) is PinMode.COPY
    assert resolve_pin("off", False, LayerSet(layers)) is PinMode.OFF
    assert resolve_pin(PinMode.REGISTER, True, LayerSet(layers)) is PinMode.REGISTER


def test_auto_turns_off_for_a_mapped_base_that_does_not_fit(tmp_path):
    layers, size, mm = _mapped_model(tmp_path)
    ls = LayerSet(layers)
    assert mapped_frozen_bytes(ls) == size
    assert mapped_frozen_bytes(ls, torch.bfloat16) == 0   # would be converted: not mapped
    assert resolve_pin(None, False, ls, available=size // 2) is PinMode.OFF
    assert resolve_pin(None, False, ls, available=100 * size) is PinMode.COPY
    # Trainable weights do not count, even when mapped.
    layers[0].weight.requires_grad_(True)
    assert mapped_frozen_bytes(LayerSet(layers)) == 0
    del layers, ls
    gc.collect()


def test_anonymous_frozen_weights_never_turn_it_off():
    layers = [nn.Linear(64, 64), nn.Linear(64, 8)]
    layers[0].requires_grad_(False)
    assert mapped_frozen_bytes(LayerSet(layers)) == 0
    assert resolve_pin(None, False, LayerSet(layers), available=1) is PinMode.COPY


def test_available_ram_reads_meminfo():
    ram = pinning_mod.available_ram()
    assert ram is None or ram > 0
    assert pinning_mod.machine_ram() is None or ram <= pinning_mod.machine_ram()


GIB = 2**30


def _fake_root(tmp_path, cgroup: str, mount: str, files: dict[str, str]):
    """A file system root with this process's cgroup line(s), one mountinfo line and
    the cgroup files (relative paths) a test sets."""
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(cgroup)
    (tmp_path / "proc/self/mountinfo").write_text(
        "24 30 0:22 / /proc rw,nosuid - proc proc rw\n" + mount)
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


def test_cgroup_room_of_a_v2_container(tmp_path):
    """A container sees its own cgroup as "/": the room is its limit minus what it uses,
    plus the inactive file cache the kernel reclaims before it kills."""
    root = _fake_root(tmp_path, "0::/\n",
                      "30 25 0:26 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw\n",
                      {"sys/fs/cgroup/memory.max": f"{8 * GIB}\n",
                       "sys/fs/cgroup/memory.current": f"{3 * GIB}\n",
                       "sys/fs/cgroup/memory.stat": f"anon 1\ninactive_file {GIB}\n"})
    assert pinning_mod.cgroup_room(root) == 6 * GIB
    (root / "sys/fs/cgroup/memory.max").write_text("max\n")
    assert pinning_mod.cgroup_room(root) is None


def test_cgroup_room_takes_the_tightest_level_above_a_job(tmp_path):
    """A batch job's scope under a slice: the slice's limit binds (the OOM killer acts
    on the first limit reached), at whatever level it is set."""
    job = "sys/fs/cgroup/system.slice/job.scope"
    root = _fake_root(tmp_path, "0::/system.slice/job.scope\n",
                      "30 25 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
                      {f"{job}/memory.max": f"{100 * GIB}", f"{job}/memory.current": f"{10 * GIB}",
                       "sys/fs/cgroup/system.slice/memory.max": f"{20 * GIB}",
                       "sys/fs/cgroup/system.slice/memory.current": f"{15 * GIB}"})
    assert pinning_mod.cgroup_room(root) == 5 * GIB
    (root / "sys/fs/cgroup/system.slice/memory.current").write_text(f"{21 * GIB}")
    assert pinning_mod.cgroup_room(root) == 0            # over its limit: no room


def test_cgroup_room_of_a_v1_docker_container(tmp_path):
    """cgroup v1 as Docker mounts it: the mount's root is the container's cgroup."""
    root = _fake_root(tmp_path, "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n",
                      "35 31 0:32 /docker/abc /sys/fs/cgroup/memory rw - cgroup cgroup "
                      "rw,memory\n",
                      {"sys/fs/cgroup/memory/memory.limit_in_bytes": f"{4 * GIB}",
                       "sys/fs/cgroup/memory/memory.usage_in_bytes": f"{GIB}",
                       "sys/fs/cgroup/memory/memory.stat":
                           f"cache 5\ninactive_file 7\ntotal_inactive_file {GIB // 2}\n"})
    assert pinning_mod.cgroup_room(root) == 3 * GIB + GIB // 2
    # the kernel's "no limit"
    (root / "sys/fs/cgroup/memory/memory.limit_in_bytes").write_text("9223372036854771712")
    assert pinning_mod.cgroup_room(root) is None
    assert pinning_mod.cgroup_room(tmp_path / "nowhere") is None


def test_available_ram_is_the_tighter_of_machine_and_cgroup(monkeypatch):
    monkeypatch.setattr(pinning_mod, "machine_ram", lambda: 64 * GIB)
    monkeypatch.setattr(pinning_mod, "cgroup_room", lambda: 6 * GIB)
    assert pinning_mod.available_ram() == 6 * GIB
    monkeypatch.setattr(pinning_mod, "cgroup_room", lambda: None)
    assert pinning_mod.available_ram() == 64 * GIB
    monkeypatch.setattr(pinning_mod, "machine_ram", lambda: None)
    assert pinning_mod.available_ram() is None


# -- the pipeline ------------------------------------------------------------------------

@pytest.mark.parametrize("mode", list(PinMode))
def test_pipeline_keeps_weights_and_stages_inputs_in_its_mode(mode):
    model = tiny_transformer(dim=64, widths=(128, 256))
    model[0].requires_grad_(False)                    # a frozen embedding
    x, y = step_batches((8,), 1)[0][0]
    with rotapipe.RoundPipe(model, lm_loss, config=emulated(2, 2, pin=mode),
                            optimizer=OPTIMIZERS["sgd"]) as pipe:
        assert pipe.pin_mode is PinMode(mode)
        host = pipe.host
        pinned = mode is not PinMode.OFF
        assert all(host.is_pinned(pid) == pinned for pid in range(len(host.compute)))
        stats = pipe.pinning.stats
        total = sum(t.numel() * t.element_size() for t in host.compute)
        kind = {"copy": "copied", "register": "registered", "off": "pageable"}[mode]
        assert stats[kind] == total
        store = pipe._calls.host_store([x], [y])
        assert pipe.pinning.is_pinned(store.get(("act", 0, 0)))
        assert pipe.pinning.is_pinned(store.get(("labels", 0)))
        assert torch.equal(store.get(("act", 0, 0)), x)
        pipe.forward_backward(x, y)
        assert pipe.step()
    assert pipe.pinning.stats["registered"] == 0      # closed: unregistered


def test_pipeline_register_keeps_the_callers_storages():
    model = tiny_transformer()
    before = [_storage(p) for p in model.parameters()]
    with rotapipe.RoundPipe(model, lm_loss, config=emulated(2, 2, pin="register")):
        assert [_storage(p) for p in model.parameters()] == before
    with rotapipe.RoundPipe(model, lm_loss, config=emulated(2, 2, pin="copy")):
        assert all(a != b for a, b in zip(before, [_storage(p) for p in model.parameters()]))


@pytest.mark.parametrize("mode", list(PinMode))
def test_exact_in_every_mode(mode):
    """fp32: element by element against plain PyTorch, and bitwise the default run."""
    got = run("large", 2, 3, "stage", pin=mode)
    assert_close_trained(got, reference("large", 3))
    assert_bitwise_equal(got, run("large", 1, 3, "stage"))


@pytest.mark.parametrize("mode", list(PinMode))
def test_exact_with_a_frozen_part_and_stale_copies(mode):
    """Frozen weights (kept, not mastered) and separate compute copies (``new``)."""
    def model():
        m = tiny_transformer(dim=32, widths=(64, 96))
        m[1].requires_grad_(False)
        return m
    data = step_batches((8,), 2)
    want = train_reference(model(), (8,), 2, "sgd", data=data)
    got = train_pipe(model(), (8,), emulated(2, 2, pin=mode), "sgd", data=data)
    assert_close_trained(got, want)


def test_auto_mode_off_for_a_mapped_base_in_a_pipeline(tmp_path, monkeypatch):
    layers, size, mm = _mapped_model(tmp_path)
    monkeypatch.setattr(pinning_mod, "available_ram", lambda: size)
    with rotapipe.RoundPipe(layers, lambda out, y: ((out - y) ** 2).mean(),
                            config=emulated(2, 1, tail_layers=1)) as pipe:
        assert pipe.pin_mode is PinMode.OFF
        frozen = layers[0].weight
        trainable = sum(p.numel() * 4 for p in layers[1].parameters())
        assert pipe.pinning.stats["pageable"] == size + trainable   # all model state
        x = torch.randn(4, 64)
        pipe.forward_backward(x, torch.zeros(4, 8))
        assert frozen.untyped_storage().data_ptr() == mapped_addr(mm)
    del layers, frozen, pipe
    gc.collect()


def mapped_addr(mm) -> int:
    return torch.frombuffer(mm, dtype=torch.uint8).data_ptr()


def test_resolve_logs_its_choice(caplog):
    with caplog.at_level("INFO", logger="rotapipe.runtime.pinning"):
        resolve_pin(None, False, LayerSet([nn.Linear(2, 2)]))
    assert "copy" in caplog.text and "emulated" in caplog.text
