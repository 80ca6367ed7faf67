"""How a data-parallel process ends after a failure: through the interpreter's normal
shutdown, with its error and exit status, never a native abort (SIGABRT, "terminate
called ...") from a torch thread that touched Python while the interpreter was going
away."""

from __future__ import annotations

import pytest
import torch

from test_distributed import _finish, _launch

if not torch.distributed.is_available():
    pytest.skip("this torch build has no torch.distributed", allow_module_level=True)


def test_collectives_in_flight_when_the_peer_exits_do_not_abort_the_shutdown(tmp_path):
    """Rank 1's call fails at step 1 while rank 0's gradient buckets are in flight; rank
    0 raises DistributedError and exits normally (status 3); rank 1 exits during rank
    0's shutdown, so gloo fails rank 0's buckets then. Before, each bucket's future
    carried a Python done-callback, which gloo's worker thread ran (and freed) then:
    rank 0 aborted with status -6 ("terminate called after throwing an instance of
    'gloo::IoException'") instead of exiting with its error."""
    procs = _launch(tmp_path, 2, "--leave-at", "1", "--timeout", "30")
    (rc0, err0), (rc1, err1) = (_finish(p, 120) for p in procs)
    assert rc1 == 1 and "WorkerError" in err1, err1
    assert "terminate called" not in err0 and "Fatal Python error" not in err0, err0
    assert rc0 == 3 and "DistributedError lost_ranks=[1]" in err0, err0
    assert (tmp_path / "rank0.pt.shutdown").exists()


_LEAVES = """
import atexit, os, sys
import torch, torch.distributed as dist

def tasks():
    return len(os.listdir("/proc/self/task"))      # native threads, gloo's included

def after():                 # registered first: runs after rotapipe's exit hook
    print(f"initialized={dist.is_initialized()} threads={tasks()} before={before}",
          flush=True)

atexit.register(after)
before = tasks()
from rotapipe import distributed
distributed.init_from_env(timeout_s=30)
t = torch.ones(3)
dist.all_reduce(t)
raise SystemExit(2)          # an error on the way out, without distributed.shutdown()
"""


def test_a_process_that_exits_without_shutdown_leaves_the_group_first(tmp_path):
    """A rank that exits after a collective without ``distributed.shutdown()`` (every
    error path of ``rotapipe train``) leaves the group at exit, before the interpreter
    shuts down: gloo's threads are joined by then. Before, they outlived it, and one
    freeing a finished collective's tensors a moment late (a loaded machine) aborted
    the process with "terminate called without an active exception" (SIGABRT; about 1
    run in 10 of two such ranks beside a CPU hog on the 2-core CI machine)."""
    import subprocess
    import sys
    from train_util import env, free_port
    e = {**env(), "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
         "MASTER_PORT": str(free_port())}
    r = subprocess.run([sys.executable, "-c", _LEAVES], env=e, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    line = next(l for l in r.stdout.splitlines() if l.startswith("initialized="))
    fields = dict(kv.split("=") for kv in line.split())
    assert fields["initialized"] == "False", line
    assert int(fields["threads"]) <= int(fields["before"]), line


def test_stop_heartbeats_waits_for_store_calls_still_running():
    """A rank leaving says why in the store on a helper thread, waited for 1 s (a store
    that does not answer must not hold the caller). ``stop_heartbeats`` (at exit, and
    before ``distributed.shutdown`` destroys the group) now waits for such a call to
    return: a daemon thread coming back from a C++ store call while the interpreter
    shuts down aborts the process. Before, it returned with the thread still inside."""
    import threading
    import time
    from rotapipe.runtime import heartbeat

    class SlowStore:                  # a store round trip of 1.5 s (a loaded rank 0)
        def set(self, key, value):
            time.sleep(1.5)

        def add(self, key, n):
            return 0

    class Reducer:
        members, issued = [0, 1], 7

    reducer = Reducer()
    hb = heartbeat.Heartbeat(SlowStore(), 0, 0.25, reducer)
    hb.prefix = "rotapipe/test"
    before = set(threading.enumerate())
    t0 = time.monotonic()
    hb.mark("its pipeline was closed")              # returns after 1 s, the write goes on
    assert time.monotonic() - t0 < 1.4
    calls = [t for t in threading.enumerate() if t not in before]
    assert calls and all(t.is_alive() for t in calls)
    heartbeat.stop_heartbeats()
    assert not any(t.is_alive() for t in calls)
