"""Where a run's metrics go besides ``metrics.jsonl``: TensorBoard event files, Weights &
Biases, and the loss picture drawn at the end.

Each sink is an optional dependency, imported only when asked for: ``report_to =
"tensorboard"`` needs the ``tensorboard`` package (the writer is PyTorch's
``torch.utils.tensorboard.SummaryWriter``), ``"wandb"`` the ``wandb`` package (its own
environment variables apply: ``WANDB_MODE=offline``, ``WANDB_PROJECT``); the loss PNG
is drawn when matplotlib is installed and skipped otherwise.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import pathlib

from ..errors import ConfigError

__all__ = ["MetricSinks", "check_sinks", "plot_loss", "read_metrics"]

WANDB_RUN_ID = "wandb-run-id"
"""The file in out_dir holding the id of the run's W&B run (``report_to="wandb"``)."""
_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}


def _sinks(report_to: str) -> list[str]:
    return [s for s in report_to.split(",") if s and s != "none"]


def check_sinks(report_to: str) -> None:
    """Fail before any work when a requested sink's package is missing."""
    for sink in _sinks(report_to):
        module, package = _PACKAGES[sink]
        try:
            importlib.import_module(module)
        except ImportError:
            raise ConfigError(f"report_to={sink} needs the {package!r} package: pip install "
                              f"{package} (or drop {sink} from report_to)") from None


class MetricSinks:
    """The sinks of one run (rank 0 only): ``log(record)`` per metrics.jsonl record,
    ``close()`` at the end. A record's numbers go under ``train/`` (step metrics) or
    ``eval/`` (``eval_loss``, ``eval_ppl``), at the record's step."""

    def __init__(self, report_to: str, out: pathlib.Path, config: dict, start_step: int):
        self.tb = self.run = None
        sinks = _sinks(report_to)
        if "tensorboard" in sinks:
            from torch.utils.tensorboard import SummaryWriter
            # A resumed run drops what a killed run logged after its checkpoint.
            self.tb = SummaryWriter(log_dir=str(out / "tensorboard"),
                                    purge_step=start_step or None)
            self.tb_dir = out / "tensorboard"
        if "wandb" in sinks:
            import wandb
            # A resumed run continues the W&B run of the run it resumes: its id is kept
            # in out_dir (without it, resume="allow" would start a new W&B run).
            saved = out / WANDB_RUN_ID
            run_id = None
            if start_step and saved.is_file():
                run_id = saved.read_text().strip() or None
            self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "rotapipe"),
                                  dir=str(out), config=config, id=run_id, resume="allow")
            saved.write_text(self.run.id + "\n")

    def log(self, record: dict) -> None:
        step = record["step"]
        values = {}
        for key, value in record.items():
            if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if not math.isfinite(value):
                continue
            values[("eval/" if key.startswith("eval_") else "train/") + key] = value
        if self.tb is not None:
            for key, value in values.items():
                self.tb.add_scalar(key, value, step)
        if self.run is not None:
            self.run.log(values, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.flush()
            self.tb.close()
        if self.run is not None:
            self.run.finish()


def read_metrics(path: pathlib.Path) -> list[dict]:
    """The records of a metrics.jsonl (none when it does not exist); a line cut by a
    crash is skipped."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def plot_loss(metrics: pathlib.Path, png: pathlib.Path, title: str = "rotapipe train"
              ) -> pathlib.Path | None:
    """Draw the training loss per step and the evaluation loss of ``metrics`` (a
    metrics.jsonl) into ``png``; None when matplotlib is not installed or there is
    nothing to draw."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    rows = read_metrics(metrics)
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    held = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    if not train and not held:
        return None
    fig = Figure(figsize=(7, 4), dpi=110)       # no pyplot: no global figure state
    ax = fig.subplots()
    if train:
        ax.plot(*zip(*train), lw=0.8, alpha=0.6, label="training loss (per step)")
    if held:
        ax.plot(*zip(*held), "o-", lw=1.8, label="evaluation loss")
        first, last = held[0][1], held[-1][1]
        title += f": evaluation loss {first:.2f} -> {last:.2f} ({100 * (last / first - 1):+.0f}%)"
    seconds = max((r.get("elapsed_s", 0) for r in rows), default=0)
    ax.set_title(f"{title}, {seconds:.0f} s of training", fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)
    return png
