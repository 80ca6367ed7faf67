"""The model and tokenizer a run trains: a local Hugging Face model (optionally with a
LoRA adapter), or a Qwen3-architecture model from scratch with a BPE trained on the data.
"""

from __future__ import annotations

import pathlib
from dataclasses import replace

import torch
from torch import nn

from ..errors import ConfigError, InputError
from ..plan.hostmem import size_text
from .config import TrainConfig
from .data import TextFields, train_tokenizer
from .records import data_fingerprint
from .hub import is_hub_id, snapshot

__all__ = ["build_tokenizer", "build_model", "fingerprint", "check_sequence_length",
           "check_weight_files", "resolve_model", "adapter_dir", "host_state",
           "check_host_ram", "plan_memory", "check_run_ram", "folded_expert_note",
           "model_files"]


def _model_dir(cfg: TrainConfig) -> pathlib.Path:
    return resolve_model(cfg.model)


def resolve_model(name: str) -> pathlib.Path:
    """The local directory of ``model``: the directory itself, or for a hub id
    (``org/name``) its snapshot in the Hugging Face cache (``HF_HUB_CACHE`` /
    ``HF_HOME``), downloaded first unless ``HF_HUB_OFFLINE=1``."""
    p = pathlib.Path(name)
    if not p.is_dir():
        if not is_hub_id(name):
            raise ConfigError(f"model directory {name!r} does not exist: check the path, "
                              "pass a hub id (org/name), or leave model unset to train from "
                              "scratch")
        p = snapshot(name, "model", patterns=_HUB_FILES)
    if not (p / "config.json").is_file():
        raise ConfigError(f"model directory {name!r} has no config.json: pass the "
                          "directory save_pretrained wrote")
    return p


_HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
"""What a fine-tuning run needs from a hub repository (not .bin/.pth/.gguf copies)."""


def adapter_dir(cfg: TrainConfig) -> pathlib.Path | None:
    """``resume_from_adapter`` checked: a PEFT adapter directory."""
    if cfg.resume_from_adapter is None:
        return None
    p = pathlib.Path(cfg.resume_from_adapter)
    if not (p / "adapter_config.json").is_file():
        raise ConfigError(f"resume_from_adapter {cfg.resume_from_adapter!r} "
                          f"{'has no adapter_config.json' if p.is_dir() else 'is not a directory'}"
                          ": pass the directory a LoRA run exported (its final/)")
    return p


def model_files(cfg: TrainConfig) -> dict[str, list]:
    """``{file name: [size, hash of its ends]}`` (:func:`~rotapipe.train.records.
    data_fingerprint`) of a pretrained model's ``config.json`` and ``*.safetensors``,
    kept in a checkpoint's ``meta.json``: a resume on other weights under the same
    ``model`` name (files replaced in the directory, a hub id whose cache moved to a new
    revision) is then seen (:func:`rotapipe.train.resume.check_model_files`). From
    scratch: ``{}``."""
    if cfg.model is None:
        return {}
    folder = _model_dir(cfg)
    found = data_fingerprint([folder / "config.json",
                              *sorted(folder.glob("*.safetensors"))])
    return {pathlib.Path(f).name: v for f, v in found.items()}


def check_sequence_length(cfg: TrainConfig) -> None:
    """A fine-tuned model's ``max_position_embeddings`` must cover ``seq`` (checked from
    config.json, before any weight is loaded)."""
    if cfg.model is None:
        return
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(_model_dir(cfg))
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - transformers raises OSError, ValueError...
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        raise ConfigError(f"model directory {cfg.model!r}: config.json cannot be read "
                          f"({type(exc).__name__}: {first})") from None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit = getattr(text, "max_position_embeddings", None)
    if limit is not None and cfg.seq > limit:
        raise ConfigError(f"seq={cfg.seq} is longer than the model supports "
                          f"(max_position_embeddings={limit} in {cfg.model}/config.json): "
                          f"use --seq {limit} or less")


