"""Is the planner's plan a local optimum of the simulator? For each of the paper's
models (as ``paper_bubbles.py`` plans them: 8x RTX 4090, sequence 2048, 16
microbatches, exact optimizer, one call), simulate every plan one move away from the
planner's choice (a stage boundary moved by one layer, two neighbouring stages merged,
a stage split in halves: the moves of the planner's local search, which ranks them by
its job-grain estimate instead) and print the best neighbour's step and bubble.
``--climb`` keeps taking the best improving move until none improves; ``--random S``
then spends S seconds on random combinations of 2-5 moves from the best plan so far
(seed 1), keeping any that is faster.

    python benchmarks/plan_neighbours.py [--models qwen3-32b,gpt-oss-20b] [--climb]
                                         [--random 240]
"""

from __future__ import annotations

import argparse
import random
import time

from paper_bubbles import M, MODELS, SEQ
from rotapipe.plan import hardware
from rotapipe.plan.partitioner import Footprint, _moves, assemble_plan
from rotapipe.planner import analyze
from rotapipe.planner.advise import _costs, _trainable
from rotapipe.planner.autoplan import _grain_costs, device_need, simulate_plan


def _runs(plan):
    """The plan's forward and backward cuts as lists of (start, stop)."""
    return ([(s.start, s.stop) for s in plan.forward],
            [(s.start, s.stop) for s in plan.backward])


def _simulated(plan, fwd, bwd, costs, fp, limit):
    """(step ms, bubble, plan) of ``plan`` re-cut to ``fwd`` / ``bwd``, or ``None``
    where that does not fit the device."""
    q = assemble_plan(plan.num_layers, fwd, plan.tail.start, bwd, plan.tail_jobs)
    if device_need(q, fp) > limit:
        return None
    r = simulate_plan(q, costs, 8, M)
    return r.step_ms, r.bubble.total, q


def neighbours(plan, costs, fp, limit):
    """(step ms, bubble, plan) of every fitting plan one move from ``plan``."""
    fwd, bwd = _runs(plan)
    moved = [(runs, bwd) for runs in _moves(fwd)] + [(fwd, runs) for runs in _moves(bwd)]
    return [r for r in (_simulated(plan, f, b, costs, fp, limit) for f, b in moved) if r]


def shaken(plan, costs, fp, limit, seconds: float, step: float):
    """Random combinations of 2-5 moves from the best plan so far, for ``seconds``:
    (step ms, bubble, plan) of the best found (``None`` if none beats ``step``), and
    the number simulated."""
    rng, best, tried, end = random.Random(1), None, 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        fwd, bwd = _runs(best[2] if best else plan)
        for _ in range(rng.randint(2, 5)):
            if rng.random() < 0.5:
                fwd = rng.choice(list(_moves(fwd)))
            else:
                bwd = rng.choice(list(_moves(bwd)))
        r = _simulated(plan, fwd, bwd, costs, fp, limit)
        if r is None:
            continue
        tried += 1
        if r[0] < (best[0] if best else step) - 1e-6:
            best = r
    return best, tried


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(m[1] for m in MODELS))
    ap.add_argument("--climb", action="store_true")
    ap.add_argument("--random", type=float, default=0.0, metavar="SECONDS")
    args = ap.parse_args(argv)
    hw = hardware("rtx4090x8")
    print(f"{'model':22s} {'plan ms':>9s} {'bubble':>7s} {'neighbours':>10s} "
          f"{'best ms':>9s} {'bubble':>7s} {'climbed':>8s}")
    for name, model, lora, _, _ in MODELS:
        if model not in args.models.split(","):
            continue
        a = analyze(model, hw, seq=SEQ, global_batch=M, microbatches=M, lora_rank=lora)
        c = a.choice
        trainable, grads = _trainable(model, hw, lora)    # as analyze() plans it
        base = _costs(model, hw, SEQ, 1, None, trainable, M)
        fp, costs = Footprint.of(base, M, c.grain, grads), _grain_costs(base, c.grain)
        plan, step, bubble, climbed = c.plan, c.report.step_ms, c.report.bubble.total, 0
        first = None
        while True:
            found = sorted(neighbours(plan, costs, fp, a.device_limit), key=lambda n: n[0])
            first = first or (len(found), found[0] if found else (step, bubble, plan))
            if not args.climb or not found or found[0][0] >= step - 1e-6:
                break
            step, bubble, plan = found[0]
            climbed += 1
        count, (best, best_bubble, _) = first
        print(f"{name:22s} {c.report.step_ms:9.1f} {c.report.bubble.total:7.1%} "
              f"{count:10d} {best:9.1f} {best_bubble:7.1%} "
              f"{(f'{bubble:.1%} ({climbed})' if args.climb else '-'):>8s}")
        if args.random > 0:
            found, tried = shaken(plan, costs, fp, a.device_limit, args.random, step)
            print(f"  {tried} random combinations of 2-5 moves: " + (
                f"{found[0]:.1f} ms, bubble {found[1]:.1%}" if found else "none faster"))


if __name__ == "__main__":
    main()
