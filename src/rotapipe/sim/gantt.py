"""Timeline picture (Gantt PNG) of a simulated schedule.

One row per device: a thick bar for its compute (forward, fused tail, recompute,
backward), and under it two thin bars for its upload and download links (weights,
activations and gradients). White is idle. Needs matplotlib (``pip install
rotapipe[sim]``); it draws with the Agg canvas directly, touching no global pyplot
state.
"""

from __future__ import annotations

import pathlib
from collections import defaultdict

from ..errors import ConfigError
from ..schedule import ActionKind as K
from ..schedule.timeline import Resource, Timeline
from .report import Report

__all__ = ["COLORS", "draw_gantt"]

COLORS = {
    K.FORWARD: "#4C72B0", K.FORWARD_KEEP: "#4C72B0", K.FUSED: "#8172B3",
    K.RECOMPUTE: "#DD8452", K.BACKWARD: "#55A868", K.BACKWARD_KEPT: "#55A868",
    K.UPLOAD_WEIGHTS: "#8C8C8C", K.UPLOAD_TRAINED: "#8C8C8C", K.UPLOAD_ACT: "#64B5CD",
    K.UPLOAD_GRAD: "#A1D99B",
    K.UPLOAD_SIDE: "#64B5CD", K.DOWNLOAD_ACT: "#64B5CD", K.DOWNLOAD_GRAD: "#A1D99B",
    K.DOWNLOAD_WGRAD: "#937860", K.DOWNLOAD_BUFFERS: "#937860",
}
"""Colour of each action kind (idle is white)."""

_LEGEND = [("forward", K.FORWARD), ("fused tail", K.FUSED), ("recompute", K.RECOMPUTE),
           ("backward", K.BACKWARD), ("weights up", K.UPLOAD_WEIGHTS),
           ("activation", K.UPLOAD_ACT), ("gradient", K.UPLOAD_GRAD),
           ("weight grads down", K.DOWNLOAD_WGRAD)]
_ROW = {Resource.COMPUTE: (0.0, 0.56), Resource.UP: (0.58, 0.14), Resource.DOWN: (0.74, 0.14)}


def draw_gantt(timeline: Timeline, path: str | pathlib.Path, report: Report | None = None,
               title: str | None = None) -> pathlib.Path:
    """Draw ``timeline`` to the PNG ``path`` and return the path. ``report`` adds the
    step time and bubble to the title and marks its steady-state window."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        raise ConfigError("drawing timelines needs matplotlib: pip install "
                          "'rotapipe[sim]'") from None
    s = timeline.schedule
    W = s.workers
    scale, unit = (1e-3, "s") if timeline.makespan > 5000 else (1.0, "ms")
    fig = Figure(figsize=(14, 1.3 + 0.62 * W), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    bars: dict[tuple[int, str, str], list[tuple[float, float]]] = defaultdict(list)
    alpha: dict[tuple[int, str, str], float] = {}
    for sp in timeline.spans:
        if sp.worker < 0 or sp.end <= sp.start:
            continue
        color = COLORS.get(sp.action.kind)
        if color is None:
            continue
        key = (sp.worker, sp.resource, color)
        odd = sp.action.call % 2 == 1
        key = key + ("odd",) if odd else key + ("even",)
        bars[key].append((sp.start * scale, (sp.end - sp.start) * scale))
        alpha[key] = 0.6 if odd else 1.0
    for (w, res, color, _), xs in bars.items():
        off, height = _ROW[res]
        ax.broken_barh(xs, (w + off, height), facecolors=color, alpha=alpha[(w, res, color, _)],
                       linewidth=0)
    _label_jobs(ax, timeline, scale)
    if report is not None and report.calls > 1:
        for x in report.window:
            ax.axvline(x * scale, color="black", linestyle="--", linewidth=0.8)
    ax.set_ylim(W, -0.1)
    ax.set_xlim(0, timeline.makespan * scale)
    ax.set_yticks([w + 0.28 for w in range(W)])
    ax.set_yticklabels([f"device {w}" for w in range(W)])
    ax.set_xlabel(f"time ({unit})")
    head = title or s.name
    if report is not None:
        head += (f": step {report.step_ms:,.0f} ms, bubble {100 * report.bubble.total:.1f}% "
                 f"(fill {100 * report.bubble.fill:.1f}, switch "
                 f"{100 * report.bubble.switch:.1f}, drain {100 * report.bubble.drain:.1f}, "
                 f"steady {100 * report.bubble.steady:.1f})")
        if report.calls > 1:
            head += f"; {report.calls} calls, steady state between the dashed lines"
    ax.set_title(head, fontsize=10)
    height = fig.get_figheight()
    fig.legend(handles=[Patch(color=COLORS[k], label=n) for n, k in _LEGEND],
               loc="lower center", ncol=len(_LEGEND), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.35 / height, 1, 1))
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def _label_jobs(ax, timeline: Timeline, scale: float) -> None:
    """Write the stage name over each run of one stage's passes (consecutive on a
    device) that is at least 3% of the picture wide."""
    per_device: dict[int, list] = defaultdict(list)
    for sp in timeline.spans:
        if sp.resource == Resource.COMPUTE and sp.action.kind in COLORS and sp.end > sp.start:
            per_device[sp.worker].append(sp)
    min_width = timeline.makespan * 0.03
    for w, spans in per_device.items():
        spans.sort(key=lambda sp: sp.start)
        runs: list[list] = []
        for sp in spans:
            tag = (sp.action.stage, sp.action.call)
            if runs and runs[-1][0] == tag:
                runs[-1][2] = sp.end
            else:
                runs.append([tag, sp.start, sp.end])
        for (stage, _), lo, hi in runs:
            if hi - lo >= min_width:
                ax.text((lo + hi) / 2 * scale, w + 0.28, stage, ha="center", va="center",
                        fontsize=7, color="black",
                        bbox={"facecolor": "white", "alpha": 0.75, "pad": 1, "linewidth": 0})
