"""The training job behind ``rotapipe train``: config, data, loop, checkpoints.

    from rotapipe.train import TrainConfig, train
    result = train(TrainConfig(data="corpus.jsonl", model="path/to/hf-model", steps=200))

See docs/training.md.
"""

from __future__ import annotations

import importlib
import typing

# Names load on first use (PEP 562), so that `rotapipe.train.config` (what `rotapipe
# train --help` reads) does not import torch through the loop and the checkpoints.
_FROM = {".checkpoint": ("latest_checkpoint", "list_checkpoints", "load_checkpoint",
                         "save_checkpoint"),
         ".config": ("TrainConfig",),
         ".settings": ("load_config",),
         ".loop": ("TrainResult", "train")}
_WHERE = {name: module for module, names in _FROM.items() for name in names}

__all__ = sorted(_WHERE)

if typing.TYPE_CHECKING:
    from .checkpoint import (latest_checkpoint, list_checkpoints, load_checkpoint,
                             save_checkpoint)
    from .config import TrainConfig
    from .settings import load_config
    from .loop import TrainResult, train


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
