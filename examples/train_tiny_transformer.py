"""Train a small transformer with rotapipe on emulated CPU workers.

    python examples/train_tiny_transformer.py [--steps 60] [--workers 2]

The model is a plain list of layers: an embedding, a few ``nn.TransformerEncoderLayer``
blocks (with dropout) and an LM head. The causal mask is a *side input*: built once per
microbatch on the host, uploaded once per worker, and passed to every layer as
``layer(x, src_mask=mask)``. The task: each sequence climbs by a fixed random stride,
so the next token follows from the previous two and the loss falls towards zero.
"""

import argparse

import torch
from torch import nn

import rotapipe

VOCAB, SEQ, DIM = 64, 32, 64


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)

    def forward(self, ids, src_mask):          # ids [b, t] -> [b, t, DIM]
        return self.tok(ids) + self.pos(torch.arange(ids.shape[1]))


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.out = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)

    def forward(self, x, src_mask):            # [b, t, DIM] -> logits [b, t, VOCAB]
        return self.out(self.norm(x))


def batch(n, gen):
    """Token t+1 = token t + stride (mod VOCAB); inputs and next-token labels [n, SEQ]."""
    start = torch.randint(0, VOCAB, (n, 1), generator=gen)
    stride = torch.randint(1, 5, (n, 1), generator=gen)
    tokens = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    return tokens[:, :-1], tokens[:, 1:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()

    torch.manual_seed(0)
    blocks = [nn.TransformerEncoderLayer(DIM, nhead=4, dim_feedforward=4 * DIM, dropout=0.1,
                                         batch_first=True, norm_first=True) for _ in range(4)]
    layers = [Embed(), *blocks, Head()]

    def loss_fn(logits, labels):               # mean over the microbatch's tokens
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))

    def side_inputs(ids):                      # one causal mask [t, t] per microbatch
        return {"src_mask": nn.Transformer.generate_square_subsequent_mask(ids.shape[1])}

    config = rotapipe.PipeConfig(workers=args.workers, microbatches=4, backend="emulated")
    pipe = rotapipe.RoundPipe(layers, loss_fn, config=config, side_inputs=side_inputs)
    # The masters are the layers' own parameters (fp32, in host memory).
    pipe.attach_optimizer(torch.optim.AdamW(pipe.parameters(), lr=5e-3, fused=True))

    gen = torch.Generator().manual_seed(0)
    for step in range(1, args.steps + 1):
        x, y = batch(32, gen)
        loss = pipe.forward_backward(x, y)     # mean loss over the 32 sequences
        pipe.step()
        if step == 1 or step % 10 == 0:
            print(f"step {step:3d}  loss {loss:.3f}")

    pipe.eval()
    x, y = batch(64, gen)
    accuracy = (pipe(x).argmax(-1)[:, 1:] == y[:, 1:]).float().mean().item()
    print(f"next-token accuracy after the first token: {accuracy:.1%}")
    weights = pipe.state_dict()                # keyed like nn.Sequential(*layers)
    print(f"{len(weights)} tensors in the trained state_dict")
    pipe.close()


if __name__ == "__main__":
    main()
