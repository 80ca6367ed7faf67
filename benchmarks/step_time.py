"""Step time of rotapipe on 1 emulated worker against plain PyTorch with per-layer
activation checkpointing, on the same ~20M-parameter GPT-like model, in one run.

Both sides run a full training step (forward + backward + fused AdamW step) on the same
batch, with the same weights, precision and torch thread count. The contenders are
interleaved step by step (ABAB, then BABA, ...) so that load from other processes on
the machine hits both alike; the table reports the median step time of each and the
ratio of the medians (the issue's target: rotapipe / plain <= 1.15).

The plain baseline checkpoints every transformer block
(``torch.utils.checkpoint``, ``use_reentrant=False``) and runs the embedding and the
head + loss without checkpointing: that is what rotapipe's plan does too (backward
stages recompute the blocks from host checkpoints; the fused tail runs the head, the
loss and its backward without recompute; the embedding needs only the token ids).
One difference is structural: torch's non-reentrant checkpoint stops recomputing a
block once its last saved tensor is rebuilt, so each block's final matmul is skipped in
the recompute, while a rotapipe backward stage recomputes its whole forward (its graph
must be rebuilt on a stateless worker). ``--no-early-stop`` shows the ratio without it.

    python benchmarks/step_time.py                      # fp32, grain stage and layer
    python benchmarks/step_time.py --dtype fp32,bf16 --steps 20
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

import rotapipe
from rotapipe.model.tiny import Block   # pre-norm attention + 4x GELU MLP


# -- the model: embedding, pre-norm blocks, final norm + (tied) head ---------------------
class Embed(nn.Module):
    def __init__(self, vocab: int, dim: int, seq: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)

    def forward(self, ids):                       # (b, t) int64 -> (b, t, dim)
        return self.tok(ids) + self.pos.weight[: ids.shape[1]]


class Head(nn.Module):
    def __init__(self, dim: int, tok: nn.Embedding):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.tok = tok                            # tied to the input embedding

    def forward(self, x):                         # (b, t, dim) -> (b, t, vocab)
        return self.norm(x) @ self.tok.weight.t()


def gpt(vocab: int, dim: int, layers: int, seq: int, heads: int) -> nn.Sequential:
    torch.manual_seed(0)
    embed = Embed(vocab, dim, seq)
    blocks = [Block(dim, heads) for _ in range(layers)]
    return nn.Sequential(embed, *blocks, Head(dim, embed.tok))


def lm_loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


# -- the two contenders ------------------------------------------------------------------
class Plain:
    """Plain PyTorch: every block checkpointed; embedding and head + loss are not."""

    def __init__(self, model: nn.Sequential, dtype: torch.dtype, early_stop: bool = True):
        self.model, self.dtype, self.early_stop = model, dtype, early_stop
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step(self, x, y) -> float:
        m = self.model
        with torch.autocast("cpu", dtype=self.dtype, enabled=self.dtype != torch.float32), \
                set_checkpoint_early_stop(self.early_stop):
            h = m[0](x)
            for block in m[1:-1]:
                h = checkpoint(block, h, use_reentrant=False)
            loss = lm_loss(m[-1](h), y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()


class Rota:
    """rotapipe on one emulated worker."""

    def __init__(self, model: nn.Sequential, dtype: torch.dtype, args, grain: str):
        cfg = rotapipe.PipeConfig(
            workers=1, microbatches=args.microbatches, backend="emulated", grain=grain,
            forward_stages=args.forward_stages, backward_stages=args.backward_stages,
            check_races=not args.no_race_check,
            precision=rotapipe.PrecisionConfig(compute_dtype=dtype))
        self.pipe = rotapipe.RoundPipe(model, lm_loss, config=cfg)
        self.pipe.attach_optimizer(
            torch.optim.AdamW(self.pipe.parameters(), lr=1e-4, fused=True))

    def step(self, x, y) -> float:
        loss = self.pipe.forward_backward(x, y)
        self.pipe.step()
        return loss

    def close(self):
        self.pipe.close()


def _timed(c, x, y) -> tuple[float, float]:
    """Wall and process CPU seconds of one step (CPU time, summed over every thread of
    the process, is much less sensitive to other processes on the machine)."""
    w0, c0 = time.perf_counter(), time.process_time()
    c.step(x, y)
    return time.perf_counter() - w0, time.process_time() - c0


def measure(args, dtype: torch.dtype, grain: str) -> dict:
    model = gpt(args.vocab, args.dim, args.layers, args.seq, args.heads)
    plain = Plain(copy.deepcopy(model), dtype, not args.no_early_stop)
    rota = Rota(model, dtype, args, grain)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    y = torch.roll(x, -1, dims=1)
    first = (plain.step(x, y), rota.step(x, y))    # same weights: same first loss
    for _ in range(args.warmup - 1):
        plain.step(x, y)
        rota.step(x, y)
    wall = {"plain": [], "rota": []}
    cpu = {"plain": [], "rota": []}
    for i in range(args.steps):
        # ABAB then BABA...: neither side always runs right after the other.
        order = (plain, rota) if i % 2 == 0 else (rota, plain)
        for c in order:
            w, t = _timed(c, x, y)
            name = "plain" if c is plain else "rota"
            wall[name].append(w)
            cpu[name].append(t)
    rota.close()
    med = statistics.median
    p, r = med(wall["plain"]), med(wall["rota"])
    return {"plain": p, "rota": r, "ratio": r / p,
            "pair_ratio": med(a / b for a, b in zip(wall["rota"], wall["plain"])),
            "cpu_ratio": med(cpu["rota"]) / med(cpu["plain"]),
            "loss_diff": abs(first[0] - first[1]), "plan": rota.pipe.plan.to_text()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=16, help="timed steps per contender")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per contender")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--layers", type=int, default=6, help="transformer blocks")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=1)
    ap.add_argument("--dtype", default="fp32", help="comma list of fp32, bf16")
    ap.add_argument("--grain", default="stage,layer", help="comma list of stage, layer")
    ap.add_argument("--forward-stages", type=int, default=None,
                    help="rotapipe forward stages (default: the library's, 2 per worker)")
    ap.add_argument("--backward-stages", type=int, default=None,
                    help="rotapipe backward stages (default: the library's, 3x forward)")
    ap.add_argument("--no-race-check", action="store_true",
                    help="turn rotapipe's emulated stream-race checker off (default: on, "
                    "as in the library's default config)")
    ap.add_argument("--no-early-stop", action="store_true",
                    help="baseline: turn off torch.utils.checkpoint's early stop (by "
                    "default its recompute stops once the last saved tensor is rebuilt, "
                    "skipping each block's final matmul; rotapipe recomputes whole stages)")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    probe = gpt(args.vocab, args.dim, args.layers, args.seq, args.heads)
    n_params = sum(p.numel() for p in probe.parameters())
    print(f"model: GPT-like, {args.layers} blocks, dim {args.dim}, {args.heads} heads, "
          f"vocab {args.vocab} (tied head), {n_params / 1e6:.1f}M parameters")
    print(f"batch {args.batch} x seq {args.seq}, rotapipe: 1 emulated worker, "
          f"{args.microbatches} microbatch(es); AdamW fused=True on both sides")
    print(f"torch {torch.__version__}, torch.get_num_threads() = {torch.get_num_threads()} "
          f"(set with --threads; process-wide, so the emulated stream threads share it), "
          f"interop threads = {torch.get_num_interop_threads()}")
    print(f"{args.warmup} warmup + {args.steps} timed steps each, interleaved; medians\n")
    head = f"{'dtype':<6} {'grain':<6} {'plain s':>8} {'rotapipe s':>10} {'ratio':>6} " \
           f"{'pairwise':>8} {'cpu':>6} {'|dloss|':>8}  plan"
    print(head)
    print("-" * len(head))
    for dt in args.dtype.split(","):
        dtype = rotapipe.config.resolve_dtype(dt)
        for grain in args.grain.split(","):
            r = measure(args, dtype, grain)
            print(f"{dt:<6} {grain:<6} {r['plain']:>8.3f} {r['rota']:>10.3f} "
                  f"{r['ratio']:>6.3f} {r['pair_ratio']:>8.3f} {r['cpu_ratio']:>6.3f} "
                  f"{r['loss_diff']:>8.1e}  "
                  f"{r['plan']}", flush=True)
    print("\nratio: median rotapipe step / median plain step (the issue's target: <= 1.15)."
          "\npairwise: median of the ratios of adjacent steps. cpu: the ratio of median "
          "process CPU times\n(all threads), less sensitive to other load on the machine."
          "\n|dloss|: first-step loss difference (fp32: same math, expect 0; bf16: rotapipe "
          "computes\nwith bf16 weights and fp32 masters, plain with torch.autocast over fp32 "
          "weights).")


if __name__ == "__main__":
    main()
