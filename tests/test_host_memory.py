"""The host-memory count (:func:`rotapipe.plan.host_memory`, what ``rotapipe plan`` and
``rotapipe train``'s host-RAM check print) against what a live pipeline holds.

A tiny Hugging Face Qwen3 is priced by the planner's cost model from its config alone
and trained for two steps; the model state the pipeline then holds on the host is
counted tensor by tensor (every storage once):

- weights and masters: the compute copies workers upload (every set of them) and the
  fp32 masters the optimizer steps, in fp32 and bf16, with a tied and an untied head,
  full fine-tuning and LoRA, in each optimizer mode's layout (``stale`` keeps two
  compute copies; an fp32 master is its own compute copy elsewhere);
- the optimizer state (AdamW's two moments, SGD's momentum);
- with ``sync``, the fp32 gradients the optimizer is given.

Each must equal the count byte for byte.
"""

from __future__ import annotations

import pytest
import torch

import rotapipe
from models import emulated
from rotapipe.plan import hardware, host_memory, lora_params, model_costs
from rotapipe.plan.hostmem import size_text

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

B, T, M, W = 4, 16, 2, 2
RANK = 4


def _model(tied: bool, lora: bool):
    config = transformers.Qwen3Config(
        vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=64, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config)
    if lora:
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=RANK, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    return config, model


def _held(pipe, opt) -> tuple[int, int]:
    """(bytes of every compute copy and master, bytes of the optimizer state), each
    storage once."""
    seen: set[int] = set()

    def size(t: torch.Tensor) -> int:
        s = t.untyped_storage()
        if s.data_ptr() in seen:
            return 0
        seen.add(s.data_ptr())
        return s.nbytes()
    params = pipe.layerset.params
    copies = sum(size(t) for view in pipe.host.views for t in view)
    copies += sum(size(params[pid].data) for pid in pipe.host.trainable)
    state = sum(size(v) for s in opt.state.values() for k, v in s.items()
                if torch.is_tensor(v) and k != "step")
    return copies, state


def _two_steps(pipe, opt) -> tuple[int, int]:
    """Two training steps with ``opt`` attached, then :func:`_held`; closes ``pipe``."""
    with pipe:
        pipe.attach_optimizer(opt)
        g = torch.Generator().manual_seed(1)
        for _ in range(2):
            x = torch.randint(0, 211, (B, T), generator=g)
            pipe.train_step(x, torch.roll(x, -1, 1))
        pipe.flush()
        return _held(pipe, opt)


CASES = [   # optimizer mode (lean: overlap without undo), dtype, tied head, LoRA, optimizer
    ("sync", "float32", False, False, "adamw"),
    ("sync", "bfloat16", True, False, "adamw"),
    ("sync", "bfloat16", False, False, "sgd"),
    ("overlap", "bfloat16", False, False, "adamw"),
    ("lean", "float32", True, False, "adamw"),
    ("stale", "bfloat16", False, False, "adamw"),
    ("stale", "float32", True, False, "sgd"),
    ("sync", "bfloat16", True, True, "adamw"),
    ("stale", "float32", False, True, "adamw"),
]


@pytest.mark.parametrize("mode,dtype,tied,lora,optimizer", CASES)
def test_host_memory_counts_the_model_state_a_pipeline_holds(mode, dtype, tied, lora,
                                                             optimizer):
    config, model = _model(tied, lora)
    wrapped = rotapipe.adapters.wrap_hf(model)
    pipe = wrapped.pipe(emulated(
        W, M, optimizer_mode="overlap" if mode == "lean" else mode,
        undo_steps=mode != "lean",
        precision=rotapipe.PrecisionConfig(compute_dtype=dtype)))
    params = list(pipe.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3) if optimizer == "adamw" else \
        torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    grads = []
    opt.register_step_pre_hook(lambda o, a, k: grads.append(
        sum(p.grad.nbytes for g in o.param_groups for p in g["params"]
            if p.grad is not None)))
    copies, state = _two_steps(pipe, opt)
    plan = pipe.plan
    dtype_bytes = 4 if dtype == "float32" else 2
    costs = model_costs(config.to_dict(), hardware("rtx4090x2"), seq=T,
                        microbatch_size=B // M, dtype_bytes=dtype_bytes,
                        call_tokens=B * T)
    assert costs.shared_bytes == (211 * 64 * dtype_bytes if tied else 0)
    want = host_memory(costs, plan, M, W, dtype_bytes=dtype_bytes, staged_grads=False,
                       trainable_params=lora_params(config, RANK) if lora else None,
                       optimizer_states=2 if optimizer == "adamw" else 1, layout=mode)
    n_train = sum(p.numel() for p in params)
    assert want.masters == 4 * n_train
    assert copies == want.weights + want.masters
    assert state == want.optimizer
    if mode == "sync":
        assert grads and set(grads) == {want.gradients}


# -- rotapipe train's host-RAM check ---------------------------------------------------

