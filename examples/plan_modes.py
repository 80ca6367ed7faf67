"""Which optimizer mode to train in, before renting a GPU: each mode's step with the
host optimizer's time, from Python (what ``rotapipe plan MODEL --modes`` prints).

``predicted`` by the planner is one call on the devices; the host optimizer then steps
every trainable parameter at ``--rate`` parameters per second. ``sync`` waits for that
step after each call; ``overlap`` (exact) and ``stale`` (one step stale) pipeline the
calls, and are priced by simulating three of them on the chosen plan
(docs/planning.md, "The optimizer modes' steps"). No weights are loaded and torch is
not imported.

    python examples/plan_modes.py [--models qwen3-1.7b,gpt-oss-20b] [--rate 5e9] [--clip]
"""

from __future__ import annotations

import argparse

from rotapipe.plan import hardware
from rotapipe.planner import analyze


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen3-1.7b,gpt-oss-20b",
                    help="config.json paths, model folders or shipped names, comma-separated")
    ap.add_argument("--hardware", default="rtx4090x8")
    ap.add_argument("--rate", type=float, default=5e9,
                    help="host optimizer throughput, parameters per second")
    ap.add_argument("--clip", action="store_true", help="with a global-norm clip")
    args = ap.parse_args(argv)
    hw = hardware(args.hardware)
    print(f"{'model':14s} {'host step':>9s} {'call':>8s} {'sync':>8s} {'overlap':>8s} "
          f"{'stale':>8s}   (seconds per step of 16 x 2048 tokens)")
    for model in args.models.split(","):
        a = analyze(model.strip(), hw, seq=2048, global_batch=16, optimizer_rate=args.rate,
                    modes=True, clip=args.clip)
        m = a.modes
        print(f"{model:14s} {m.step_ms / 1e3:9.2f} {m.call_ms / 1e3:8.2f} "
              f"{m.sync_ms / 1e3:8.2f} {m.overlap_ms / 1e3:8.2f} {m.stale_ms / 1e3:8.2f}")


if __name__ == "__main__":
    main()
