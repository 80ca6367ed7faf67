"""The files of a ``rotapipe train`` checkpoint: CRC-32s of every file, so bytes changed
after the save while the size stays (a flipped bit on disk) are found and the resume
falls back to the newest whole checkpoint; a save that fails while writing (a full
disk) leaves nothing of itself and says what is kept; tied weights round-trip; a
read-only ``checkpoints/`` is refused before training."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

import rotapipe.train.checkpoint as ckpt
from rotapipe.errors import CheckpointError
from rotapipe.train.checkpoint import resume_from, save_checkpoint


def _save(ckdir, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    masters = {"w": torch.randn(64, 64, generator=g), "b": torch.randn(64, generator=g)}
    state = {"step": step, "tokens": 10 * step, "scheduler": {}, "pipe": {}, "rng": {},
             "data": {}, "optimizer": {"state": {0: {"exp_avg": torch.randn(64, 64, generator=g)}},
                                       "param_groups": []}}
    meta = {"step": step, "config": {"steps": 10}, "fingerprint": {"params": {}}}
    save_checkpoint(ckdir, step, masters=masters, state=state, meta=meta, keep=3)


def _flip(f, where: float = 0.75) -> None:
    """One bit of ``f`` flipped in place: same size, still readable."""
    data = bytearray(f.read_bytes())
    data[int(len(data) * where)] ^= 0x04
    f.write_bytes(bytes(data))


@pytest.mark.parametrize("name", ["masters.safetensors", "state.pt"])
def test_a_bit_flipped_keeping_the_size_is_found(tmp_path, caplog, name):
    """Flipping one bit deep in a tensor's bytes used to resume silently from the
    changed checkpoint: a master weight or an ``exp_avg`` differed, the manifest's
    sizes agreed, the values were finite and ``torch.load`` read it."""
    ckdir = tmp_path / "checkpoints"
    _save(ckdir, 2)
    _save(ckdir, 4)
    latest = ckdir / "step-00000004"
    _flip(latest / name)
    path, masters, state, _ = resume_from(ckdir, True)
    assert path.name == "step-00000002" and state["step"] == 2
    assert f"checkpoint {latest}: {name} has CRC-32 " in caplog.text, caplog.text
    assert "was written (its bytes changed after the save): skipping it" in caplog.text
    assert "damaged: step-00000004" in caplog.text


def test_whole_and_older_manifests_still_resume(tmp_path):
    """An unchanged checkpoint resumes; a manifest of sizes alone (written before
    checksums) is checked by size, as before."""
    ckdir = tmp_path / "checkpoints"
    _save(ckdir, 2)
    path, _, state, _ = resume_from(ckdir, True)
    assert path.name == "step-00000002" and state["step"] == 2
    manifest = path / "manifest.json"
    entries = json.loads(manifest.read_text())
    assert set(entries["masters.safetensors"]) == {"bytes", "crc32"}
    manifest.write_text(json.dumps({k: v["bytes"] for k, v in entries.items()}))
    assert resume_from(ckdir, True)[0] == path


@pytest.mark.parametrize("failing", ["masters", "state"])
def test_a_save_failing_on_a_full_disk_leaves_nothing_and_says_what_is_kept(
        tmp_path, monkeypatch, failing):
    """A write that fails half-way (safetensors: "I/O error"; ``torch.save``: "unexpected
    pos 295104 vs 295056") used to leave its partial ``.tmp-`` directory, holding the
    space a full disk lacks until the next save, and reach the user as that bare
    message."""
    ckdir = tmp_path / "checkpoints"
    _save(ckdir, 2)

    def full(obj, f, *args, **kwargs):
        with open(f, "wb") as fh:
            fh.write(b"x" * 100)                       # what fitted
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos "
                           "295104 vs 295056")
    if failing == "masters":
        import safetensors.torch
        monkeypatch.setattr(safetensors.torch, "save_file", full)
    else:
        monkeypatch.setattr(ckpt.torch, "save", full)
    with pytest.raises(CheckpointError) as err:
        _save(ckdir, 4)
    msg = str(err.value)
    assert f"writing checkpoint {ckdir / 'step-00000004'} failed (RuntimeError: " in msg
    assert "unexpected pos 295104 vs 295056; " in msg and " MB free there" in msg
    assert "nothing of it was kept, the previous checkpoints are intact (newest: " \
        "step-00000002). Free space" in msg and "--resume" in msg
    assert sorted(p.name for p in ckdir.iterdir()) == ["step-00000002"]
    monkeypatch.undo()
    assert resume_from(ckdir, True)[0].name == "step-00000002"


def test_pipe_state_dict_with_tied_weights_round_trips(tmp_path):
    """``save_checkpoint(masters=pipe.state_dict())`` of a model whose head reuses the
    embedding used to fail in safetensors ("Some tensors share memory"); the tied key is
    now written once and read back under both keys, as one tensor, into
    ``pipe.load_state_dict`` of another pipeline (strict)."""
    import rotapipe
    from models import emulated, lm_loss, tiny_transformer, token_batch
    from rotapipe.train import load_checkpoint
    with rotapipe.RoundPipe(tiny_transformer(tied=True), lm_loss,
                            config=emulated(2, 2)) as pipe:
        pipe.attach_optimizer(torch.optim.AdamW(pipe.parameters(), lr=1e-2))
        pipe.train_step(*token_batch())
        saved = {k: v.clone() for k, v in pipe.state_dict().items()}
        save_checkpoint(tmp_path, 1, masters=pipe.state_dict(), state={}, meta={})
    masters, _, _ = load_checkpoint(tmp_path / "step-00000001")
    assert masters.keys() == saved.keys()
    assert masters["0.emb.weight"] is masters["5.tied.weight"]
    with rotapipe.RoundPipe(tiny_transformer(tied=True, seed=3), lm_loss,
                            config=emulated(2, 2)) as pipe:
        pipe.load_state_dict(masters)
        for k, v in pipe.state_dict().items():
            assert torch.equal(v, saved[k]), k


def test_a_state_that_cannot_be_saved_is_not_blamed_on_the_disk(tmp_path):
    """Only a failed write gets the full-disk advice; a state ``torch.save`` cannot pickle
    raises its own error, and leaves nothing behind either."""
    import pickle
    with pytest.raises((pickle.PicklingError, AttributeError)):
        save_checkpoint(tmp_path, 1, masters={"w": torch.zeros(2)}, state={"f": lambda: 0},
                        meta={})
    assert list(tmp_path.iterdir()) == []


def test_a_read_only_checkpoints_folder_is_refused_before_training(tmp_path, monkeypatch):
    """``out_dir`` writable but its ``checkpoints/`` not (a copy from read-only storage):
    refused up front, not after training until the first save."""
    from rotapipe.errors import ConfigError
    from rotapipe.train.checkpoint import check_out_dir
    (tmp_path / "checkpoints").mkdir()
    check_out_dir(tmp_path)
    real = ckpt.os.access
    monkeypatch.setattr(ckpt.os, "access", lambda p, mode: real(p, mode) and
                        pathlib.Path(p).name != "checkpoints")
    with pytest.raises(ConfigError, match="checkpoints/ cannot be written .*--out-dir"):
        check_out_dir(tmp_path)
