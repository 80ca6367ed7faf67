"""LoRA with overlapping calls: what uploading the frozen base before the optimizer's
hand-off buys (simulator only).

For each model on 8x RTX 4090 (sequence 2048, 16 microbatches of one sequence, LoRA
rank 16 on every linear layer, or QLoRA: an NF4 base), the planner's plan
(``rotapipe plan MODEL --lora``, which plans one exact call) simulated as six
overlapping calls in their steady state (the period between the last five losses, as
``timed_emulation.py`` measures it): the exact ``overlap`` mode with every stage's
whole upload waiting for the previous call's hand-offs (before), and with the frozen
base uploaded at once and only the adapters waiting (``UW`` + ``UT``, what the runtime
runs); then ``stale`` on its own plan (``rotapipe plan --stale``), split the same way.
The host optimizer steps the adapters at ``--optimizer-rate`` parameters/s at each
stage's hand-off. Bubble: the share of the period a worker does no compute.

``--runtime``: the runtime under timed emulation (``TimedEmulation``: every kernel and
copy of 8 emulated workers takes the time the costs give, dilated ``--dilation`` times;
the layers that run are tiny stand-ins with the model's layer count) for Qwen3-235B-A22B
LoRA in ``overlap`` on the planner's plan, twice in one process: a stand-in whose
weights are all trained (one ``UW`` per stage, waiting for the hand-offs: before) and
one with a LoRA-like frozen base in every layer (``UW`` + ``UT``: after), each beside
the simulator's steady state for the same schedule (``rt/sim``). The adapters'
optimizer time is left out in both (``trainable=False``).

    python benchmarks/lora_overlap.py                                  # about 1 min
    cd benchmarks && python lora_overlap.py --runtime --steps 2 --chunk-mb 128   # ~20 min

(``--runtime`` imports ``timed_emulation.py`` from this folder. 128 MiB chunks keep the
Python cost per chunk small against the dilated copies; at 32 MiB the runtime ran 5-11%
behind the simulator in both runs.)
"""

from __future__ import annotations

import argparse

from rotapipe.plan import StageKind, hardware, lora_params
from rotapipe.planner import analyze
from rotapipe.schedule import roundpipe_stale_schedule
from rotapipe.sim import ActionTimes, run
from rotapipe.sim.report import steady_bubble

MODELS = [("Qwen3-235B-A22B LoRA", "qwen3-235b-a22b", False),
          ("Qwen3-32B LoRA", "qwen3-32b", False),
          ("Qwen3-32B QLoRA", "qwen3-32b", True),
          ("Llama-3.1-8B LoRA", "llama-3.1-8b", False)]
M, SEQ, W, CALLS, MEASURED = 16, 2048, 8, 6, 4