def check_weight_files(cfg: TrainConfig) -> None:
    """Every ``*.safetensors`` file of a fine-tuned model opens (its header and its size
    agree), before the tokenizer and the host-RAM check: a truncated or overwritten file
    otherwise failed in ``from_pretrained`` as an "unexpected SafetensorError" naming no
    file. Reads the headers only."""
    if cfg.model is None:
        return
    from safetensors import safe_open

    for f in sorted(_model_dir(cfg).glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt"):
                pass
        except Exception as exc:  # noqa: BLE001 - safetensors' own error type, OSError
            first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
            raise InputError(f"model weights {str(f)!r} cannot be read ({first}): the file "
                             "is damaged or truncated; save or download the model again")\
                from None


def build_tokenizer(cfg: TrainConfig, files, saved: pathlib.Path | None = None):
    """The model's tokenizer; from scratch, the one saved in ``saved`` (a checkpoint's)
    or a byte-level BPE trained on the training split."""
    from transformers import AutoTokenizer

    if saved is not None and saved.is_dir():
        return AutoTokenizer.from_pretrained(str(saved))
    if cfg.model is not None:
        return AutoTokenizer.from_pretrained(str(_model_dir(cfg)))
    fields = TextFields(cfg.text_field, cfg.prompt_field, cfg.response_field)
    return train_tokenizer(files, cfg.vocab, cfg.tokenizer_bytes, fields, cfg.holdout)


def build_model(cfg: TrainConfig, tokenizer) -> nn.Module:
    """The causal LM on the CPU, fp32, initialised from ``cfg.seed`` when from scratch;
    a PEFT model around it with ``cfg.lora`` or ``cfg.qlora``."""
    import transformers

    if cfg.model is not None:
        from ..adapters import load_hf
        # LoRA: the frozen base is loaded in the compute dtype (it is kept in it anyway),
        # so host RAM never holds an fp32 copy of it; trainable weights are fp32.
        from ..config import resolve_dtype
        dtype = resolve_dtype(cfg.dtype) if cfg.lora or cfg.resume_from_adapter else \
            torch.float32
        model = load_hf(str(_model_dir(cfg)), dtype=dtype)
    else:
        torch.manual_seed(cfg.seed)
        model = transformers.Qwen3ForCausalLM(_scratch_config(cfg, tokenizer))
    adapter = adapter_dir(cfg)
    if adapter is not None:
        import peft
        model = peft.PeftModel.from_pretrained(model, str(adapter), is_trainable=True)
    elif cfg.lora or cfg.qlora:
        torch.manual_seed(cfg.seed + 1)
        model = _with_lora(model, cfg)
    return model


def _scratch_config(cfg: TrainConfig, tokenizer):
    """The Qwen3 config of a model trained from scratch with ``tokenizer``."""
    import transformers
    return transformers.Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=cfg.dim,
        intermediate_size=cfg.ffn or 3 * cfg.dim, num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads or cfg.heads,
        head_dim=cfg.dim // cfg.heads, max_position_embeddings=cfg.seq,
        tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id,
        attn_implementation="sdpa")


def _with_lora(model: nn.Module, cfg: TrainConfig,
               adapter: pathlib.Path | None = None) -> nn.Module:
    """``model`` with new LoRA adapters of ``cfg.lora_rank`` on ``cfg.lora_targets``; with
    ``adapter`` (a PEFT adapter directory), adapters of its own shape (its
    ``adapter_config.json``: rank, per-layer ranks, targets), not yet loaded."""
    import peft
    if adapter is not None:
        try:
            config = peft.PeftConfig.from_pretrained(str(adapter))
        except Exception as exc:  # noqa: BLE001 - peft raises ValueError, TypeError...
            first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
            raise ConfigError(f"resume_from_adapter {str(adapter)!r}: adapter_config.json "
                              f"cannot be read ({type(exc).__name__}: {first}): pass the "
                              "directory a LoRA run exported (its final/)") from None
        config.inference_mode = False          # a saved adapter says True: trainable
        return peft.get_peft_model(model, config)
    targets = cfg.lora_targets if cfg.lora_targets == "all-linear" else \
        [t.strip() for t in cfg.lora_targets.split(",") if t.strip()]
    return peft.get_peft_model(model, peft.LoraConfig(
        r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, target_modules=targets,
        lora_dropout=0.0, task_type="CAUSAL_LM"))


