"""Train one tiny model with RoundPipe, 1F1B and Mobius, in the same runtime.

    python examples/baselines_runtime.py [--steps 5] [--workers 2] [--microbatches 4]

Both runs use emulated CPU workers, the same initial weights, data and random streams.
RoundPipe runs its own schedule over its own plan; 1F1B runs over a *bound* plan (one
chunk per worker) with the schedule the simulator uses, generated with
``offload_optimizer=True``: each call uploads a chunk's weights to its worker, keeps
every microbatch's autograd graph there until its backward, and hands the weight
gradients back to the host optimizer. Mobius runs over two chunks per worker and
swaps each chunk's weights in for its forwards and again for its backwards
(``mobius_schedule``: at most two chunks' weights on a worker), recomputing in the
backward. The runs compute the same thing, so the losses printed side by side are
equal (bit for bit for 1F1B here; Mobius to float rounding: its chunks differ).
"""

import argparse
import copy

import torch

import rotapipe
from rotapipe.model.tiny import lm_loss, stride_batch, tiny_gpt
from rotapipe.plan import bound_plan
from rotapipe.schedule import mobius_schedule, one_f_one_b_schedule


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=4)
    args = ap.parse_args()
    W, M = args.workers, args.microbatches

    torch.manual_seed(0)
    model = tiny_gpt(vocab=64, dim=32, layers=4, heads=2, seq=16, dropout=0.1)
    config = rotapipe.PipeConfig(workers=W, microbatches=M, backend="emulated")

    def adamw(params):
        return torch.optim.AdamW(params, lr=3e-3)

    roundpipe = rotapipe.RoundPipe(copy.deepcopy(model), lm_loss, config=config,
                                   optimizer=adamw)
    baseline = rotapipe.RoundPipe(copy.deepcopy(model), lm_loss, config=config,
                                  optimizer=adamw, plan=bound_plan([1.0] * len(model), W))
    schedule = one_f_one_b_schedule(baseline.plan, W, M, offload_optimizer=True)
    baseline.use_schedule(schedule)
    print(f"1F1B on {W} workers, {M} microbatches, plan {baseline.plan.to_text()}:")
    print(schedule.grid())
    mobius = rotapipe.RoundPipe(copy.deepcopy(model), lm_loss, config=config,
                                optimizer=adamw,
                                plan=bound_plan([1.0] * len(model), 2 * W, devices=W))
    mobius.use_schedule(mobius_schedule(mobius.plan, W, M))
    print(f"\nMobius plan {mobius.plan.to_text()}")
    print(f"RoundPipe plan {roundpipe.plan.to_text()}\n")

    gen = torch.Generator().manual_seed(1)
    print("step  roundpipe loss  1f1b loss  mobius loss")
    with roundpipe, baseline, mobius:
        for step in range(args.steps):
            x, y = stride_batch(4 * M, 16, vocab=64, generator=gen)
            losses = []
            for pipe in (roundpipe, baseline, mobius):
                losses.append(pipe.forward_backward(x, y))
                pipe.step()
            print(f"{step:4d}  {losses[0]:14.6f}  {losses[1]:9.6f}  {losses[2]:11.6f}")
            assert losses[0] == losses[1], losses                  # bit for bit
            assert abs(losses[0] - losses[2]) <= 1e-5 * abs(losses[2]), losses


if __name__ == "__main__":
    main()
