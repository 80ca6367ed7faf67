"""Peak host memory of the causal-LM loss (LM head + cross-entropy, forward and
backward), full logits against the chunked head of ``rotapipe.adapters``.

Each case runs in a fresh subprocess: it builds the head weight and the hidden states,
reads its resident set size (RSS), runs loss + backward, and reports the peak RSS
(``ru_maxrss``) above that baseline: the loss's own working memory, gradients included.
The unchunked case is skipped when the machine has too little free memory for it.

    python benchmarks/chunked_loss_memory.py                 # vocab 151936 x 8192 tokens
    python benchmarks/chunked_loss_memory.py --tokens 2048 --hidden 64
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, resource, sys, time
import torch
from torch import nn
from rotapipe.adapters.loss import LMHead, lm_loss, unchunked_lm_loss, chunk_size
torch.set_num_threads({threads})
torch.manual_seed(0)
V, N, H, chunk = {vocab}, {tokens}, {hidden}, {chunk}
g = torch.Generator().manual_seed(0)
head = nn.Linear(H, V, bias=False)
h = torch.randn(1, N, H, generator=g).requires_grad_()
labels = torch.randint(0, V, (1, N), generator=g)
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()
base = rss()
t = time.perf_counter()
if chunk == 0:
    loss = unchunked_lm_loss(head(h), labels)
else:
    loss = lm_loss(h, labels, LMHead(head), chunk_tokens=None if chunk < 0 else chunk)
loss.backward()
dt = time.perf_counter() - t
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps(dict(peak=peak - base, seconds=dt, loss=loss.item(),
                      chunk=chunk_size(V, None if chunk < 0 else chunk) if chunk else N)))
"""


def available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def run(chunk: int, args) -> dict:
    code = CHILD.format(vocab=args.vocab, tokens=args.tokens, hidden=args.hidden,
                        chunk=chunk, threads=args.threads)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1]}
    return json.loads(out.stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=128,
                   help="hidden size (the logits' memory does not depend on it)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    logits = args.vocab * args.tokens * 4
    print(f"LM head + cross-entropy, forward + backward, fp32, vocab {args.vocab} x "
          f"{args.tokens} tokens, hidden {args.hidden}, {args.threads} threads")
    print(f"one fp32 logits tensor: {logits / 2**30:.2f} GiB\n")
    print(f"{'variant':<34}{'chunk tokens':>13}{'peak above inputs':>19}{'time':>9}")
    cases = [("unchunked (HF ForCausalLMLoss)", 0), ("chunked, default (256 MiB)", -1),
             ("chunked, 1024 tokens", 1024), ("chunked, 128 tokens", 128)]
    results = {}
    for name, chunk in cases:
        if chunk == 0 and available_bytes() < 4 * logits:
            print(f"{name:<34}{'-':>13}{'skipped: needs ~' + f'{4 * logits / 2**30:.0f} GiB':>19}")
            continue
        r = run(chunk, args)
        results[name] = r
        if "error" in r:
            print(f"{name:<34}  failed: {r['error']}")
            continue
        print(f"{name:<34}{r['chunk']:>13}{r['peak'] / 2**20:>15.0f} MiB"
              f"{r['seconds']:>8.1f}s")
    losses = {n: r["loss"] for n, r in results.items() if "loss" in r}
    if len(losses) > 1:
        spread = max(losses.values()) - min(losses.values())
        print(f"\nloss spread across variants: {spread:.2e}")


if __name__ == "__main__":
    main()