def folded_expert_note(model: nn.Module) -> str | None:
    """What LoRA on fused expert stacks costs, or ``None`` when no adapter wraps one.

    PEFT adapts a whole parameter (``target_parameters``, and ``all-linear`` on the fused
    ``experts.gate_up_proj`` / ``down_proj`` of Qwen3-MoE, Mixtral, DeepSeek-V3 and
    others in transformers 5) with a ``ParamWrapper``: every forward call adds the
    product of its low-rank factors to the whole stack, a temporary as large as the
    stack, and runs the stack's matrix product with it, for every microbatch and
    recompute. rotapipe's planner prices LoRA as adapters on linear layers, so this
    is work and device memory it does not see; the note says so and names the targets
    that leave the experts frozen."""
    try:
        from peft.tuners.lora.layer import LoraLayer, ParamWrapper
    except ImportError:
        return None
    stacks: dict[str, int] = {}
    count, others = 0, set()
    for name, module in model.named_modules():
        if isinstance(module, ParamWrapper):
            param = module.get_param()
            if param.dim() == 3 and param.shape[0] > 1:        # experts x in x out
                count += 1
                block = name.rsplit(".experts", 1)[0]
                stacks[block] = stacks.get(block, 0) + param.numel() * param.element_size()
        elif isinstance(module, LoraLayer):
            others.add(name.rsplit(".", 1)[-1])
    if not count:
        return None
    keep = f"--lora-targets {','.join(sorted(others))}" if others else \
        "--lora-targets with the attention's layer names"
    return (f"LoRA adapts {count} fused expert stacks: on every forward and recompute PEFT "
            "adds B·A to each whole stack (device temporaries of at least "
            f"{size_text(max(stacks.values()))} per block, and the matching compute), which "
            f"the planner does not price; {keep} adapts those layers alone (the experts "
            "frozen)")


# -- host RAM, before any weight is loaded -------------------------------------------------

def host_state(cfg: TrainConfig, tokenizer, ranks: int = 1, local_ranks: int = 1):
    """The host bytes of this run's model state on this machine
    (:class:`rotapipe.plan.HostMemory`, whose :attr:`~rotapipe.plan.HostMemory.state`
    holds them), or ``None`` when the model cannot be built on the meta device.

    The model is built on the meta device (no weight is read or allocated), with its
    LoRA adapters when the run has them, and its parameters counted once each (a tied
    head holds the embedding's weight). :func:`rotapipe.plan.host_memory` then counts
    them as the runtime keeps them in the run's optimizer mode, compute dtype, optimizer
    and optimizer-state dtype, with one call per step; under ``torchrun`` each of the
    ``ranks`` holds its share (:func:`rotapipe.plan.hostmem.per_server` in the run's
    shard mode), and ``local_ranks`` of them run on this machine. An adapter to resume
    (``resume_from_adapter``) is priced with its own shape, from its
    ``adapter_config.json`` (the run's ``lora_rank`` is not the adapter's). QLoRA prices every
    frozen parameter of the decoder blocks as NF4 (norms too: a slight undercount)."""
    import transformers
    from ..plan import LayerCost, ModelCosts, even_plan
    from ..plan.hostmem import per_server

    try:
        with torch.device("meta"):
            if cfg.model is None:
                model = transformers.Qwen3ForCausalLM(_scratch_config(cfg, tokenizer))
            else:
                config = transformers.AutoConfig.from_pretrained(_model_dir(cfg))
                model = transformers.AutoModelForCausalLM.from_config(config)
            if _lora(cfg):
                model = _with_lora(model, cfg, adapter_dir(cfg))
    except ConfigError:
        raise
    except Exception:  # noqa: BLE001 - a family this transformers cannot build on meta
        return None
    # Layers as the planner counts them: embedding, decoder blocks (the rest), head.
    where = {id(p): 0 for p in model.get_input_embeddings().parameters()}
    head = model.get_output_embeddings()
    for p in head.parameters() if head is not None else ():
        where.setdefault(id(p), 2)
    held, trained = _by_layer(cfg, ((where.get(id(p), 1), p) for p in model.parameters()),
                              3)                # model.parameters(): a tied weight once
    costs = ModelCosts(tuple(LayerCost(name, 0.0, 0.0, 0.0,
                                       weight_bytes=n * _dtype_bytes(cfg))
                             for name, n in zip(("embed", "blocks", "head"), held)), 1)
    mem = _priced(cfg, costs, even_plan(3, 1, 1), 1, trained)
    mem = per_server(mem, ranks, getattr(cfg.shard, "value", cfg.shard))
    return replace(mem, **{k: getattr(mem, k) * local_ranks for k in
                           ("weights", "masters", "optimizer", "gradients", "snapshots")})