def steady(choice, staleness: int, frozen, rate: float, adapters) -> tuple[float, float]:
    """(period ms, bubble) of ``CALLS`` overlapping calls of ``choice``'s plan."""
    plan, costs = choice.plan, choice.costs
    stepper = {l: s.name for s in plan.jobs() if s.kind is not StageKind.FORWARD
               for l in s.layers}

    def optimizer_ms(stage):
        return 1e3 * sum(adapters[l] for l in stage.layers
                         if stepper.get(l) == stage.name) / rate
    s = roundpipe_stale_schedule(plan, W, M, calls=CALLS, staleness=staleness,
                                 frozen=frozen)
    return steady_bubble(run(s, ActionTimes(plan, costs, optimizer_ms=optimizer_ms)),
                         plan, MEASURED)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--optimizer-rate", type=float, default=5e9)
    ap.add_argument("--runtime", action="store_true")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--dilation", type=float, default=8.0)
    ap.add_argument("--chunk-mb", type=float, default=32.0)
    args = ap.parse_args(argv)
    if args.runtime:
        runtime(args)
        return
    hw = hardware("rtx4090x8")
    print(f"8x RTX 4090, seq {SEQ}, {M} microbatches, LoRA rank 16, host optimizer "
          f"{args.optimizer_rate:.0e} params/s; steady state of {CALLS} overlapping calls")
    print(f"{'model':22s} {'one call':>17s} {'overlap, before':>17s} "
          f"{'overlap, frozen first':>22s} {'stale, own plan':>17s} {'overlap/stale':>15s}")
    print(f"{'':22s}" + f" {'ms':>9s} {'bubble':>7s}" * 2 + f" {'ms':>14s} {'bubble':>7s}"
          + f" {'ms':>9s} {'bubble':>7s}" + f" {'before':>7s} {'after':>7s}")
    for name, model, qlora in MODELS:
        kw = dict(seq=SEQ, global_batch=M, microbatches=M, lora_rank=16, qlora=qlora)
        exact, lagged = analyze(model, hw, **kw).choice, analyze(model, hw, stale=True, **kw).choice
        adapters = lora_params(model, 16)
        frozen = exact.costs.frozen
        before = steady(exact, 0, (), args.optimizer_rate, adapters)
        after = steady(exact, 0, frozen, args.optimizer_rate, adapters)
        stale = steady(lagged, 1, frozen, args.optimizer_rate, adapters)
        print(f"{name:22s} {exact.step_ms:9,.1f} {100 * exact.report.bubble.total:6.1f}%"
              f" {before[0]:9,.1f} {100 * before[1]:6.1f}% {after[0]:14,.1f} "
              f"{100 * after[1]:6.1f}% {stale[0]:9,.1f} {100 * stale[1]:6.1f}%"
              f" {stale[0] / before[0]:7.1%} {stale[0] / after[0]:7.1%}")


def freeze_base(model) -> None:
    """LoRA-like: in every layer of the stand-in something is frozen; the blocks'
    ``proj`` and ``down`` projections (the adapters' stand-ins) stay trained."""
    for name, p in model.named_parameters():
        if ".proj." not in name and ".down." not in name:
            p.requires_grad_(False)


def runtime(args) -> None:
    """Timed emulation of 235B LoRA in ``overlap``: all trained vs a frozen base."""
    from rotapipe.runtime.emulation import TimedEmulation
    from timed_emulation import measure, pipelined_sim, WARMUP

    hw = hardware("rtx4090x8")
    c = analyze("qwen3-235b-a22b", hw, seq=SEQ, global_batch=M, microbatches=M,
                lora_rank=16).choice
    em = TimedEmulation(c.costs, args.dilation, args.optimizer_rate, trainable=False)
    chunk = int(args.chunk_mb * 2**20)
    rows = []
    for label, prepare, frozen in (("all trained (before)", None, ()),
                                   ("frozen base (after)", freeze_base, c.costs.frozen)):
        sim = pipelined_sim(em, c.plan, "overlap", M, WARMUP + args.steps, chunk, frozen)
        rows.append(measure(label, em, c.plan, None, "overlap", c.grain.value, M,
                            args.steps, sim, chunk_mb=args.chunk_mb, prepare=prepare))
    print(f"Qwen3-235B-A22B LoRA, overlap, timed emulation (dilation {args.dilation}x, "
          f"chunks {args.chunk_mb:g} MiB, {args.steps} measured steps after {WARMUP}), "
          f"plan {c.plan.to_text()}")
    print(f"{'stand-in':22s} {'tokens/s':>9s} {'sim tok/s':>9s} {'rt/sim':>7s} "
          f"{'bubble':>7s}")
    for r in rows:
        print(f"{r['label']:22s} {r['tokens']:9,.0f} {r['sim_tokens']:9,.0f} "
              f"{r['ratio']:7.3f} {r['bubble']:7.1%}")
    print(f"frozen base first: {rows[1]['tokens'] / rows[0]['tokens']:.3f}x the tokens/s "
          f"(simulator {rows[1]['sim_tokens'] / rows[0]['sim_tokens']:.3f}x)")


if __name__ == "__main__":
    main()
