"""Will a fine-tuning run's model state fit this machine's RAM? What ``rotapipe train``
checks before it loads a weight (docs/training.md, "Host RAM"), from Python.

The model is built on the meta device (no weight is read), so a 32B config costs a few
seconds. Prints the model state of each optimizer mode and optimizer-state dtype, full
fine-tuning and LoRA, against the RAM available now, then what ``rotapipe train`` says
to the run you describe.

    python examples/host_ram.py [--model DIR_WITH_CONFIG_JSON] [--dtype bf16]
        [--available-gb N]

Without ``--model`` it writes Qwen3-1.7B's config (shipped with rotapipe) to a
temporary folder and checks that.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import tempfile

from rotapipe import ConfigError
from rotapipe.runtime.pinning import available_ram
from rotapipe.train import TrainConfig
from rotapipe.train.model import check_host_ram, host_state

SHIPPED = pathlib.Path(__file__).resolve().parents[1] / "src" / "rotapipe" / "data" / \
    "configs" / "qwen3-1.7b.json"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a model directory (its config.json is read)")
    ap.add_argument("--dtype", default="bf16", choices=("fp32", "bf16", "fp16"))
    ap.add_argument("--available-gb", type=float,
                    help="pretend this much RAM is available (default: what is)")
    args = ap.parse_args(argv)
    model = args.model
    if model is None:
        model = tempfile.mkdtemp()
        shutil.copy(SHIPPED, pathlib.Path(model) / "config.json")
    try:
        available = int(args.available_gb * 1e9) if args.available_gb else available_ram()
        print(f"{model}: RAM available {available / 1e9:.1f} GB")
        print(f"{'run':44s} {'model state':>12s}  fits")
        for lora in (False, True):
            for mode in ("sync", "overlap", "stale"):
                for state in ("fp32", "bf16", "int8"):
                    cfg = TrainConfig(model=model, dtype=args.dtype, lora=lora,
                                      lora_rank=16, optimizer_mode=mode,
                                      optimizer_state=state)
                    mem = host_state(cfg, None)
                    what = f"{'LoRA r=16' if lora else 'full'}, {mode}, {state} state"
                    print(f"{what:44s} {mem.state / 1e9:10.1f} GB  "
                          f"{'yes' if mem.state <= available else 'no'}")
        cfg = TrainConfig(model=model, dtype=args.dtype, optimizer_mode="overlap")
        try:
            print(check_host_ram(cfg, None, available=available))
        except ConfigError as exc:
            print(f"rotapipe train --model {model} --optimizer-mode overlap: {exc}")
    finally:
        if args.model is None:
            shutil.rmtree(model, ignore_errors=True)


if __name__ == "__main__":
    main()
