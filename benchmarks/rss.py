"""Peak resident-set size over a block of code, for the host-memory benchmarks.

``ru_maxrss`` would include the peaks of imports and earlier work, so the peak is
sampled from ``/proc/self/statm`` every 5 ms while the block runs."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import threading


def rss() -> int:
    """This process's resident set in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


class Sampler:
    """``with Sampler() as s: ...`` then ``s.peak``: the peak RSS over the block."""

    def __enter__(self):
        self.peak, self._stop = rss(), threading.Event()

        def loop():
            while not self._stop.wait(0.005):
                self.peak = max(self.peak, rss())
        self._t = threading.Thread(target=loop, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss())


def run_child(code: str, **env: str) -> dict:
    """Run ``code`` in a fresh interpreter (extra environment ``env``) and return the
    JSON object its last line of output prints; exit with its stderr if it fails."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, **env})
    if out.returncode != 0:
        raise SystemExit(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])
