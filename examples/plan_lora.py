"""Plan LoRA fine-tuning before renting a GPU: what ``rotapipe plan MODEL --lora`` does,
from Python, beside full fine-tuning of the same model.

The planner prices LoRA as LoRA (docs/planning.md, "LoRA's costs"): the frozen
weights' backward computes only input gradients, the adapters add their own FLOPs, and
only the adapters' gradients are downloaded. No weights are loaded: every number comes
from the model's config and a hardware profile, and torch is not imported.

    python examples/plan_lora.py [--model qwen3-1.7b] [--hardware rtx4090x8] [--rank 16]
"""

from __future__ import annotations

import argparse

from rotapipe.plan import hardware, lora_params, model_costs
from rotapipe.planner import analyze


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-1.7b",
                    help="a config.json, a model folder, or a shipped name")
    ap.add_argument("--hardware", default="rtx4090x8")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--global-batch", type=int, default=16)
    args = ap.parse_args(argv)
    hw = hardware(args.hardware)

    # One block's costs per microbatch, full fine-tuning against LoRA.
    adapters = lora_params(args.model, args.rank)
    full = model_costs(args.model, hw, seq=args.seq).layers[1]
    lora = model_costs(args.model, hw, seq=args.seq, adapters=adapters).layers[1]
    print(f"{args.model}, one block, one {args.seq}-token microbatch on {hw.name}:")
    for name, layer in (("full", full), (f"LoRA r={args.rank}", lora)):
        print(f"  {name:10s} forward {layer.forward_ms:7.2f} ms  backward "
              f"{layer.backward_ms:7.2f} ms  weight upload {layer.upload_ms:7.2f} ms  "
              f"gradient download {layer.dw_ms:7.3f} ms")

    # The whole run: verdict, plan and predicted step, as `rotapipe plan` prints them.
    for rank in (None, args.rank):
        a = analyze(args.model, hw, seq=args.seq, global_batch=args.global_batch,
                    lora_rank=rank)
        what = f"LoRA r={rank}" if rank else "full fine-tuning"
        if a.choice is None:
            print(f"{what}: no plan fits the device ({a.device_error})")
            continue
        r = a.choice.report
        print(f"{what}: {'fits' if a.fits else 'does not fit'}; host RAM "
              f"{a.host.total / 1e9:.1f} GB; step {r.step_ms / 1e3:.2f} s, "
              f"{r.tokens_per_s:,.0f} tokens/s, bubble {100 * r.bubble.total:.1f}%; "
              f"{len(a.choice.plan.forward)} forward / {len(a.choice.plan.backward)} "
              f"backward stages")


if __name__ == "__main__":
    main()
