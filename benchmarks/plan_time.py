"""How long ``rotapipe plan`` takes on the shipped model configs, and what the planner's
lower bounds save.

For each of the paper's five models as ``rotapipe plan`` plans them (8x RTX 4090
defaults: 16 x 2048 tokens, every microbatch count dividing 16, both recompute grains,
tails split up to 8 jobs; Qwen3-235B-A22B with ``--lora``, rank 8):

- the planner as ``rotapipe plan`` runs it (``choose_plan``), against the same search
  simulating every ranked candidate (``PlannerConfig(prune=False)``), side by side in
  this process: CPU seconds, candidates simulated, and that both choose the same plan
  and step;
- ``python -m rotapipe plan MODEL`` as a user runs it (imports included: the plan
  command imports neither torch nor transformers), wall and CPU seconds, the best of
  ``--runs`` runs (the machine may be shared);
- the ranked candidates alone on 100 layers (Qwen3-32B's blocks repeated), CPU seconds
  (tests/test_planner.py bounds the number of estimates this takes, not its time);
- last, ``python -m rotapipe simulate --model qwen3-32b --hardware rtx4090x8`` (every
  schedule side by side) the same way.

    python benchmarks/plan_time.py [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from dataclasses import replace

from rotapipe.plan import ModelCosts, hardware, model_costs
from rotapipe.plan.partitioner import Footprint, candidate_plans
from rotapipe.planner.advise import _costs, _trainable
from rotapipe.planner.autoplan import PlannerConfig, choose_plan

# (config, LoRA rank or None): the paper's five models, as issue 16 plans them
MODELS = (("qwen3-1.7b", None), ("llama-3.1-8b", None), ("gpt-oss-20b", None),
          ("qwen3-32b", None), ("qwen3-235b-a22b", 8))


def _cli(*args: str) -> tuple[float, float]:
    """(wall, CPU) seconds of one ``python -m rotapipe ARGS``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "rotapipe", *args], env=os.environ,
                   stdout=subprocess.DEVNULL, check=False)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)
    hw = hardware("rtx4090x8")
    print(f"{'model':22s} {'pruned s':>9s} {'sims':>5s} {'every s':>8s} {'sims':>5s} "
          f"{'speedup':>8s} {'same':>5s} {'CLI wall s':>11s} {'CLI CPU s':>10s}")
    for model, lora in MODELS:
        # As rotapipe plan's analyze() configures the planner.
        trainable, grads = _trainable(model, hw, lora)
        config = PlannerConfig(8, int(0.9 * hw.device.memory_bytes), (1, 2, 4, 8, 16),
                               grad_bytes=grads, tail_jobs=tuple(range(1, 9)))

        def costs_for(m, model=model, trainable=trainable):
            return _costs(model, hw, 2048, 16 // m, adapters=trainable)
        t = time.process_time()
        pruned = choose_plan(costs_for, config)
        t_pruned = time.process_time() - t
        t = time.process_time()
        every = choose_plan(costs_for, replace(config, prune=False))
        t_every = time.process_time() - t
        same = (pruned.plan.to_text(), pruned.microbatches, pruned.grain, pruned.step_ms) == \
            (every.plan.to_text(), every.microbatches, every.grain, every.step_ms)
        flags = ("--lora", "--lora-rank", str(lora)) if lora else ()
        cli = [_cli("plan", model, *flags) for _ in range(args.runs)]
        name = model + (" --lora" if lora else "")
        print(f"{name:22s} {t_pruned:9.2f} {pruned.simulated:5d} {t_every:8.2f} "
              f"{every.simulated:5d} {t_every / t_pruned:7.1f}x {'yes' if same else 'NO':>5s} "
              f"{min(w for w, _ in cli):11.2f} {min(c for _, c in cli):10.2f}")
    base = model_costs("qwen3-32b", hw).layers
    costs = ModelCosts((base[0],) + tuple(base[1 + i % 64] for i in range(98)) + (base[-1],),
                       2048)
    t = time.process_time()
    candidate_plans(Footprint.of(costs, 16), 8, int(21.6 * 2**30))
    print(f"candidate plans, 100 layers: CPU {time.process_time() - t:.2f} s")
    sim = [_cli("simulate", "--model", "qwen3-32b", "--hardware", "rtx4090x8")
           for _ in range(args.runs)]
    print(f"rotapipe simulate --model qwen3-32b: wall {min(w for w, _ in sim):.2f} s, "
          f"CPU {min(c for _, c in sim):.2f} s")


if __name__ == "__main__":
    main()