TRAIN = [   # optimizer mode, dtype, LoRA, tied head, optimizer
    ("sync", "fp32", False, True, "adamw"),
    ("overlap", "bf16", False, False, "adamw"),
    ("stale", "bf16", True, True, "adamw"),
    ("sync", "bf16", False, False, "sgd"),
    ("overlap", "fp32", True, False, "adamw"),
]


def _train_config(path, **kw):
    from rotapipe.train import TrainConfig
    return TrainConfig(model=str(path), seq=T, batch=B, microbatches=M, workers=W,
                       backend="emulated", progress=False, lr=1e-3, lora_rank=RANK,
                       **kw).effective()


@pytest.mark.parametrize("mode,dtype,lora,tied,optimizer", TRAIN)
def test_train_prices_the_model_state_the_run_holds(tmp_path, mode, dtype, lora, tied,
                                                    optimizer):
    """``host_state`` (the meta-device count ``rotapipe train`` checks before loading)
    equals what the pipeline ``rotapipe train`` builds holds after two steps."""
    from rotapipe.train.setup import make_optimizer
    from rotapipe.train.model import build_model, host_state
    _model(tied, False)[1].save_pretrained(tmp_path / "m")
    cfg = _train_config(tmp_path / "m", optimizer_mode=mode, dtype=dtype, lora=lora,
                        optimizer=optimizer)
    want = host_state(cfg, None)
    assert want.layout == mode
    pipe = rotapipe.adapters.wrap_hf(build_model(cfg, None)).pipe(cfg.pipe_config())
    n_train = sum(p.numel() for p in pipe.parameters())
    copies, state = _two_steps(pipe, make_optimizer(cfg, pipe))
    assert want.masters == 4 * n_train
    assert copies == want.weights + want.masters
    assert state == want.optimizer
    if mode == "overlap":
        assert want.snapshots == want.masters + want.optimizer


def _job(tmp_path, **kw):
    from train_util import text_jsonl, tiny_model_dir
    model = tiny_model_dir(tmp_path / "m")
    return _train_config(model, data=str(text_jsonl(tmp_path / "d.jsonl", n=40)),
                         out_dir=str(tmp_path / "out"), steps=1, **kw)


