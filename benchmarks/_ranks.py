"""Run a benchmark script as several gloo ranks on loopback (shared by the benchmarks
that measure data parallelism)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from typing import NoReturn


def launch_ranks(script: str, ranks: int) -> NoReturn:
    """Start ``ranks`` copies of ``script`` with this process's arguments, each with
    ``RANK``, ``WORLD_SIZE`` and a free loopback rendezvous set, and exit with the
    worst exit code."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, script, *sys.argv[1:]],
                              env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(ranks),
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
             for r in range(ranks)]
    sys.exit(max(p.wait() for p in procs))
