"""Plot the training and held-out loss of a run from its metrics.jsonl (what
``rotapipe train`` writes to ``out_dir/loss.png`` by itself at the end).

    python examples/plot_metrics.py runs/train/metrics.jsonl docs/img/demo_loss.png
"""

from __future__ import annotations

import argparse
import pathlib

from rotapipe.train.metrics import plot_loss


def main(metrics: str, png: str) -> None:
    out = plot_loss(pathlib.Path(metrics), pathlib.Path(png), "rotapipe train (demo)")
    print(out or "nothing drawn: install matplotlib, or the run logged no loss yet")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("metrics", help="a run's metrics.jsonl (out_dir/metrics.jsonl)")
    ap.add_argument("png", help="the picture to write")
    args = ap.parse_args()
    main(args.metrics, args.png)
