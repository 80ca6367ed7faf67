"""Cost of ``wrap_hf``'s wrap-time checks on the shipped model configs at full width.

For each config in ``rotapipe/data/configs`` a model with the real hidden size,
vocabulary, heads and experts but one decoder block (the checks never run the others:
stub blocks stand in for them) is built in bf16 without initialising its weights (pages
never touched cost no memory); the final norm and LM head get random values. Then
``wrap_hf`` runs its checks: one real block on two tokens to learn the blocks' return
type, the model's forward with stub blocks (inputs reach every block unchanged), and
the tail check (HF's logits for random final hidden states, from the forward with stub
blocks, against the adapter's head). The table gives the time of ``wrap_hf`` and of the tail check alone.

    python benchmarks/hf_wrap_checks.py        # 2 intra-op threads
"""

from __future__ import annotations

import time

import torch
import transformers

from rotapipe.adapters import checks, wrap_hf
from rotapipe.adapters import hf
from rotapipe.plan import load_config
from rotapipe.plan.costs import KNOWN_MODELS


def build(name: str):
    cfg = load_config(name)
    cfg.update(num_hidden_layers=1, layer_types=(cfg.get("layer_types") or [None])[:1]
               if cfg.get("layer_types") else None)
    config = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items()
                                                  if v is not None})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.to_empty(device="cpu")           # untouched pages: no memory
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in (model.model.norm, model.lm_head):
            for p in module.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        # Rotary tables are computed at construction: rebuild them on the CPU.
        model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config)
    return model.eval()


def main() -> None:
    torch.set_num_threads(2)
    tail_times: dict[str, float] = {}

    def timed(fn):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            tail_times[fn.__name__] = time.perf_counter() - t0
            return out
        return run
    # The tail check: the forward with stub blocks (find_tail), then the comparison.
    hf.find_tail, hf.check_tail = timed(checks.find_tail), timed(checks.check_tail)
    print(f"one decoder block at full width, bf16; torch threads {torch.get_num_threads()}; "
          "the second wrap_hf of each model timed (the first warms up)\n")
    print("| config | hidden x vocab | wrap_hf with checks | tail check |")
    print("|---|---|---|---|")
    for name in KNOWN_MODELS:
        model = build(name)
        wrap_hf(model)                      # warm-up (first-call costs of the kernels)
        t0 = time.perf_counter()
        wrap_hf(model)
        total = time.perf_counter() - t0
        c = model.config
        print(f"| {name} | {c.hidden_size} x {c.vocab_size} | {total * 1e3:.0f} ms | "
              f"{sum(tail_times.values()) * 1e3:.0f} ms |")
        del model


if __name__ == "__main__":
    main()