def check_host_ram(cfg: TrainConfig, tokenizer, ranks: int = 1, local_ranks: int = 1,
                   available: int | None = None) -> str:
    """Refuse (:class:`ConfigError`) a run whose model state alone (:func:`host_state`:
    a lower bound, before activations and transfer buffers) is more than the host RAM
    available to new allocations (``available``; default
    :func:`rotapipe.runtime.pinning.available_ram`), naming settings that fit. Returns
    the summary line the run prints."""
    if not cfg.host_ram_check:
        return "host RAM: not checked (host_ram_check=False)"
    mem = host_state(cfg, tokenizer, ranks, local_ranks)
    available, whose = _available(available)
    if mem is None or available is None:
        why = "the model cannot be built on the meta device" if mem is None else \
            "the available RAM is unknown"
        return f"host RAM: not checked ({why})"
    machine = f" ({local_ranks} ranks on this machine)" if local_ranks > 1 else ""
    line = (f"host RAM: model state {mem.describe_state()}{machine}, of "
            f"{size_text(available)} available{whose}")
    if mem.state <= available:
        return line
    fixes = []
    for flag, change in _SMALLER:
        if all(getattr(cfg, k) == v for k, v in change.items()):
            continue
        if change.get("lora") and not cfg.pretrained:
            continue            # LoRA needs pretrained weights (TrainConfig.effective)
        other = host_state(cfg.replace(**change), tokenizer, ranks, local_ranks)
        if other is not None and other.state < mem.state:
            fits = "fits" if other.state <= available else "does not fit either"
            fixes.append(f"{flag}: {size_text(other.state)} ({fits})")
    raise ConfigError(
        f"this run's model state needs {mem.describe_state()} of host RAM{machine} "
        f"before activations and buffers, and {size_text(available)} is available"
        f"{whose}: the kernel's out-of-memory killer would stop it. Free memory or add "
        "RAM, or shrink the state: " + "; ".join(
            fixes or ["--lora" if cfg.pretrained else "a smaller model (--layers, --dim)"])
        + ". (--no-host-ram-check "
        "runs it anyway, e.g. with swap.)")


def plan_memory(cfg: TrainConfig, pipe, tokenizer):
    """The whole host count of this run on the pipeline's own plan
    (:func:`rotapipe.plan.host_memory`: the model state plus activation checkpoints,
    gradient staging and bounce buffers; layer sizes from the pipeline, activation sizes
    from the model's config), or ``None`` when the cost model cannot price the model's
    activations."""
    from ..plan import hardware, model_costs
    from ..plan.configs import load_config

    config = _scratch_config(cfg, tokenizer) if cfg.model is None else \
        load_config(_model_dir(cfg))
    dtype_bytes = _dtype_bytes(cfg)
    ls = pipe.layerset
    try:
        costs = model_costs(config, hardware("rtx4090"), seq=cfg.seq,
                            microbatch_size=cfg.batch // cfg.microbatches,
                            dtype_bytes=dtype_bytes, call_tokens=cfg.batch * cfg.seq)
    except ConfigError:
        return None
    if len(costs.layers) != len(ls):
        return None
    # Each layer's parameters as the pipeline holds them; a tensor two layers share
    # (a tied head) once, in the first.
    first: dict[int, int] = {}
    for i, pids in enumerate(ls.layer_params):
        for pid in pids:
            first.setdefault(pid, i)
    held, trained = _by_layer(cfg, ((first[pid], p) for pid, p in enumerate(ls.params)),
                              len(ls))
    last = len(ls) - 1
    shared = sum(ls.params[pid].numel() for pid in ls.layer_params[last]
                 if first[pid] < last)
    costs = replace(costs, shared_bytes=shared * dtype_bytes, layers=tuple(
        replace(c, weight_bytes=(n + (shared if i == last else 0)) * dtype_bytes)
        for i, (c, n) in enumerate(zip(costs.layers, held))))
    return _priced(cfg, costs, pipe.plan, len(pipe.devices), trained, pin=pipe.pin_mode)


