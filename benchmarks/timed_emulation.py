"""RoundPipe against 1F1B and GPipe in one runtime, on emulated 8x RTX 4090.

Timed emulation (``rotapipe.runtime.emulation.TimedEmulation``) makes every kernel and copy of the
emulated workers take the time an RTX 4090 and its PCIe link would take for the model's
real shapes (Qwen3-1.7B, Llama-3.1-8B, Qwen3-32B at sequence 2048, one sequence per
microbatch), dilated so that Python overhead stays small against it; the layers that
actually run are tiny stand-ins with the same layer count. The scheduling, events,
gated copy chunks and optimizer code are the real ones. Every schedule runs in
the same runtime on the same hardware model:

- RoundPipe with the optimizer ``sync`` (step after the call), ``overlap`` (exact,
  per-stage steps on the optimizer thread during the backward) and ``stale`` (the
  authors' one-step-stale step, overlapping the next call). ``sync`` and ``overlap``
  run the planner's plan for one exact call, ``stale`` the plan the planner picks for
  overlapping calls (``rotapipe plan --stale``), each mode at its best;
- 1F1B and GPipe with stages bound to devices (weights uploaded once per call and
  resident, gradients downloaded, masters and optimizer on the host: the same
  offloaded optimizer, stepped after the call; 1F1B also with the ``overlap`` step, for
  reference). Activations are kept on the device when they fit in 24 GiB, else
  recomputed (marked ``+R``: our recompute, which may run ahead of the gradient, on a
  cut that prices it, the stronger of the two baselines ``bound_plan`` documents); a
  schedule that fits neither way is marked;
- Mobius (``mobius_schedule``): looped BFS over ``v`` chunks per device, each chunk's
  weights swapped in from host memory for its forwards and again for its backwards,
  recompute; the smallest ``v`` in 2..4 whose simulated peak fits.

Columns: tokens/s (wall time between ``train_step`` returns, after warm-up) and the
speedup over 1F1B for a whole training step (call and optimizer); ``sim tok/s``, the
simulator's for the same schedule (one call, without the optimizer step after it, for
``sync`` and the baselines; for the pipelined ``overlap`` and ``stale`` rows the steady
state of ``roundpipe_stale_schedule``'s calls with each hand-off's optimizer work,
measured as the runtime's: between the moments consecutive losses reach the host);
the bubble and exposed transfer time (from the runtime's own timeline: the call, or
the steady-state window of the pipelined calls); the predicted device-memory peak of
the schedule (the simulator's memory model with the real sizes: the stand-in's
tensors are tiny); ``rt/sim``, the runtime's measured call time (pipelined: step
period) over the simulator's prediction for the same schedule and hardware (the
runtime's scheduling overhead); ``ungated``, tokens/s of the same
run with ``gate_copies=False`` (every weight chunk issued at once, so the copy engines
serve critical copies only after the weight copies issued before them), and
``gating``, what the gating is worth (gated over ungated tokens/s). The emulated copy
engines serve copies in arrival order without priority, as a GPU's do; weights move
in chunks of ``PipeConfig.copy_chunk_mb`` (32 MiB).

    python benchmarks/timed_emulation.py                       # all three models
    python benchmarks/timed_emulation.py --models qwen3-1.7b --steps 3
    python benchmarks/timed_emulation.py --lora --steps 2      # LoRA vs QLoRA

``--lora``: LoRA (rank 16 on every projection of the blocks) on a bf16 base against
QLoRA (the same adapters on the NF4 base, ``model_costs(quantize="nf4")``: blocks
upload NF4 bytes, dequantized on the device) for Qwen3-32B and Qwen3-235B-A22B
(``--models`` to change), RoundPipe with the ``sync`` optimizer, each beside the
simulator's prediction for the same plan (:func:`lora_costs` says what the costs
assume).

The host optimizer is modelled at ``--optimizer-rate`` parameters/s (fused CPU AdamW:
1.8e9 on this 2-core machine; a dual-socket server does several times that).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

import rotapipe
from rotapipe.model.tiny import lm_loss, stride_batch
from rotapipe.plan import bound_plan
from rotapipe.schedule import (gpipe_schedule, mobius_schedule, one_f_one_b_schedule,
                               roundpipe_stale_schedule)
from rotapipe.runtime.emulation import TimedEmulation
from rotapipe.sim import ActionTimes, memory_sizes, report, run
from rotapipe.sim.timing import DEFAULT_CHUNK
from rotapipe.planner.autoplan import PlannerConfig, choose_plan
from rotapipe.plan.hostmem import lora_params
from rotapipe.sim import Timeline
from rotapipe.sim.report import loss_period

DEVICES = 8
GIB = 2**30
USABLE = int(22.5 * GIB)      # of a 24 GiB RTX 4090, after context and fragmentation


def scaled(tl: Timeline, factor: float) -> Timeline:
    """``tl`` with every time divided by ``factor`` (real ms -> emulated ms)."""
    spans = tuple(replace(s, start=s.start / factor, end=s.end / factor) for s in tl.spans)
    return Timeline(tl.schedule, spans, {k: v / factor for k, v in tl.start.items()},
                    {k: v / factor for k, v in tl.end.items()})


def baseline(costs, name: str, microbatches: int):
    """The bound schedule, keeping activations if they fit, else recomputing."""
    make = {"1f1b": one_f_one_b_schedule, "gpipe": gpipe_schedule}[name]
    for recompute in (False, True):
        plan = bound_plan(costs, DEVICES, devices=DEVICES, recompute=recompute)  # "ahead"
        s = make(plan, DEVICES, microbatches, recompute=recompute, offload_optimizer=True)
        tl = run(s, ActionTimes(plan, costs))
        rep = report(tl, costs.tokens * microbatches, memory_sizes(costs), USABLE)
        if rep.fits or recompute:
            return plan, s, tl, rep, recompute


def mobius(costs, microbatches: int):
    """Mobius with the fewest chunks per device (2..4, at most the layers) whose
    simulated peak fits."""
    vs = [v for v in (2, 3, 4) if DEVICES * v <= len(costs.layers)]
    for v in vs:
        plan = bound_plan(costs, DEVICES * v, devices=DEVICES, recompute=True)
        s = mobius_schedule(plan, DEVICES, microbatches)
        tl = run(s, ActionTimes(plan, costs))
        if report(tl, costs.tokens * microbatches, memory_sizes(costs), USABLE).fits or \
                v == vs[-1]:
            return plan, s, tl, v


PIPELINED = ("overlap", "stale")


WARMUP = 2
"""Calls before the measured ones (overlapping calls reach their steady state)."""


def pipelined_sim(em, plan, mode: str, microbatches: int, calls: int,
                  chunk_bytes: int = DEFAULT_CHUNK, frozen=()):
    """The simulator's timeline of ``calls`` overlapping calls as the runtime runs them
    in ``mode`` (the schedule of :func:`roundpipe_stale_schedule`, without clipping;
    each hand-off does its stage's optimizer work, ``overlap`` steps the next call's
    embedding rows first), weights moving in chunks of
    ``chunk_bytes``; ``frozen``: the layers holding frozen weights (LoRA)."""
    # The runtime steps first the embedding rows the next call looks up (OR) when the
    # exact mode moves a trained table by rows, as the stand-in's does here.
    rows = (0,) if em.rows_first_pays() and 0 not in frozen else ()
    s = roundpipe_stale_schedule(plan, DEVICES, microbatches, calls=calls,
                                 staleness=1 if mode == "stale" else 0, frozen=frozen,
                                 rows_first=rows)
    return run(s, ActionTimes(plan, em.costs, chunk_bytes,
                              optimizer_ms=em.optimizer_ms(plan, False)))


def measure(label, em, plan, schedule, mode, grain, microbatches, steps, sim_tl,
            gate=True, chunk_mb=32.0, prepare=None):
    """Run ``steps`` training steps (after warm-up) and return the row. Tokens/s: the
    wall time between train_step returns (overlapping calls: the steady state). With
    overlapping calls, ``rt/sim`` and the bubble compare the steady-state step of the
    runtime's timeline of the measured calls with the simulator's (``sim_tl``).
    ``prepare(model)``: applied to the stand-in first (e.g. freezing a LoRA-like base)."""
    torch.manual_seed(0)
    model = em.stand_in()
    if prepare is not None:
        prepare(model)
    cfg = rotapipe.PipeConfig(workers=DEVICES, microbatches=microbatches,
                              backend="emulated", emulation=em, optimizer_mode=mode,
                              grain=grain, check_races=False, gate_copies=gate,
                              copy_chunk_mb=chunk_mb)
    # The embedding moves by rows, as a wrapped Hugging Face model's does (the costs
    # price it with call_tokens).
    pipe = rotapipe.RoundPipe(model, lm_loss, config=cfg, plan=plan,
                              lookups={model[0].tok: lambda ids: ids})
    pipe.attach_optimizer(torch.optim.AdamW(pipe.parameters(), lr=1e-4))
    if schedule is not None:
        pipe.use_schedule(schedule)
    x, y = stride_batch(microbatches, 16, 32)
    tokens = em.costs.tokens * microbatches
    overlapping = mode in PIPELINED and schedule is None
    try:
        for _ in range(WARMUP if overlapping else 1):   # warm-up (autograd, allocator)
            pipe.train_step(x, y)
        t0 = time.perf_counter()
        ratios, reps = [], []
        for _ in range(steps):
            pipe.train_step(x, y)
            if not overlapping:
                tl = scaled(pipe.last_timeline(), em.dilation)
                ratios.append(tl.makespan / sim_tl.makespan)
                reps.append(report(tl, tokens, memory_sizes(em.costs)))
        step_s = (time.perf_counter() - t0) / steps / em.dilation
        pipe.flush()
        if overlapping:
            tl = scaled(pipe.last_timeline(calls=WARMUP + steps), em.dilation)
            reps = [report(tl, tokens, memory_sizes(em.costs))]
            sim_ms = loss_period(sim_tl, plan, steps)
            ratios = [loss_period(tl, plan, steps) / sim_ms]
        else:
            sim_ms = sim_tl.makespan
    finally:
        pipe.close()
    rep = reps[-1]
    return dict(label=label, tokens=tokens / step_s, step_s=step_s,
                bubble=sum(r.bubble.total for r in reps) / len(reps),
                exposed=sum(r.exposed_comm for r in reps) / len(reps),
                memory=rep.peak_bytes, ratio=sum(ratios) / len(ratios),
                sim_tokens=tokens / (sim_ms / 1e3))


def planned(costs, microbatches: int, stale: bool = False):
    """The planner's choice for RoundPipe on the emulated 8x RTX 4090: for one exact call,
    or with ``stale`` for the steady state of overlapping calls (``rotapipe plan
    --stale``)."""
    return choose_plan(lambda m: costs,
                       PlannerConfig(DEVICES, USABLE, microbatch_counts=(microbatches,),
                                     tail_jobs=(1, 2, 3, 4), stale=stale))


def bench(model: str, args) -> list[dict]:
    em0 = TimedEmulation.of(model, "rtx4090x8", seq=args.seq,
                            optimizer_params_per_s=args.optimizer_rate,
                            call_tokens=args.seq * args.microbatches)
    M = args.microbatches
    choice = planned(em0.costs, M)
    costs = choice.costs
    sim_rp = run(rotapipe.roundpipe_schedule(choice.plan, DEVICES, M),
                 ActionTimes(choice.plan, costs))
    # Slow down enough that the shortest compute action takes --min-action-ms of real
    # time (Python overhead per action is a fraction of a millisecond), and the call
    # about --target-s seconds, whichever is slower.
    em = replace(em0, costs=costs).calibrated(choice.plan, sim_rp.schedule,
                                              min_action_ms=args.min_action_ms,
                                              target_s=args.target_s)
    dilation = args.dilation or em.dilation
    em = replace(em, dilation=dilation)
    em_b = replace(em0, dilation=dilation)
    runs = [(f"roundpipe {mode}", em, choice.plan, None, mode, choice.grain.value,
             sim_rp if mode == "sync" else
             pipelined_sim(em, choice.plan, mode, M, WARMUP + args.steps))
            for mode in ("sync", "overlap")]
    # stale runs the plan the planner picks for it (``rotapipe plan --stale``: the
    # steady state of overlapping calls), at the same dilation.
    lagged = planned(em0.costs, M, stale=True)
    em_s = replace(em, costs=lagged.costs)
    runs.append(("roundpipe stale", em_s, lagged.plan, None, "stale", lagged.grain.value,
                 pipelined_sim(em_s, lagged.plan, "stale", M, WARMUP + args.steps)))
    for name, mode in (("1f1b", "sync"), ("1f1b", "overlap"), ("gpipe", "sync")):
        plan, schedule, sim_tl, _, recompute = baseline(em0.costs, name, M)
        label = name + (" +R" if recompute else "") + (f" {mode}" if mode != "sync" else "")
        runs.append((label, em_b, plan, schedule, mode, "stage", sim_tl))
    plan, schedule, sim_tl, v = mobius(em0.costs, M)
    runs.append((f"mobius v={v}", em_b, plan, schedule, "sync", "stage", sim_tl))
    rows = []
    for label, e, plan, schedule, mode, grain, sim_tl in runs:
        row = measure(label, e, plan, schedule, mode, grain, M, args.steps, sim_tl)
        if args.ungated:
            # The same schedule with every weight copy issued at once (gate_copies=False),
            # one measured step.
            off = measure(label, e, plan, schedule, mode, grain, M, 1, sim_tl, gate=False)
            row["ungated"] = off["tokens"]
        rows.append(row)
    base = rows[3]["tokens"]      # 1F1B with the optimizer stepped after the call
    for r in rows:
        r["speedup"] = r["tokens"] / base
    print(f"\n{model}: seq {args.seq}, {M} microbatches, plan {choice.plan.to_text()} "
          f"(grain {choice.grain.value}), dilation {dilation:.2f}x")
    print(f"stale's plan {lagged.plan.to_text()} (grain {lagged.grain.value})")
    gated = f" {'ungated':>9s} {'gating':>7s}" if args.ungated else ""
    print(f"{'schedule':18s} {'tokens/s':>9s} {'sim tok/s':>9s} {'step s':>7s} "
          f"{'vs 1f1b':>8s} {'bubble':>7s} {'exp.comm':>8s} {'mem GiB':>8s} "
          f"{'rt/sim':>7s}{gated}")
    for r in rows:
        fits = "" if r["memory"] <= USABLE else " (does not fit)"
        off = f" {r['ungated']:9,.0f} {r['tokens'] / r['ungated']:6.2f}x" \
            if args.ungated else ""
        print(f"{r['label']:18s} {r['tokens']:9,.0f} {r['sim_tokens']:9,.0f} "
              f"{r['step_s']:7.2f} {r['speedup']:7.2f}x {r['bubble']:7.1%} "
              f"{r['exposed']:8.1%} {r['memory'] / GIB:8.1f} {r['ratio']:7.3f}{off}{fits}")
    overlap, stale = rows[1]["tokens"], rows[2]["tokens"]
    print(f"overlap keeps {overlap / stale:.1%} of stale's tokens/s (each on its plan); "
          f"stale over sync "
          f"{stale / rows[0]['tokens']:.2f}x")
    return rows


def lora_costs(model: str, seq: int, quantize: str | None, rank: int = 16,
               call_tokens: int | None = None):
    """The planner's costs of LoRA of ``rank`` on a frozen base (NF4 with ``quantize``)
    on one RTX 4090, and the adapters' parameters per layer: ``model_costs`` with the
    adapters (:func:`rotapipe.plan.model_work`): a frozen weight's backward computes
    only its input gradient, the adapters add their own FLOPs, and only their bf16
    gradients are downloaded (``grad_ms``)."""
    hw = rotapipe.plan.hardware("rtx4090x8")
    trainable = lora_params(model, rank)
    costs = rotapipe.plan.model_costs(model, hw, seq=seq, quantize=quantize,
                                      adapters=trainable, call_tokens=call_tokens)
    return costs, trainable


def lora_bench(model: str, args) -> list[dict]:
    """LoRA and QLoRA rows of ``model``: the planner's plan for each (which fits the
    device with the adapters' gradients), one timed run each (``sync`` optimizer;
    adapters' optimizer time left out: ``trainable=False``). No memory column (the
    planner checked the fit; ``rotapipe simulate --lora`` prints the simulator's peak,
    with the adapters' gradients at their own size)."""
    M, rows = args.microbatches, []
    for quantize in (None, "nf4"):
        costs, trainable = lora_costs(model, args.seq, quantize,
                                      call_tokens=args.seq * M)
        choice = choose_plan(lambda m: costs, PlannerConfig(
            DEVICES, USABLE, microbatch_counts=(M,), tail_jobs=(1, 2, 3, 4),
            grad_bytes=tuple(2 * t for t in trainable)))
        sim = run(rotapipe.roundpipe_schedule(choice.plan, DEVICES, M),
                  ActionTimes(choice.plan, costs))
        times = ActionTimes(choice.plan, costs)
        shortest = min(sum(times(a)) for a in sim.schedule.actions
                       if a.lane.value == "compute" and sum(times(a)) > 0)
        dilation = args.dilation or max(args.target_s * 1e3 / sim.makespan,
                                        args.min_action_ms / shortest)
        em = TimedEmulation(costs, dilation, args.optimizer_rate, trainable=False)
        label = "QLoRA (NF4 base)" if quantize else "LoRA (bf16 base)"
        row = measure(label, em, choice.plan, None, "sync", choice.grain.value, M,
                      args.steps, sim)
        row.update(plan=choice.plan, dilation=dilation,
                   upload_gb=sum(l.upload_ms for l in costs.layers)
                   * hardware_link(costs) / 1e9)
        rows.append(row)
    print(f"\n{model}: LoRA r=16 vs QLoRA, seq {args.seq}, {M} microbatches, sync "
          "optimizer")
    print(f"{'base':18s} {'tokens/s':>9s} {'sim tok/s':>9s} {'rt/sim':>7s} "
          f"{'step s':>7s} {'bubble':>7s} {'stages F/B':>10s} "
          f"{'upload GB':>9s} {'dilation':>8s}")
    for r in rows:
        p = r["plan"]
        print(f"{r['label']:18s} {r['tokens']:9,.0f} {r['sim_tokens']:9,.0f} "
              f"{r['ratio']:7.3f} {r['step_s']:7.2f} {r['bubble']:7.1%} "
              f"{len(p.forward):>4d}/{len(p.backward):<5d} "
              f"{r['upload_gb']:9.1f} {r['dilation']:8.2f}")
    print(f"QLoRA over LoRA: {rows[1]['tokens'] / rows[0]['tokens']:.2f}x measured, "
          f"{rows[1]['sim_tokens'] / rows[0]['sim_tokens']:.2f}x simulated")
    return rows


