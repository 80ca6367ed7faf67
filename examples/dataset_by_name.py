"""Fine-tuning on a Hugging Face dataset by name (``data="org/name"``), offline, from the
Hugging Face cache, with a builder config and splits chosen as TRL users choose them.

Builds, with nothing downloaded, what ``hf download --repo-type dataset`` leaves in a
cache: a dataset repository with two configs declared in its card (``reverse``: the
assistant reverses the user's words; ``echo``: it repeats them), each with a train and a
test split, in a fresh ``HF_HOME``. Then, with ``HF_HUB_OFFLINE=1``, trains the tiny chat
model of ``finetune_chat.py`` on ``example/word-games`` config ``reverse``, split
``train``, evaluating on its ``test`` split, all loaded by ``datasets.load_dataset``.

    python examples/dataset_by_name.py            # 30 s on a loaded 2-core machine

The same run on the command line (HF_HOME and HF_HUB_OFFLINE set):
    rotapipe train --model DIR --data example/word-games --data-config reverse \\
        --data-split train --eval-data example/word-games --holdout 0 --steps 30
"""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile

# Before anything from Hugging Face is imported: they read these when imported.
HOME = pathlib.Path(tempfile.mkdtemp(prefix="rotapipe-hf-home-"))
os.environ.update(HF_HOME=str(HOME), HF_HUB_OFFLINE="1")
for name in ("HF_HUB_CACHE", "HF_DATASETS_CACHE"):
    os.environ.pop(name, None)

import json  # noqa: E402
import random  # noqa: E402

from finetune_chat import WORDS, model_dir  # noqa: E402
from rotapipe.train import TrainConfig, train  # noqa: E402

COMMIT = "0" * 40


def word_games(path: pathlib.Path, config: str, n: int, seed: int) -> None:
    rnd = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            words = [rnd.choice(WORDS) for _ in range(3)]
            reply = reversed(words) if config == "reverse" else words
            f.write(json.dumps({"messages": [
                {"role": "user", "content": " ".join(words)},
                {"role": "assistant", "content": " ".join(reply)}]}) + "\n")


def cached_dataset(repo: str) -> None:
    """``repo`` as the hub cache holds a downloaded dataset repository:
    ``HF_HOME/hub/datasets--org--name/{refs/main, snapshots/<commit>/...}``."""
    root = HOME / "hub" / ("datasets--" + repo.replace("/", "--"))
    snap = root / "snapshots" / COMMIT
    card = ["---", "configs:"]
    for config in ("reverse", "echo"):
        (snap / config).mkdir(parents=True)
        for split, n, seed in (("train", 1500, 0), ("test", 40, 1)):
            word_games(snap / config / f"{split}.jsonl", config, n, seed)
        card += [f"- config_name: {config}", "  data_files:"]
        card += [f"  - split: {s}\n    path: {config}/{s}.jsonl" for s in ("train", "test")]
    (snap / "README.md").write_text("\n".join(card + ["---", "# word games", ""]))
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(COMMIT)


def main() -> None:
    cached_dataset("example/word-games")
    work = pathlib.Path(tempfile.mkdtemp(prefix="rotapipe-by-name-"))
    try:
        cfg = TrainConfig(
            model=str(model_dir(work / "tiny-chat")), data="example/word-games",
            data_config="reverse", data_split="train", eval_data="example/word-games",
            holdout=0.0, steps=30, lr=3e-3, seq=64, batch=16, microbatches=4,
            eval_interval=10, eval_sequences=8, workers=2, backend="emulated",
            sample_prompt="red fox cat", sample_tokens=8, out_dir=str(work / "run"),
            log_every=10, progress=False)
        result = train(cfg)
        print(f"evaluation loss on example/word-games[reverse]:test {result.eval_first:.3f}"
              f" -> {result.eval_last:.3f} in {result.step} steps")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(HOME, ignore_errors=True)


if __name__ == "__main__":
    main()