def check_run_ram(cfg: TrainConfig, pipe, tokenizer, available: int | None = None) -> str:
    """After the pipeline is built and before its first step: refuse
    (:class:`ConfigError`) a run whose whole host count on the pipeline's own plan
    (:func:`plan_memory`) does not fit. The compute copies and masters the pipeline
    already holds are not counted again: the rest must fit in the RAM available now.
    One process only (under ``torchrun`` :func:`check_host_ram` alone runs). Returns the
    summary line."""
    if not cfg.host_ram_check:
        return "host RAM for the plan: not checked (host_ram_check=False)"
    available, whose = _available(available)
    if available is None:
        return "host RAM for the plan: not checked (the available RAM is unknown)"
    mem = plan_memory(cfg, pipe, tokenizer)
    if mem is None:
        return "host RAM for the plan: not checked (the cost model does not price " \
            "this model's activations)"
    held_now = mem.weights + mem.masters
    more = mem.total - held_now - mem.transient
    line = (f"host RAM for the plan: {mem.describe()}; {size_text(held_now)} of it held "
            f"now, {size_text(more)} to come of {size_text(available)} available{whose}")
    if more <= available:
        return line
    raise ConfigError(
        f"this run needs {mem.describe()} of host RAM on its plan "
        f"{pipe.plan.to_text()}: {size_text(held_now)} of weights and masters are loaded and "
        f"{size_text(more)} more is to come, but {size_text(available)} is available"
        f"{whose}: the kernel's out-of-memory killer would stop it. A smaller --batch or "
        "--seq (the checkpoints), --optimizer-mode sync, a smaller --optimizer-state"
        + (" or --lora" if cfg.pretrained else "") + " shrink it (rotapipe plan prices "
        "each); --no-host-ram-check runs it anyway.")


def _available(given: int | None) -> tuple[int | None, str]:
    """The RAM available to this process (``given``, else
    :func:`rotapipe.runtime.pinning.available_ram`: the machine's or, when less, its
    memory cgroup's room) and a note naming the cgroup when its limit binds."""
    from ..runtime.pinning import available_ram, cgroup_room

    if given is not None:
        return given, ""
    ram = available_ram()
    bound = ram is not None and ram == cgroup_room()
    return ram, " under this process's memory cgroup limit (container or job)" if bound \
        else ""


def _lora(cfg: TrainConfig) -> bool:
    return cfg.uses_lora or cfg.qlora


def _dtype_bytes(cfg: TrainConfig) -> int:
    return 4 if cfg.dtype == "fp32" else 2


def _by_layer(cfg: TrainConfig, placed, layers: int) -> tuple[list[int], list[int]]:
    """From ``(layer, parameter)`` pairs, each parameter once: per layer the parameters
    :func:`rotapipe.plan.host_memory` takes as its weights (LoRA: the frozen base; full
    fine-tuning: all of them) and the trainable ones."""
    frozen, trained = [0] * layers, [0] * layers
    for layer, p in placed:
        (trained if p.requires_grad else frozen)[layer] += p.numel()
    held = frozen if _lora(cfg) else [f + t for f, t in zip(frozen, trained)]
    return held, trained


def _priced(cfg: TrainConfig, costs, plan, workers: int, trained: list[int], **kw):
    """:func:`rotapipe.plan.host_memory` in this run's settings: one call per step, the
    optimizer mode's own host layout (``overlap`` with its undo snapshots), the compute
    dtype, the optimizer's state tensors (SGD: momentum only when ``beta1`` > 0) in
    their dtype, the clip, QLoRA."""
    from ..config import OptimizerMode
    from ..plan import host_memory
    return host_memory(costs, plan, cfg.microbatches, workers,
                       trainable_params=trained if _lora(cfg) else None,
                       dtype_bytes=_dtype_bytes(cfg),
                       optimizer_states=2 if cfg.optimizer == "adamw" else int(cfg.beta1 > 0),
                       staged_grads=False, quantized=cfg.qlora,
                       layout=OptimizerMode(cfg.optimizer_mode).value,
                       state_dtype=cfg.optimizer_state, clip=bool(cfg.grad_clip), **kw)


_SMALLER = [
    ("--optimizer-mode sync", {"optimizer_mode": "sync"}),
    ("--optimizer-state bf16", {"optimizer_state": "bf16"}),
    ("--optimizer-state int8", {"optimizer_state": "int8"}),
    ("--lora", {"lora": True}),
]
"""Settings that shrink the model state, tried one at a time on a run that does not
fit (docs/training.md, "Host RAM")."""


def fingerprint(model: nn.Module) -> dict:
    """What must match for a checkpoint to load: the architecture, its main sizes and
    every trainable parameter's name and shape."""
    base = model.get_base_model() if hasattr(model, "peft_config") else model
    c = base.config
    return {"architecture": type(base).__name__, "vocab_size": c.vocab_size,
            "hidden_size": c.hidden_size, "num_hidden_layers": c.num_hidden_layers,
            "params": {n: list(p.shape) for n, p in model.named_parameters()
                       if p.requires_grad}}