def hardware_link(costs) -> float:
    """Bytes per ms of the host link (from the LM head, uploaded whole in bf16 in both;
    the embedding moves by rows): ``upload GB`` is one pass over every layer's weights
    as uploaded."""
    l = costs.layers[-1]
    return l.weight_bytes / l.upload_ms


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen3-1.7b,llama-3.1-8b,qwen3-32b")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--microbatches", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4,
                    help="measured steps per schedule (after warm-up)")
    ap.add_argument("--target-s", type=float, default=2.0,
                    help="real seconds one RoundPipe call should take (sets the dilation)")
    ap.add_argument("--min-action-ms", type=float, default=20.0,
                    help="real milliseconds the shortest compute action should take")
    ap.add_argument("--dilation", type=float, default=None, help="fixed dilation instead")
    ap.add_argument("--optimizer-rate", type=float, default=5e9,
                    help="host optimizer throughput, parameters/s")
    ap.add_argument("--no-ungated", dest="ungated", action="store_false",
                    help="skip the gate_copies=False ablation column")
    ap.add_argument("--lora", action="store_true",
                    help="LoRA vs QLoRA rows (default models: qwen3-32b,qwen3-235b-a22b)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"emulated {DEVICES}x RTX 4090 (usable {USABLE / GIB:.1f} GiB each), host optimizer "
          f"{args.optimizer_rate:.1e} params/s; torch threads 1")
    if args.lora and args.models == ap.get_default("models"):
        args.models = "qwen3-32b,qwen3-235b-a22b"
    for model in args.models.split(","):
        (lora_bench if args.lora else bench)(model.strip(), args)


if __name__ == "__main__":
    main()
