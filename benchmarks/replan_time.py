"""The runtime planner on small models: its exact search against the ranked candidates.

A pipeline's first plan for a model of at most 6 layers comes from the exact search
(``rotapipe.planner.pipeline.RUNTIME_EXHAUSTIVE``); every re-plan of
``partition="refine"`` (the default on CUDA) takes the ranked candidates, since it runs
in the caller's thread between calls. For a 6-layer ``tiny_transformer`` (tests/models)
and a random 4-block Hugging Face Qwen3 (hidden 256, 32k vocabulary; 6 layers with its
embedding and head), on 1-4 emulated workers and 1-16 microbatches, with the
pipeline's own estimated costs: the time of each search (the best of ``--runs``) and
the simulated step of the ranked choice over the exact one.

    python benchmarks/replan_time.py [--runs 1]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "tests"))

import rotapipe  # noqa: E402
from models import emulated, lm_loss, tiny_transformer  # noqa: E402
from rotapipe.planner.autoplan import simulate_plan  # noqa: E402
from rotapipe.planner.pipeline import RUNTIME_EXHAUSTIVE  # noqa: E402


def pipes(workers: int, microbatches: int):
    import transformers
    from rotapipe.adapters import wrap_hf
    torch.manual_seed(0)
    yield "tiny_transformer", rotapipe.RoundPipe(tiny_transformer(tied=True), lm_loss,
                                                 config=emulated(workers, microbatches))
    hf = wrap_hf(transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, vocab_size=32000, tie_word_embeddings=False)))
    yield "Qwen3, 4 blocks", hf.pipe(rotapipe.PipeConfig(
        workers=workers, microbatches=microbatches, backend="emulated"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=1)
    args = ap.parse_args()
    print(f"planner search time, the best of {args.runs} run(s), in the caller's thread; "
          f"torch threads {torch.get_num_threads()}; step simulated with the pipeline's "
          f"estimated costs")
    print(f"{'model':17s} {'workers':>7s} {'mb':>3s} {'exact ms':>9s} {'ranked ms':>10s} "
          f"{'ranked / exact step':>20s}")
    ratios, times = [], {True: [], False: []}
    for workers in (1, 2, 3, 4):
        for m in (1, 2, 4, 8, 16):
            for name, pipe in pipes(workers, m):
                with pipe:
                    planner = pipe._planner
                    step, ms = {}, {}
                    for exact in (True, False):
                        limit = RUNTIME_EXHAUSTIVE if exact else 0
                        best = float("inf")
                        for _ in range(args.runs):
                            t = time.perf_counter()
                            plan = planner._choose(planner.base, exhaustive=limit)
                            best = min(best, time.perf_counter() - t)
                        ms[exact] = best * 1e3
                        times[exact].append(ms[exact])
                        step[exact] = simulate_plan(plan, planner.base, workers, m).step_ms
                ratios.append(step[False] / step[True])
                print(f"{name:17s} {workers:7d} {m:3d} {ms[True]:9.0f} {ms[False]:10.0f} "
                      f"{ratios[-1]:20.4f}")
    same = sum(abs(r - 1) < 1e-9 for r in ratios)
    print(f"\nexact {min(times[True]):.0f}-{max(times[True]):.0f} ms, ranked "
          f"{min(times[False]):.0f}-{max(times[False]):.0f} ms; the same step on {same} of "
          f"{len(ratios)} shapes, at most {max(ratios):.4f}x the exact one")


if __name__ == "__main__":
    main()
