"""How much of ``stale``'s speed the exact ``overlap`` mode can keep (simulator only).

For each model on emulated 8x RTX 4090 (the planner's plan, sequence 2048, 16
microbatches, host optimizer ``--optimizer-rate`` parameters/s), prints the step time of
one call alone (from its first weight upload to its last hand-off), without optimizer
work and with each stage's step done at its hand-off as ``overlap`` does it (the
embedding's stage up to the step of the rows the next call looks up, which is all the
next call waits for), of
pipelined ``overlap`` and ``stale`` calls in their steady state (the same schedules and
period measure as ``timed_emulation.py``), and the ceilings. An exact step cannot be
shorter than one call alone with its last stage's step (docs/optimizer.md), so
``overlap`` keeps at most that share of ``stale``'s tokens/s; ``free last step``: the
share if that last step took no time. The columns up to there run the plan for one
exact call; ``stale, own plan`` is the steady step of ``stale`` on the plan the planner
picks for overlapping calls (``rotapipe plan --stale``), and the last column what
``overlap`` keeps of that (each mode at its best).

    python benchmarks/overlap_ceiling.py
    python benchmarks/overlap_ceiling.py --rows 8192    # calls looking up fewer rows

The token embedding moves by the rows a call looks up, and ``overlap`` steps the next
call's rows first (``OR``, charged ``ROWS_FIRST_COST`` rows of the whole step each):
``--rows`` sets how many distinct rows that is (default 32,768, every token distinct:
the worst case; natural text repeats tokens).
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import rotapipe
from rotapipe.runtime.emulation import TimedEmulation
from rotapipe.schedule import ActionKind as K, Schedule, roundpipe_call
from rotapipe.sim import ActionTimes, run
from timed_emulation import DEVICES, WARMUP, loss_period, pipelined_sim, planned

MEASURED = 4


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen3-1.7b,llama-3.1-8b,qwen3-32b")
    ap.add_argument("--microbatches", type=int, default=16)
    ap.add_argument("--optimizer-rate", type=float, default=5e9)
    ap.add_argument("--rows", type=int, default=None,
                    help="distinct embedding rows a call looks up (default: one per "
                         "token, the most there can be)")
    args = ap.parse_args(argv)
    m = args.microbatches
    print(f"simulator: 8x RTX 4090, seq 2048, {m} microbatches, host optimizer "
          f"{args.optimizer_rate:.0e} params/s, "
          f"{args.rows or 2048 * m:,} embedding rows looked up per call")
    print(f"{'model':14s} {'call, no step':>13s} {'call + steps':>12s} {'overlap':>9s} "
          f"{'stale':>9s} {'overlap/stale':>13s} {'ceiling':>8s} {'free last step':>14s} "
          f"{'stale, own plan':>15s} {'overlap/it':>10s}")
    for model in args.models.split(","):
        em = TimedEmulation.of(model.strip(), "rtx4090x8", seq=2048,
                               call_tokens=args.rows or 2048 * m,
                               optimizer_params_per_s=args.optimizer_rate)
        choice = planned(em.costs, m)
        base, em = em, replace(em, costs=choice.costs)
        call = rotapipe.roundpipe_schedule(choice.plan, DEVICES, m)
        bare = run(call, ActionTimes(choice.plan, choice.costs)).makespan
        # One call as overlap runs it: the stage holding the embedding steps the next
        # call's rows first (OR); the next call waits for that, not for the whole step.
        rows = Schedule(choice.plan, DEVICES, m, roundpipe_call(
            choice.plan, DEVICES, m, 0, rows_first=(0,) if em.rows_first_pays() else ()))
        tl = run(rows, ActionTimes(choice.plan, choice.costs,
                                   optimizer_ms=em.optimizer_ms(choice.plan, False)))
        last = {f"O:{a.stage}" for a in rows.actions if a.kind is K.OPTIMIZER_ROWS}
        one = max(end for key, end in tl.end.items() if key not in last)
        step = {mode: loss_period(pipelined_sim(em, choice.plan, mode, m,
                                                WARMUP + MEASURED), choice.plan, MEASURED)
                for mode in ("overlap", "stale")}
        lagged = planned(base.costs, m, stale=True)
        em_s = replace(em, costs=lagged.costs)
        own = loss_period(pipelined_sim(em_s, lagged.plan, "stale", m, WARMUP + MEASURED),
                          lagged.plan, MEASURED)
        print(f"{model:14s} {bare:10,.0f} ms {one:9,.0f} ms {step['overlap']:6,.0f} ms "
              f"{step['stale']:6,.0f} ms {step['stale'] / step['overlap']:13.1%} "
              f"{step['stale'] / one:8.1%} {step['stale'] / bare:14.1%} "
              f"{own:12,.0f} ms {own / step['overlap']:10.1%}")


if __name__ == "__main__":
    main()
