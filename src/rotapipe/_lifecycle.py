"""A pipeline's life outside its calls: which pipeline owns a parameter
(:func:`claim`), the lock its methods take (:class:`CallLock`, refusing a pipeline used
from inside its own work), and stopping its threads (:func:`close_devices`, also its
finalizer)."""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
import weakref

from torch.optim.optimizer import register_optimizer_step_post_hook

from .errors import ConfigError, InputError
from .runtime.dispatchers import on_worker_thread
from .runtime.executor import ABANDON_S, abandon
from .runtime.host import in_own_step

__all__ = ["claim", "CallLock", "reentry", "close_devices"]

_OWNERS: dict[int, tuple[weakref.ref, weakref.ref]] = {}
"""``id(parameter)`` -> weak references to the parameter and to the RoundPipe that
trains it. Process-wide on purpose: ownership belongs to the parameter objects,
whichever pipeline wraps them (tensors compare by value, so not a WeakKeyDictionary)."""


_WATCH: list = []
"""The handle of the process-wide optimizer step hook (:func:`_stepped`), once set."""


def _stepped(optimizer, args, kwargs) -> None:
    """After any ``torch.optim`` step in the process: one the user took on a pipeline's
    masters (not the pipeline's own, :func:`~rotapipe.runtime.host.own_step`) must
    reach the workers' compute copies at the next call, which fused kernels would not
    tell by the version counters alone."""
    if in_own_step() or not _OWNERS:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            param, owner = _OWNERS.get(id(p), (None, None))
            pipe = owner() if param is not None and param() is p else None
            host = getattr(pipe, "host", None)
            if host is not None:
                host.stepped_elsewhere(p)


def claim(pipe) -> None:
    """Make ``pipe`` the owner of its layers' parameters, refusing parameters that
    another live pipeline trains: two pipelines accumulating into one ``.grad``
    would overwrite each other's gradients. The first claim also starts watching the
    optimizer steps the process takes (:func:`_stepped`)."""
    if not _WATCH:
        _WATCH.append(register_optimizer_step_post_hook(_stepped))
    def taken():
        out = []
        for p, name in zip(pipe.layerset.params, pipe.layerset.param_names):
            param, owner = _OWNERS.get(id(p), (None, None))
            other = owner() if param is not None and param() is p else None
            if other is not None and other is not pipe and not other._closed:
                out.append(name)
        return out
    shared = taken()
    if shared:
        gc.collect()                 # an unreachable pipeline still in a reference cycle
        shared = taken()
    if shared:
        raise ConfigError(
            f"parameter {shared[0]}" + (f" (and {len(shared) - 1} more)" if len(shared) > 1
                                        else "") +
            " is already trained by another live RoundPipe: close() that one first (or "
            "build it in a with-block), or wrap both uses in one pipeline; two pipelines "
            "over one module would overwrite each other's accumulated gradients")
    for key in [k for k, (param, owner) in _OWNERS.items()
                if param() is None or owner() is None]:
        del _OWNERS[key]
    for p in pipe.layerset.params:
        _OWNERS[id(p)] = (weakref.ref(p), weakref.ref(pipe))


class CallLock:
    """The pipeline's lock: one call (or state access) at a time. Taken from inside
    the pipeline's own work it would wait for itself: that is refused at once."""

    def __init__(self, folder: str):
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._folder = os.path.join(folder, "")   # the files of the methods that take it
        self.owners: set[int] = set()
        """Ids of what runs the pipeline's work (its dispatcher pool, its emulated
        devices): their threads may not take the lock."""

    def __enter__(self) -> None:
        me = threading.get_ident()
        if self._owner == me or on_worker_thread(self.owners):
            raise reentry(_public_caller(self._folder))
        if on_worker_thread():
            raise reentry(_public_caller(self._folder), own=False)
        self._lock.acquire()
        self._owner = me

    def __exit__(self, *exc) -> None:
        self._owner = None
        self._lock.release()


def _public_caller(folder: str) -> str:
    """The method the user called: the outermost of the frames of files in ``folder``
    that lead to the lock (``state_dict`` rather than the ``flush`` it starts with)."""
    frame, name = sys._getframe(2), "?"
    while frame is not None and frame.f_code.co_filename.startswith(folder):
        name = frame.f_code.co_name
        frame = frame.f_back
    return name


def reentry(method: str, own: bool = True) -> InputError:
    """The error of a pipeline used from inside a pipeline's work (``own``: its own,
    which would wait for itself; else another's: pipelines do not nest)."""
    what = "pipe(...)" if method == "__call__" else f"RoundPipe.{method}()"
    if not own:
        return InputError(f"{what} was called from a worker thread of another RoundPipe "
                          "(inside its loss function, a layer, a hook or its optimizer): "
                          "pipelines do not nest; run this one from your own code, "
                          "before or after the other's call (e.g. compute a teacher's "
                          "outputs first and pass them in the labels)")
    return InputError(f"{what} was called from inside the pipeline's own work (a loss "
                      "function, a layer's forward or backward, a hook, side_inputs, "
                      "the optimizer or its scheduler), which would wait for the call "
                      "it runs in: call it from your own code once train_step, "
                      "forward_backward or step has returned")


def close_devices(devices, streams=()) -> None:
    """Stop the dispatchers of calls still in flight, then the devices' threads; after
    a timeout retired the pipeline, threads stuck in an action are abandoned (bounded,
    also at interpreter exit, where this runs as a finalizer)."""
    if on_worker_thread():
        # The pipeline's last reference went away on one of the threads this joins (a
        # dropped pipeline's last call committing on the host lane): close from another.
        threading.Thread(target=close_devices, args=(devices, streams), daemon=True,
                         name="rotapipe-close").start()
        return
    for stream in streams:
        if stream.session is not None:
            stream.session.kill()
        stream.runner.executor.close()
    broken = next((s.runner.executor for s in streams if s.runner.executor.broken), None)
    deadline = time.monotonic() + ABANDON_S
    for d in devices:
        d.stop()
    stuck = [t for d in devices
             for t in d.close(max(0.0, deadline - time.monotonic()) if broken else None)]
    if stuck:
        abandon(broken, stuck)
