"""The three optimizer modes on a tiny model, on emulated CPU workers (a few seconds).

    python examples/optimizer_modes.py

Trains the same model from the same weights on the same batches with
``PipeConfig(optimizer_mode="sync" | "overlap" | "stale", clip_grad_norm=0.5)``:

- ``overlap`` steps each stage's parameters while shallower stages still run backward,
  and gives bit for bit the weights ``sync`` gives (clipping included);
- ``stale`` runs each call on weights one step old (the RoundPipe paper's
  asynchronous step): its losses differ slightly.

In ``overlap`` and ``stale`` the calls are pipelined: ``train_step`` returns once the
loss is known and the next call starts while this one's backward drains (the printed
overlap is how long each mode's consecutive calls ran side by side). The learning-rate
schedule is attached to the pipeline, which steps it after each optimizer step, and
``step_result`` reports the learning rate each step used.
"""

import torch
from torch import nn

import rotapipe

VOCAB, SEQ, DIM, STEPS = 32, 16, 32, 8


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)

    def forward(self, ids):                    # [b, t] -> [b, t, DIM]
        return self.emb(ids)


def model() -> nn.Sequential:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, 2 * DIM), nn.GELU(),
                            nn.Linear(2 * DIM, DIM)) for _ in range(4)]
    return nn.Sequential(Embed(), *blocks, nn.Linear(DIM, VOCAB))


def loss_fn(logits, labels):                   # logits [b, t, VOCAB], labels [b, t]
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def batches():
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x = torch.randint(0, VOCAB, (16, SEQ), generator=g)
        yield x, (x + 1) % VOCAB               # predict the next token id


def train(mode: str) -> tuple[list[float], dict[str, torch.Tensor], float, list[float]]:
    config = rotapipe.PipeConfig(workers=2, microbatches=4, backend="emulated",
                                 optimizer_mode=mode, clip_grad_norm=0.5)
    with rotapipe.RoundPipe(model(), loss_fn, config=config) as pipe:
        opt = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        pipe.attach_optimizer(opt, scheduler=sched)   # stepped after each step
        losses = [pipe.train_step(x, y) for x, y in batches()]
        lrs = [pipe.step_result(c).lrs[0] for c in range(STEPS)]
        state = pipe.state_dict()              # waits for the calls in flight
        tl = pipe.last_timeline(calls=STEPS)
        # How long consecutive calls ran at the same time (0 when one at a time).
        spans = {}
        for sp in tl.spans:
            lo, hi = spans.get(sp.action.call, (sp.start, sp.end))
            spans[sp.action.call] = (min(lo, sp.start), max(hi, sp.end))
        side_by_side = sum(max(0.0, spans[c][1] - spans[c + 1][0])
                           for c in sorted(spans)[:-1])
        return losses, state, side_by_side, lrs


def main():
    runs = {mode: train(mode) for mode in ("sync", "overlap", "stale")}
    for mode, (losses, _, overlap, lrs) in runs.items():
        print(f"{mode:8s} losses " + " ".join(f"{l:.3f}" for l in losses)
              + f"   calls side by side {overlap:6.1f} ms")
    print("learning rate of each step (step_result): "
          + " ".join(f"{lr:.1e}" for lr in runs["overlap"][3]))
    sync, overlap = runs["sync"][1], runs["overlap"][1]
    same = all(torch.equal(sync[k], overlap[k]) for k in sync)
    print(f"overlap weights == sync weights, bit for bit: {same}")
    assert same and runs["overlap"][0] == runs["sync"][0], "overlap must equal sync"
    drift = max((runs["stale"][1][k] - sync[k]).abs().max().item() for k in sync)
    print(f"stale differs from sync by at most {drift:.2e} (one step stale)")


if __name__ == "__main__":
    main()
