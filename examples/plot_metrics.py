"""Plot the training and held-out loss of a run from its metrics.jsonl.

    python examples/plot_metrics.py runs/train/metrics.jsonl docs/img/demo_loss.png
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(metrics: str, png: str) -> None:
    rows = [json.loads(line) for line in open(metrics) if line.strip()]
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    held = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(*zip(*train), lw=0.8, alpha=0.6, label="training loss (per step)")
    ax.plot(*zip(*held), "o-", lw=1.8, label="held-out loss")
    first, last = held[0][1], held[-1][1]
    seconds = max((r.get("elapsed_s", 0) for r in rows), default=0)
    ax.set_title(f"rotapipe train (demo): held-out {first:.2f} -> {last:.2f} "
                 f"({100 * (last / first - 1):+.0f}%), {seconds:.0f} s of training")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png)
    print(png)


if __name__ == "__main__":
    main(*sys.argv[1:3])
