"""What each action of a schedule does: the bodies the executor submits to streams.

Data flows through the stores (``store.py``) under these keys:

- host: ``("act", boundary, mb)`` activation at a layer boundary; ``("grad", boundary,
  mb)`` gradient w.r.t. it; ``("labels", mb)``; ``("side", mb)``; ``("loss", mb)``;
  ``("wgrad", stage)`` downloaded weight gradients; ``("buf", buffer_id)`` buffers
  updated by this call's forward.
- device: ``("w", stage)`` (params, buffers); ``("side", mb)``; ``("in", stage, mb)``;
  ``("labels", mb)``; ``("gout", stage, mb)``; ``("out", stage, mb, boundary)``;
  ``("gin", stage, mb)``; ``("loss", mb)``; ``("graph", stage, mb)``; ``("wgrad", stage)``;
  ``("bufout", stage)``.

Bound schedules (``schedule/bound.py``) upload a chunk's weights once, under its backward
stage's name: ``FK:Fc`` binds ``("w", Bc)`` and keeps its graph as ``("graph", Bc, mb)``
for ``BK:Bc``. Chunks on one device hand over on the device: a forward puts its output
as the next stage's ``("in", ...)``, a backward its input gradient as the shallower
stage's ``("gout", ...)`` (:class:`rotapipe.schedule.routes.Routes`).

The data a call's actions share (:class:`CallContext`, :class:`CallState`) is
``callcontext.py``'s; the checks of the user's layers and loss, ``contract.py``'s.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import ExitStack, contextmanager

import torch

from ..config import RecomputeGrain
from ..errors import InputError
from ..model import LayerSet, call_layer
from ..plan import Stage, StageKind
from ..schedule import Action, ActionKind as K, action_key
from ..schedule.routes import Routes
from .backend import Device
from .callcontext import CallContext, CallState
from .contract import check_loss_graph, check_rows, check_unchanged, zero_contribution
from .host import HostState
from .rng import layer_seed
from .store import Store
from .chunks import ChunkedCopies
from .stagetensors import (SavedBytes, WorkingSet, backward_tree, batch_rows, copy_tree,
                           detach_tree, input_grads, loss_scalar, stage_leaves)
from .transfer import sleep_until
from .trees import map_tensors

__all__ = ["ActionRunner", "CallContext", "CallState"]


class ActionRunner:
    """Runs single actions on a worker's device; one per pipeline, reused per call.
    Several calls may be in flight: ``states[call]`` holds each one's data, and an
    action body sees its own call's (``ctx``, ``host_store``, ``stores``, ``routes``
    and ``compute`` are those of the call whose action runs on this thread)."""

    def __init__(self, layerset: LayerSet, host: HostState, loss_fn, devices: list[Device],
                 shells: list, stages: dict[str, Stage], *,
                 chunk_bytes: int = 32 << 20,
                 pinned: Callable[[int], bool] = lambda pid: True,
                 pinned_empty: Callable[[int], torch.Tensor] | None = None):
        self.ls, self.host, self.loss_fn = layerset, host, loss_fn
        self._trainable = frozenset(host.trainable)
        self._masters = {id(layerset.params[pid]): pid for pid in host.trainable}
        """id -> index of the trainable masters: a loss must not reach them
        (:func:`~rotapipe.runtime.contract.check_loss_graph`)."""
        self.devices, self.shells, self.stages = devices, shells, stages
        self.states: dict[int, CallState] = {}
        self.lookups = None
        """Embedding tables stages move by rows (:class:`rotapipe.model.Lookups`)."""
        self._tls = threading.local()
        self.copies = ChunkedCopies(
            self, chunk_bytes, pinned,
            pinned_empty or (lambda n: torch.empty(n, dtype=torch.uint8)))
        """Chunked weight uploads and weight-gradient downloads (``chunks.py``)."""

    # The running action's call (set per action on the thread that runs it).
    @property
    def ctx(self) -> CallContext:
        return self._tls.state.ctx

    @property
    def host_store(self) -> Store:
        return self._tls.state.host_store

    @property
    def stores(self) -> list[Store]:
        return self._tls.state.stores

    @property
    def routes(self) -> Routes:
        return self._tls.state.routes

    @property
    def compute(self) -> list[torch.Tensor]:
        return self._tls.state.compute

    def _in_call(self, state: CallState, fn: Callable[[], None]) -> Callable[[], None]:
        """``fn``, run with ``state`` as this thread's call."""
        def run():
            self._tls.state = state
            try:
                fn()
            finally:
                self._tls.state = None      # see run()
        return run

    timing: Callable[[Action], tuple[float, ...]] | None = None
    """Timed emulation (:class:`rotapipe.runtime.emulation.TimedEmulation`): an action's duration in
    seconds, as chunks (weight uploads and weight-gradient downloads: the chunks of
    ``chunks.py``). Actions then last at least their duration: a copy holds its copy
    engine that long, compute sleeps after its work (emulated workers overlap there)."""

    def run(self, a: Action) -> None:
        self._tls.state = self.states[a.call]
        try:
            if self.timing is None:
                getattr(self, "_" + a.kind.name.lower())(a)
                return
            t0 = time.perf_counter()
            getattr(self, "_" + a.kind.name.lower())(a)
            # Sleep after the work, holding no lock: emulated workers overlap here.
            sleep_until(t0 + sum(self.timing(a)))
        finally:
            # A thread must not keep the call's state once the action is done: it holds
            # the call's host store (every activation checkpoint and input gradient), so
            # a thread that runs nothing more would keep a finished call's checkpoints
            # alive beside the next call's (docs/memory.md).
            self._tls.state = None

    def chunks(self, a: Action) -> list | None:
        """The chunks of a weight upload or weight-gradient download (``None`` for
        every other action: one piece, run by :meth:`run`)."""
        if a.kind not in (K.UPLOAD_WEIGHTS, K.UPLOAD_TRAINED, K.DOWNLOAD_WGRAD):
            return None
        state = self._tls.state = self.states[a.call]
        try:
            chunks = self.copies.download(a) if a.kind is K.DOWNLOAD_WGRAD else \
                self.copies.upload(a)
        finally:
            self._tls.state = None      # see run()
        for c in chunks:
            c.copy = self._in_call(state, c.copy)
            if c.stage is not None:
                c.stage = self._in_call(state, c.stage)
        return chunks

    # -- uploads --------------------------------------------------------------------
    def _upload_side(self, a: Action) -> None:
        side = self.host_store.get(("side", a.mb))
        self.stores[a.worker].put(("side", a.mb), self._up(a, side), f"side inputs of mb {a.mb}")

    def _upload_act(self, a: Action) -> None:
        x = self.host_store.get(("act", a.at, a.mb))
        store = self.stores[a.worker]
        store.put(("in", a.stage, a.mb), self._up(a, x), f"input of {a.stage} mb {a.mb}")
        if self.stages[a.stage].kind is StageKind.TAIL and self.ctx.training:
            # Labels ride with the activation (a few bytes: no engine time of their own).
            labels = self.host_store.get(("labels", a.mb))
            store.put(("labels", a.mb), map_tensors(self.devices[a.worker].upload, labels))

    def _upload_grad(self, a: Action) -> None:
        g = self.host_store.get(("grad", a.at, a.mb))
        self.stores[a.worker].put(("gout", a.stage, a.mb), self._up(a, g),
                                  f"output gradient of {a.stage} mb {a.mb}")

    def _up(self, a: Action, tree):
        return map_tensors(self.devices[a.worker].upload, tree)

    # -- compute --------------------------------------------------------------------
    @contextmanager
    def _bound(self, a: Action):
        """Bind the stage's device weights into this worker's shells, with the caller's
        autocast state re-entered (it is thread-local)."""
        s = self.stages[a.stage]
        weights = self.routes.weights_of.get(s.name, s.name)
        params, buffers = self.stores[a.worker].get(("w", weights))
        shells = self.shells[a.worker]
        for l in s.layers:
            shells[l].bind(params, buffers)
        # Trainable weights only: PEFT wrappers of 3-D expert weights add their delta
        # into the frozen base in place and take it out again (net no change).
        trainable = self._trainable
        versions = {pid: t._version for pid, t in params.items() if pid in trainable}
        try:
            with ExitStack() as stack:
                for device_type, dtype in self.ctx.autocast:
                    stack.enter_context(torch.autocast(device_type, dtype=dtype))
                yield params
            check_unchanged(self.ls, a, params, versions)
        finally:
            for l in s.layers:
                shells[l].unbind()

    def _layers(self, a: Action, layers, x, side, keep=None):
        """Run ``layers`` on ``x``; ``keep(boundary, y, shared)`` sees each output,
        ``shared`` when a further layer of ``layers`` gets it next (and may change it
        in place, as a layer may in plain PyTorch: what is kept must be a copy)."""
        dev, shells = self.devices[a.worker], self.shells[a.worker]
        rows = batch_rows(x)
        last = layers[-1] if len(layers) else None
        for l in layers:
            seed = layer_seed(self.ctx.seed, self.ctx.call, a.mb + self.ctx.mb_offset, l)
            with dev.seeded_layer(seed, shells[l]):
                x = call_layer(shells[l].module, x, side)
            if rows >= 0:
                check_rows(self.ls, l, x, rows)
            if keep is not None:
                keep(l + 1, x, l != last)
        return x

    def _side(self, a: Action):
        return self.stores[a.worker].get(("side", a.mb)) if self.ctx.has_side else None

    def _forward(self, a: Action) -> None:
        s = self.stages[a.stage]
        x = self._take_input(a)
        with self._bound(a), torch.no_grad():
            out = self._layers(a, s.layers, x, self._side(a), self._keeper(a))
            self._hand_on(a, out, kept=s.stop in self.routes.downloads.get((s.name, a.mb),
                                                                            ()))
            if a.mb == self.ctx.microbatches - 1:
                self._keep_buffers(a, s)

    def _backpressure(self, a: Action) -> None:
        """Data parallel: before computing a stage's gradients, wait while too many
        stages' hand-offs queue behind the host lane (``ctx.grad_gate``)."""
        if self.ctx.grad_gate is not None:
            self.ctx.grad_gate(a.stage)

    def _fused(self, a: Action) -> None:
        self._backpressure(a)
        s, store = self.stages[a.stage], self.stores[a.worker]
        x = store.pop(("in", s.name, a.mb))
        labels = store.pop(("labels", a.mb))
        with self._bound(a) as params, torch.enable_grad(), \
                WorkingSet(self.devices[a.worker], params, f"working set of {a.key}"):
            x, inputs = stage_leaves(x) if s.start > 0 else (x, x)
            out = self._layers(a, s.layers, inputs, self._side(a))
            contribution = self._contribution(a, s, out, labels)
            (contribution * self.ctx.loss_scale).backward()
            store.put(("gin", s.name, a.mb), input_grads(x) if s.start > 0 else None)
            store.put(("loss", a.mb), contribution.detach())
            if a.key in self.routes.last_pass:     # the job's last microbatch (split tails)
                self._keep_wgrads(a, params)
                self._keep_buffers(a, s)

    def _contribution(self, a: Action, s: Stage, out, labels) -> torch.Tensor:
        """Microbatch ``a.mb``'s weighted share of the batch loss (fp32 scalar).

        ``loss_fn`` may run modules that draw random numbers (the Hugging Face chunked
        loss runs the LM head, whose LoRA dropout draws): it runs on a stream of its
        own, ``layer_seed(seed, call, microbatch, number of layers)``, as a layer
        would, never on the caller's stream (shared with the other workers)."""
        mb = a.mb + self.ctx.mb_offset
        args = (out, labels) if self.ctx.tail_context is None else \
            (out, labels, self._tail_value(s))
        with self.devices[a.worker].seeded(layer_seed(self.ctx.seed, self.ctx.call, mb,
                                                      len(self.ls))):
            result = self.loss_fn(*args)
        # loss_fn returns its microbatch's mean loss; with a tail context, optionally
        # with a second term already normalised over the whole batch (added unweighted).
        loss, extra = result, None
        if isinstance(result, tuple):
            if self.ctx.tail_context is None or len(result) != 2:
                raise InputError(
                    f"the loss function returned a tuple of {len(result)}: return the "
                    "microbatch's mean loss as one scalar tensor (log metrics from "
                    "outside loss_fn; only with tail_context may it return (loss, "
                    "whole-batch term))")
            loss, extra = result
        loss, weight = loss_scalar(loss), self.ctx.weights[a.mb]
        if not loss.requires_grad:
            raise InputError(
                f"the loss function returned a {loss.dtype} tensor that does not require "
                "grad (detached, .item() turned back into a tensor, or built with "
                "torch.tensor): compute it from the model's output with differentiable, "
                "floating-point operations")
        check_loss_graph(self.ls, self._masters, loss, out)
        loss = loss.float()
        # A microbatch weighing nothing (every label ignored) adds an exact zero, as its
        # terms do in a whole-batch mean: its own mean over no tokens is NaN, and NaN
        # times 0 would fail the call (or skip the step) where plain PyTorch trains.
        contribution = loss * weight if weight else zero_contribution(out, loss)
        if extra is not None:
            # Data parallel: a per-rank whole-batch term counts by the rank's share.
            contribution = contribution + loss_scalar(extra).float() * self.ctx.extra_weight
        return contribution

    def _tail_value(self, s: Stage):
        """The whole-batch context of the loss: computed by the first fused-tail action
        from every microbatch's tail input in host memory (the schedule's tail barrier
        makes that action wait for all of them)."""
        if self.ctx.tail_value is None:
            M = self.ctx.microbatches
            xs = [self.host_store.get(("act", s.start, m)) for m in range(M)]
            ys = [self.host_store.get(("labels", m)) for m in range(M)]
            self.ctx.tail_value = self.ctx.tail_context(xs, ys)
        return self.ctx.tail_value

    def _recompute(self, a: Action) -> None:
        self._backpressure(a)
        s, store = self.stages[a.stage], self.stores[a.worker]
        x = store.pop(("in", s.name, a.mb))
        with self._bound(a) as params:
            saved = 0
            if self.ctx.grain is RecomputeGrain.STAGE:
                with torch.enable_grad(), SavedBytes(params) as counter:
                    x, inputs = stage_leaves(x) if s.start > 0 else (x, x)
                    out = self._layers(a, s.layers, inputs, self._side(a))
                graph, saved = (x, out), counter.bytes
            else:
                # Each layer's input, for its backward; the pass runs all but the last
                # layer, each of which may change its input in place: keep copies.
                run = list(s.layers)[:-1]
                inputs = [copy_tree(x) if run else x]
                with torch.no_grad():
                    self._layers(a, run, x, self._side(a), lambda _b, y, shared:
                                 inputs.append(copy_tree(y) if shared else y))
                graph = inputs
        store.put(("graph", s.name, a.mb), graph, f"recompute state of {s.name} mb {a.mb}",
                  extra_bytes=saved)

    def _backward(self, a: Action) -> None:
        self._backpressure(a)
        s, store = self.stages[a.stage], self.stores[a.worker]
        graph = store.pop(("graph", s.name, a.mb))
        g = store.pop(("gout", s.name, a.mb))
        with self._bound(a) as params:
            if self.ctx.grain is RecomputeGrain.STAGE:
                x, out = graph
                backward_tree(out, g)
                gin = input_grads(x) if s.start > 0 else None
            else:
                side = self._side(a)
                for i in reversed(range(len(s.layers))):
                    l = s.start + i
                    with torch.enable_grad(), WorkingSet(self.devices[a.worker], params,
                                                          f"working set of {a.key} layer {l}"):
                        xi, inputs = stage_leaves(graph[i]) if l > 0 else (graph[i], graph[i])
                        y = self._layers(a, [l], inputs, side)
                        backward_tree(y, g)
                    g = input_grads(xi) if l > 0 else None
                    graph[i] = None
                gin = g
            self._give_input_grad(a, s, gin)
            if a.key in self.routes.last_pass:
                self._keep_wgrads(a, params)

    def _forward_keep(self, a: Action) -> None:
        """Forward keeping its autograd graph on the device for the ``BK`` of the same
        layers (bound schedules). On the tail the graph's root is the scaled loss."""
        s, store = self.stages[a.stage], self.stores[a.worker]
        x = self._take_input(a)
        labels = store.pop(("labels", a.mb)) if s.kind is StageKind.TAIL else None
        with self._bound(a) as params, torch.enable_grad(), SavedBytes(params) as counter:
            x, inputs = stage_leaves(x) if s.start > 0 else (x, x)
            out = self._layers(a, s.layers, inputs, self._side(a), self._keeper(a))
            if labels is not None:
                contribution = self._contribution(a, s, out, labels)
                store.put(("loss", a.mb), contribution.detach())
                out = contribution * self.ctx.loss_scale
            else:
                self._hand_on(a, out, kept=True)       # the graph keeps it
            if a.key in self.routes.last_pass:
                self._keep_buffers(a, s)
        # Keyed by the weights' stage (Bc for Fc): BK:Bc backpropagates through it.
        store.put(("graph", self.routes.weights_of.get(s.name, s.name), a.mb), (x, out),
                  f"kept graph of {s.name} mb {a.mb}", extra_bytes=counter.bytes)

    def _backward_kept(self, a: Action) -> None:
        """Backward through the graph the stage's ``FK`` kept (freeing it), from the
        output gradient (``UG`` or the deeper stage's ``BK`` on this device) or, on the
        tail, from the scaled loss."""
        self._backpressure(a)
        s, store = self.stages[a.stage], self.stores[a.worker]
        x, out = store.pop(("graph", s.name, a.mb))
        params, _ = store.get(("w", self.routes.weights_of.get(s.name, s.name)))
        if s.kind is StageKind.TAIL:
            out.backward()
        else:
            backward_tree(out, store.pop(("gout", s.name, a.mb)))
        self._give_input_grad(a, s, input_grads(x) if s.start > 0 else None)
        if a.key in self.routes.last_pass:
            self._keep_wgrads(a, params)

    def _take_input(self, a: Action):
        """Pop the input of forward/recompute ``a``; in bound schedules with recompute
        the forward keeps it for the recompute of the same layers (``Routes.also_input``)."""
        store = self.stores[a.worker]
        x = store.pop(("in", a.stage, a.mb))
        for stage in self.routes.also_input.get((a.stage, a.mb), ()):
            # A copy: the forward's first layer may change its input in place.
            store.put(("in", stage, a.mb), copy_tree(x), f"input of {stage} mb {a.mb}")
        return x

    def _keeper(self, a: Action):
        """``keep(boundary, y)`` for :meth:`_layers`: store what a ``DA`` downloads."""
        s, store = self.stages[a.stage], self.stores[a.worker]
        wanted = self.routes.downloads.get((s.name, a.mb), ())

        def keep(boundary, y, shared):
            if boundary in wanted:
                # The next layer of this forward may change y in place: keep a copy.
                store.put(("out", s.name, a.mb, boundary), copy_tree(y) if shared else
                          detach_tree(y), f"activation at layer {boundary} mb {a.mb}")
        return keep

    def _hand_on(self, a: Action, out, kept: bool) -> None:
        """Give a forward's output to the stages on this device that read it directly
        (``kept``: the forward keeps it too, for a download or its graph; a stage
        reading it may change it in place, so then each reader gets a copy)."""
        readers = self.routes.act_to.get(a.key, ())
        for i, stage in enumerate(readers):
            mine = not kept and i == len(readers) - 1
            self.stores[a.worker].put(("in", stage, a.mb), detach_tree(out) if mine else
                                      copy_tree(out), f"input of {stage} mb {a.mb}")

    def _give_input_grad(self, a: Action, s: Stage, gin) -> None:
        """Store a backward's input gradient for its ``DG``, or as the output gradient
        of the shallower stage on this device; the tail's ``DG`` always runs (it also
        downloads the loss)."""
        store = self.stores[a.worker]
        to = self.routes.grad_to.get(a.key)
        if to is not None:
            store.put(("gout", to, a.mb), gin, f"output gradient of {to} mb {a.mb}")
            gin = None
        if (to is None and s.start > 0) or s.kind is StageKind.TAIL:
            store.put(("gin", s.name, a.mb), gin, f"input gradient of {s.name} mb {a.mb}")

    def _free(self, a: Action) -> None:
        self.stores[a.worker].pop(("w", a.stage))

    def _keep_wgrads(self, a: Action, params: dict) -> None:
        grads = {pid: p.grad for pid, p in params.items() if p.grad is not None}
        for pid, g in grads.items():
            if g.layout is not torch.strided:
                # F.embedding(..., sparse=True) and the like; the modules are refused
                # at construction (pipe.checks.check_layers).
                raise InputError(
                    f"parameter {self.ls.param_names[pid]} got a {g.layout} gradient: "
                    "rotapipe moves dense weight gradients only. Compute it with a dense "
                    "gradient (sparse=False in F.embedding / nn.Embedding)")
        for p in params.values():
            p.grad = None
        self.stores[a.worker].put(("wgrad", a.stage), grads, f"weight gradients of {a.stage}")

    def _keep_buffers(self, a: Action, s: Stage) -> None:
        if not self.ctx.training or not self.ls.stage_buffers(s.layers):
            return
        shells = self.shells[a.worker]
        bufs = {}
        for l in s.layers:
            bufs.update(shells[l].bound_buffers())
        self.stores[a.worker].put(("bufout", s.name), bufs)

    # -- downloads and host work -----------------------------------------------------
    def _down(self, a: Action, tree):
        return map_tensors(self.devices[a.worker].download, tree)

    def _download_act(self, a: Action) -> None:
        y = self.stores[a.worker].pop(("out", a.stage, a.mb, a.at))
        self.host_store.put(("act", a.at, a.mb), self._down(a, y))

    def _download_grad(self, a: Action) -> None:
        store, down = self.stores[a.worker], self.devices[a.worker].download
        g = store.pop(("gin", a.stage, a.mb))
        if self.stages[a.stage].start > 0:
            self.host_store.put(("grad", a.at, a.mb), map_tensors(down, g))
        if self.stages[a.stage].kind is StageKind.TAIL:
            self.host_store.put(("loss", a.mb), down(store.pop(("loss", a.mb))))

    def _download_buffers(self, a: Action) -> None:
        for bid, t in self.stores[a.worker].pop(("bufout", a.stage)).items():
            self.host_store.put(("buf", bid), self._down(a, t))

    def _optimizer(self, a: Action) -> None:
        # A set missing here (never downloaded) is an error of the schedule, raised by
        # the store; a stage whose OR went first finds the empty set it left.
        for pid, g in self.host_store.pop(("wgrad", a.stage)).items():
            self.ctx.grads.add(pid, g)
        if self.ctx.handoff is not None:
            # Data parallel: all-reduce what is complete now, overlapping shallower stages.
            self.ctx.handoff(a.key)

    def _optimizer_rows(self, a: Action) -> None:
        # The stage's gradients go in here; its O then finds the empty set left.
        for pid, g in self.host_store.pop(("wgrad", a.stage)).items():
            self.ctx.grads.add(pid, g)
        self.host_store.put(("wgrad", a.stage), {})
        if self.ctx.rows_first is not None:
            self.ctx.rows_first(action_key(K.OPTIMIZER, a.stage, call=a.call))

