"""Crash safety of checkpoints: SIGKILL a training run at random moments, 20 times.

Each trial resumes the same run (``--resume auto``, a checkpoint after every step),
kills it with SIGKILL after a random delay, then checks that the newest complete
checkpoint loads (masters, optimizer state, metadata agree on the step). The next
trial resumes from it, so every trial also proves the checkpoint resumes. A kill that
lands while a checkpoint is being written leaves a ``.tmp-`` directory; the table
counts them.

    python benchmarks/checkpoint_crash.py            # ~2-3 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import pathlib
import random
import signal
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from rotapipe.train import latest_checkpoint, load_checkpoint  # noqa: E402
from train_util import env, flags, text_jsonl  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rnd = random.Random(args.seed)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="ckpt-crash-"))
    data = text_jsonl(tmp / "d.jsonl", 400)
    out = tmp / "run"

    def common(steps: int) -> list[str]:
        return flags(data=str(data), out_dir=str(out), dim=128, heads=4, steps=steps,
                     save_interval=1, keep=2, eval_interval=0, export=False)

    print(f"{'trial':>5} {'kill after':>10} {'mid-write':>9} {'latest':>8} {'loads':>5}")
    mid, ok = 0, 0
    for trial in range(1, args.trials + 1):
        proc = subprocess.Popen([sys.executable, "-m", "rotapipe", "train", *common(10**6),
                                 "--resume", "auto"], env=env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        before = latest_checkpoint(out / "checkpoints")
        while latest_checkpoint(out / "checkpoints") == before:    # wait for a new save
            if proc.poll() is not None:
                raise SystemExit(f"trial {trial}: the run exited with {proc.returncode}")
            time.sleep(0.01)
        delay = rnd.uniform(0.0, 1.5)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        tmp_left = any((out / "checkpoints").glob(".tmp-*"))
        last = latest_checkpoint(out / "checkpoints")
        masters, state, meta = load_checkpoint(last)
        good = (state["step"] == meta["step"] and last.name == f"step-{meta['step']:08d}"
                and len(masters) > 0 and len(state["optimizer"]["state"]) > 0)
        mid += tmp_left
        ok += good
        print(f"{trial:5d} {delay:9.2f}s {'yes' if tmp_left else 'no':>9} "
              f"{meta['step']:8d} {'ok' if good else 'FAIL':>5}", flush=True)
    # Finish the run from the last checkpoint: the resume must complete and exit 0.
    step = load_checkpoint(latest_checkpoint(out / "checkpoints"))[2]["step"]
    done = subprocess.run([sys.executable, "-m", "rotapipe", "train", *common(step + 2),
                           "--resume", "auto"],
                          env=env(), capture_output=True, text=True)
    print(f"{ok}/{args.trials} kills left a loadable newest checkpoint; {mid} landed during "
          f"a checkpoint write; final resume from step {step} to {step + 2}: exit "
          f"{done.returncode}")
    if done.returncode:
        print(done.stdout[-2000:], done.stderr[-2000:])
    return 0 if ok == args.trials and done.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
