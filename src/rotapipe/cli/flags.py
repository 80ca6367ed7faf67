"""The model and hardware flags that ``plan`` and ``simulate`` share: ``--lora``,
``--qlora`` and ``--lora-rank`` (:func:`_lora`), ``--hardware`` with ``--efficiency`` and
``--fp16-accumulate`` (:func:`_hardware`), and ``--model`` (:func:`_model_name`)."""

from __future__ import annotations

from ..errors import ConfigError


def _lora(args) -> bool:
    """Whether the run is LoRA (``--lora`` or ``--qlora``); sets ``args.lora_rank`` to its
    default, and refuses a rank given without either (it would be ignored)."""
    lora = args.lora or args.qlora
    if args.lora_rank is not None and not lora:
        raise ConfigError(f"--lora-rank {args.lora_rank} prices LoRA adapters, but the run "
                          "is full fine-tuning: add --lora (or --qlora), or drop --lora-rank")
    if args.lora_rank is None:
        args.lora_rank = 8
    return lora


def _hardware(args):
    """The ``--hardware`` profile of ``plan`` and ``simulate``, with ``--efficiency`` and
    ``--fp16-accumulate``; an empty name is refused here, more than
    :data:`~rotapipe.plan.hardware.MAX_DEVICES` devices by :func:`hardware`."""
    from ..plan import hardware

    if not args.hardware.strip():
        raise ConfigError("--hardware is empty: use DEVICExN, e.g. rtx4090x8 or a100x4")
    return hardware(args.hardware, fp16_accumulate=args.fp16_accumulate,
                    **({"efficiency": args.efficiency} if args.efficiency is not None else {}))


def _model_name(name: str) -> str:
    """``--model`` of ``plan`` and ``simulate``: a name that is neither a path nor a known
    model, but close to one, is refused with that name (``qwen3-1.7`` -> ``qwen3-1.7b``);
    the rest is for :func:`rotapipe.plan.configs.load_config` to check."""
    import difflib
    import pathlib

    from ..plan.configs import KNOWN_MODELS

    if name.lower() in KNOWN_MODELS or pathlib.Path(name).exists():
        return name
    close = difflib.get_close_matches(name.lower(), KNOWN_MODELS, n=1, cutoff=0.6)
    if close:
        raise ConfigError(f"no model config at {name!r}: did you mean {close[0]!r}? Give "
                          f"a config.json path or one of {', '.join(KNOWN_MODELS)}")
    if name.count("/") == 1 and not name.startswith((".", "/")):
        return _cached_hub_model(name)
    return name


def _cached_hub_model(repo: str) -> str:
    """A Hugging Face hub id (``org/name``), as ``train --model`` takes it: the folder
    of its ``config.json`` in the local hub cache (nothing is downloaded)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:             # without transformers' hub client: a path is needed
        return repo
    found = try_to_load_from_cache(repo, "config.json")
    if isinstance(found, str):
        import pathlib
        return str(pathlib.Path(found).parent)
    raise ConfigError(f"no model config at {repo!r}, and the local Hugging Face cache holds "
                      "no config.json for it (plan and simulate read the cache, never the "
                      f"network): download it first (hf download {repo} config.json), or "
                      "give a config.json path or a known name")
