"""Chrome / Perfetto trace of a simulated schedule (the JSON ``torch.profiler`` exports).

One process per device (``pid`` = device index; the host is ``pid`` = devices), one
thread per resource (compute, upload link, download link); every action chunk is a
complete event (``ph: "X"``) with ``ts`` and ``dur`` in microseconds. Open it at
https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import json
import pathlib

from ..schedule.timeline import Resource, Timeline

__all__ = ["chrome_trace", "write_trace"]

_TID = {Resource.COMPUTE: 0, Resource.UP: 1, Resource.DOWN: 2, Resource.HOST: 0}


def chrome_trace(timeline: Timeline) -> dict:
    """The trace as a dict: ``{"traceEvents": [...], "displayTimeUnit": "ms"}``."""
    s = timeline.schedule
    host = s.workers
    events: list[dict] = []
    for w in range(s.workers + 1):
        name = "host" if w == host else f"device {w}"
        events.append({"name": "process_name", "ph": "M", "pid": w, "tid": 0,
                       "args": {"name": name}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": w, "tid": 0,
                       "args": {"sort_index": w}})
        lanes = [Resource.HOST] if w == host else [Resource.COMPUTE, Resource.UP, Resource.DOWN]
        for res in lanes:
            events.append({"name": "thread_name", "ph": "M", "pid": w, "tid": _TID[res],
                           "args": {"name": res}})
    for sp in timeline.spans:
        a = sp.action
        pid = host if a.worker < 0 else a.worker
        args = {"kind": a.kind.name.lower(), "stage": a.stage}
        if a.mb is not None:
            args["microbatch"] = a.mb
        if a.at is not None:
            args["layer boundary"] = a.at
        if s.calls > 1:
            args["call"] = a.call
        events.append({"name": a.key, "cat": a.kind.name.lower(), "ph": "X",
                       "ts": round(sp.start * 1e3, 3), "dur": round((sp.end - sp.start) * 1e3, 3),
                       "pid": pid, "tid": _TID[sp.resource], "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"schedule": s.name, "workers": s.workers,
                          "microbatches": s.microbatches, "calls": s.calls,
                          "plan": s.plan.to_text()}}


def write_trace(timeline: Timeline, path: str | pathlib.Path) -> pathlib.Path:
    """Write :func:`chrome_trace` as JSON to ``path``; return the path."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(timeline)))
    return path
