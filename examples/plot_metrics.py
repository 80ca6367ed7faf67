"""Plot the training and held-out loss of a run from its metrics.jsonl (what
``rotapipe train`` writes to ``out_dir/loss.png`` by itself at the end).

    python examples/plot_metrics.py runs/train/metrics.jsonl docs/img/demo_loss.png
"""

from __future__ import annotations

import pathlib
import sys

from rotapipe.train.metrics import plot_loss


def main(metrics: str, png: str) -> None:
    out = plot_loss(pathlib.Path(metrics), pathlib.Path(png), "rotapipe train (demo)")
    print(out or "nothing drawn: install matplotlib, or the run logged no loss yet")


if __name__ == "__main__":
    main(*sys.argv[1:3])