def test_train_refuses_a_run_whose_state_exceeds_the_ram_before_loading(tmp_path,
                                                                       monkeypatch):
    from rotapipe.train import loop, train
    from rotapipe.train.model import host_state
    cfg = _job(tmp_path, optimizer_mode="overlap")
    overlap, sync = host_state(cfg, None).state, \
        host_state(cfg.replace(optimizer_mode="sync"), None).state
    assert sync < overlap
    loaded = []
    monkeypatch.setattr(loop, "build_model", lambda *a: loaded.append(a) or 1 / 0)
    monkeypatch.setattr("rotapipe.runtime.pinning.available_ram",
                        lambda: (sync + overlap) // 2)
    with pytest.raises(rotapipe.ConfigError) as e:
        train(cfg, echo=lambda *a: None)
    text = str(e.value)
    assert "model state needs" in text and "snapshots" in text
    assert "--optimizer-mode sync" in text and "(fits)" in text
    assert "--no-host-ram-check" in text
    assert not loaded                   # refused before any weight was loaded
    # the same machine runs it in sync, and host_ram_check=False runs it anyway
    for fine in (cfg.replace(optimizer_mode="sync"), cfg.replace(host_ram_check=False)):
        with pytest.raises(ZeroDivisionError):
            train(fine, echo=lambda *a: None)
    assert len(loaded) == 2


def test_a_run_from_scratch_is_not_told_to_use_lora():
    """LoRA needs pretrained weights (``--lora`` without ``--model`` is refused), so a
    from-scratch run over the RAM is offered the other fixes, never ``--lora``."""
    from rotapipe.train import TrainConfig
    from rotapipe.train.model import check_host_ram, host_state
    cfg = TrainConfig(layers=2, dim=64, heads=2, vocab=512, seq=32, batch=2,
                      microbatches=2, workers=2, backend="emulated", optimizer_mode="stale")
    from train_util import chat_tokenizer
    tok = chat_tokenizer()
    need = host_state(cfg, tok).state
    with pytest.raises(rotapipe.ConfigError) as e:
        check_host_ram(cfg, tok, available=need // 2)
    assert "--lora" not in str(e.value), str(e.value)
    assert "--optimizer-mode sync" in str(e.value)


def test_cli_flag_turns_the_host_ram_check_off():
    import argparse
    from rotapipe.cli import _train_arguments
    p = argparse.ArgumentParser()
    _train_arguments(p)
    assert p.parse_args(["--no-host-ram-check"]).host_ram_check is False


def test_host_ram_example_runs(capsys):
    """examples/host_ram.py on Qwen3-1.7B's shipped config: the modes' model states in
    their order (stale above sync by a second bf16 copy and the next call's gradients;
    overlap's snapshots), and the
    check's refusal of overlap at 40 GB naming sync as fitting."""
    import pathlib
    import runpy
    import sys

    script = pathlib.Path(__file__).resolve().parents[1] / "examples" / "host_ram.py"
    argv = sys.argv
    sys.argv = [str(script), "--available-gb", "40"]
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = argv
    out = capsys.readouterr().out
    gb = {line.rsplit(" GB", 1)[0].rsplit(None, 1)[0].strip():
          float(line.rsplit(" GB", 1)[0].rsplit(None, 1)[1])
          for line in out.splitlines() if line.endswith(("yes", "no"))}
    params = 1.72e9     # Qwen3-1.7B, its head tied to the embedding
    sync = gb["full, sync, fp32 state"]
    assert abs(sync - 18 * params / 1e9) < 0.2      # bf16 copy, master, 2 moments, grad
    # stale (the example's runs clip): a second bf16 copy, the next call's bf16 gradients
    assert abs(gb["full, stale, fp32 state"] - sync - 4 * params / 1e9) < 0.1
    assert abs(gb["full, overlap, fp32 state"] - sync - 12 * params / 1e9) < 0.2
    assert gb["LoRA r=16, sync, fp32 state"] < 4
    assert "--optimizer-mode sync: 31.0 GB (fits)" in out


@pytest.mark.parametrize("mode,dtype,tied", [("sync", "fp32", True), ("overlap", "bf16", False),
                                             ("stale", "bf16", True)])
def test_plan_check_counts_what_the_built_pipeline_already_holds(tmp_path, mode, dtype,
                                                                 tied):
    """``check_run_ram`` (after the pipeline is built): the weights and masters it counts
    as held now (:func:`plan_memory`, on the pipeline's own plan) are the bytes the new
    pipeline holds, and its model state is the count made before loading."""
    from rotapipe.train.model import build_model, check_run_ram, host_state, plan_memory
    _model(tied, False)[1].save_pretrained(tmp_path / "m")
    cfg = _train_config(tmp_path / "m", optimizer_mode=mode, dtype=dtype)
    with rotapipe.adapters.wrap_hf(build_model(cfg, None)).pipe(cfg.pipe_config()) as pipe:
        copies, _ = _held(pipe, torch.optim.SGD([torch.zeros(1)], lr=1.0))
        mem = plan_memory(cfg, pipe, None)
        line = check_run_ram(cfg, pipe, None, available=10**12)
    assert mem.weights + mem.masters == copies
    assert mem.state == host_state(cfg, None).state
    assert mem.checkpoints > 0 and mem.pinned_buffers > 0
    assert line.startswith(f"host RAM for the plan: {mem.describe()}; ")


def test_a_container_limit_below_the_machine_ram_is_what_the_check_uses(tmp_path,
                                                                        monkeypatch):
    """Inside a container or a batch job, the machine's free RAM is not what the
    kernel's OOM killer goes by: the memory cgroup's limit is, and the refusal says
    so."""
    from rotapipe.train import loop, train
    from rotapipe.train.model import check_host_ram, host_state
    cfg = _job(tmp_path)
    need = host_state(cfg, None).state
    monkeypatch.setattr("rotapipe.runtime.pinning.machine_ram", lambda: 1000 * need)
    monkeypatch.setattr("rotapipe.runtime.pinning.cgroup_room", lambda: need // 2)
    monkeypatch.setattr(loop, "build_model", lambda *a: 1 / 0)
    with pytest.raises(rotapipe.ConfigError, match="memory cgroup limit") as e:
        train(cfg, echo=lambda *a: None)
    assert size_text(need // 2) + " is available under" in str(e.value)
    monkeypatch.setattr("rotapipe.runtime.pinning.cgroup_room", lambda: 2 * need)
    line = check_host_ram(cfg, None)
    assert "memory cgroup limit" in line and size_text(2 * need) in line
    monkeypatch.setattr("rotapipe.runtime.pinning.cgroup_room", lambda: None)
    assert "cgroup" not in check_host_ram(cfg, None)


def test_train_refuses_a_plan_that_does_not_fit_before_its_first_step(tmp_path,
                                                                     monkeypatch):
    from rotapipe.train import setup, train
    cfg = _job(tmp_path)
    monkeypatch.setattr(setup, "check_host_ram", lambda *a: "host RAM: (passed)")
    monkeypatch.setattr("rotapipe.runtime.pinning.available_ram", lambda: 1000)
    with pytest.raises(rotapipe.ConfigError) as e:
        train(cfg, echo=lambda *a: None)
    text = str(e.value)
    assert "on its plan F0[" in text and "more is to come" in text
    assert "--no-host-ram-check" in text
    assert not (tmp_path / "out" / "metrics.jsonl").exists()      # no step ran
    # host_ram_check=False runs it (one step)
    train(cfg.replace(host_ram_check=False), echo=lambda *a: None)
    assert (tmp_path / "out" / "metrics.jsonl").exists()
