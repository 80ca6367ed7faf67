"""The three optimizer modes on a tiny model, on emulated CPU workers (a few seconds).

    python examples/optimizer_modes.py

Trains the same model from the same weights on the same batches with
``PipeConfig(optimizer_mode="sync" | "overlap" | "stale", clip_grad_norm=0.5)``:

- ``overlap`` steps each stage's parameters while shallower stages still run backward,
  and gives bit for bit the weights ``sync`` gives (clipping included);
- ``stale`` runs each call on weights one step old (the RoundPipe paper's
  asynchronous step): its losses differ slightly, and ``state_dict()`` applies the
  step still pending.
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


def train(mode: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    config = rotapipe.PipeConfig(workers=2, microbatches=4, backend="emulated",
                                 optimizer_mode=mode, clip_grad_norm=0.5)
    with rotapipe.RoundPipe(model(), loss_fn, config=config,
                            optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3)) as pipe:
        losses = [pipe.train_step(x, y) for x, y in batches()]
        return losses, pipe.state_dict()       # stale: applies the pending step


def main():
    runs = {mode: train(mode) for mode in ("sync", "overlap", "stale")}
    for mode, (losses, _) in runs.items():
        print(f"{mode:8s} losses " + " ".join(f"{l:.3f}" for l in losses))
    sync, overlap = runs["sync"][1], runs["overlap"][1]
    same = all(torch.equal(sync[k], overlap[k]) for k in sync)
    print(f"overlap weights == sync weights, bit for bit: {same}")
    drift = max((runs["stale"][1][k] - sync[k]).abs().max().item() for k in sync)
    print(f"stale differs from sync by at most {drift:.2e} (one step stale)")


if __name__ == "__main__":
    main()
