"""The training job behind ``rotapipe train``: config, data, loop, checkpoints.

    from rotapipe.train import TrainConfig, train
    result = train(TrainConfig(data="corpus.jsonl", model="path/to/hf-model", steps=200))

See docs/training.md.
"""

from .checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint
from .config import TrainConfig, load_config
from .loop import TrainResult, train

__all__ = ["TrainConfig", "TrainResult", "latest_checkpoint", "list_checkpoints",
           "load_checkpoint", "load_config", "save_checkpoint", "train"]
