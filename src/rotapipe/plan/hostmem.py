"""Host-memory accounting: every byte of model state and activation checkpoints that a
RoundPipe run keeps in host RAM, so a plan can say "needs 612 GB, you have 512" before
the kernel's out-of-memory killer does.

What lives in host memory (see :mod:`rotapipe.runtime.host`):

- **weights**: a compute-dtype copy of every parameter (what workers upload);
  page-locked or not by the pin mode (below). A trainable parameter's copy in an fp32
  run is its master itself (``runtime.host.HostState``), except under ``"stale"``,
  which keeps two copies apart from the master (one per step in flight); a head tied
  to the embedding (``ModelCosts.shared_bytes``) is one tensor;
- **masters**: an fp32 copy of every *trainable* parameter (the optimizer steps it);
- **optimizer**: the optimizer's state per trainable parameter (Adam/AdamW: two
  moments, each 4 bytes in fp32, 2 in bf16, about 1 as bitsandbytes' 8-bit blockwise
  state: :data:`STATE_BYTES`, ``PipeConfig.optimizer_state_dtype``);
- **gradients**: an fp32 gradient per trainable parameter (accumulated over calls),
  and a second one for the call in flight: the runtime stages a call's gradients and
  merges them only when the whole call succeeded (``runtime.callgrads.CallGrads``), so a
  failed call changes nothing. It stages them as they arrive from the workers, in the
  compute dtype (2 bytes in bf16/fp16, 4 in fp32), and widens each to fp32 only where
  it is merged; with data parallelism the all-reduce works on them in fp32;
- **pinned buffers**: per worker, staging for two stages' weight-gradient downloads
  (compute dtype);
- **checkpoints**: every microbatch's activation at each stage boundary a later stage
  reads (backward-stage starts, the tail start, forward-stage outputs), plus one input
  gradient per microbatch in flight.

- **bounce buffers** (pin mode ``"off"``): per worker, two page-locked chunks of
  ``copy_chunk_mb`` that pageable weights stream through on their way to the device;
  in the other modes too when the embedding moves by rows (``ModelCosts.rows_bytes``:
  the rows are gathered into them), each the smaller of a chunk and the rows;
- **transient** (pin mode ``"copy"``): while a weight is copied into its new
  page-locked storage the original still exists: one tensor held twice, at most;
- **rows buffers** (``"overlap"`` and ``"lean"``, a trained embedding moving by rows
  when stepping the next call's rows first pays, :meth:`ModelCosts.rows_first_pays`;
  not with int8 state, whose optimizer steps the whole table):
  the ``OR`` action gathers those rows' fp32 weights and gradients and their optimizer
  state, steps them, and writes them in the compute dtype into one of two outputs
  (the previous call's may still be uploading): ``rows * hidden * (8 + states +
  2 * dtype)`` bytes, kept between steps (``runtime.optimizer.HostOptimizer.rows_room``;
  docs/optimizer.md, "The next call's rows first").

Frozen parameters (LoRA's base weights) have only their compute-dtype copy; under
QLoRA (``quantized``) the decoder blocks' frozen weights are NF4 bytes instead
(:func:`~rotapipe.plan.costs.nf4_bytes`, about 0.52 bytes per parameter).

The optimizer's host layout (:data:`LAYOUTS`, docs/memory.md) decides the gradients:

- ``"sync"`` (the default ``PipeConfig``): the fp32 gradient of every trainable
  parameter, plus the staged copy while calls accumulate (``staged_grads``);
- ``"overlap"``: the same gradients, plus the snapshot ``overlap`` takes of the
  weights and optimizer state of each stage it steps, so a failed call can be undone
  (``PipeConfig(undo_steps=True)``, its default): ``4 * (1 + optimizer_states)``
  bytes per trainable parameter at the end of a call;
- ``"stale"``: the gradients of ``"sync"`` plus the next call's staged ones (calls
  overlap the step), and a second compute-dtype copy of every trainable weight: the
  optimizer writes one step's weights into one copy while the next call's workers
  upload the previous step's from the other. Without a clip it steps each stage as it
  hands off, speculatively: undo snapshots as ``"overlap"``'s plus the compute copy
  each step overwrites;
- ``"lean"``: ``overlap`` with ``undo_steps=False`` and one call per step: each
  stage's gradients die at its step, and gradient downloads wait for the hand-off
  ``prefetch + 2`` jobs back (:func:`rotapipe.schedule.roundpipe.grad_window`), so the
  host holds at most ``prefetch + 2`` stages' gradients whatever the timing (clipping
  keeps the whole model's once, as ``"sync"`` without accumulation).

What is page-locked (:attr:`HostMemory.pinned`; the kernel can neither swap nor evict
it) depends on the pin mode (:class:`rotapipe.PinMode`, ``PipeConfig.pin``):

- ``"copy"``: every weight is copied into newly allocated page-locked memory and the
  original dropped: the same steady-state bytes, all page-locked, plus the transient;
- ``"register"`` (the CUDA default): the existing storages are page-locked in place
  (``cudaHostRegister``), no second copy;
- ``"off"``: the weights stay pageable (a memory-mapped frozen base may stay in the
  page cache or on disk) and uploads go through the bounce buffers.

In every mode the gradient staging buffers and the checkpoints are page-locked (device
downloads land in page-locked memory); masters, optimizer state and gradients are
pageable.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from .._enums import PinMode
from ..errors import ConfigError
from .configs import _get, block_linears, load_config, text_settings
from .costs import ModelCosts, nf4_bytes
from .partition import Plan

__all__ = ["HostMemory", "host_memory", "lora_params", "GB", "LAYOUTS", "STATE_BYTES"]

STATE_BYTES = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0 + 4.0 / 256}
"""Bytes per element of one optimizer-state tensor by ``PipeConfig.optimizer_state_dtype``
(int8: bitsandbytes' blockwise state, one byte per element plus an fp32 scale per block
of 256)."""

LAYOUTS = ("sync", "overlap", "lean", "stale")
"""Host layouts of the optimizer side (module docstring)."""

GB = 10**9
"""Host RAM is sold and reported in decimal gigabytes."""


@dataclass(frozen=True)
class HostMemory:
    """Host bytes of one run, by kind (see the module docstring)."""

    weights: int
    masters: int
    optimizer: int
    gradients: int
    pinned_buffers: int
    checkpoints: int
    bounce_buffers: int = 0
    """Page-locked chunks pageable weights (pin mode ``"off"``) and gathered embedding
    rows stream through."""
    transient: int = 0
    """The largest weight held twice while it is copied (pin mode ``"copy"``)."""
    pin: PinMode = PinMode.REGISTER
    """The pin mode the bytes assume."""
    snapshots: int = 0
    """``overlap``'s undo copies of stepped weights and optimizer state."""
    layout: str = "sync"
    """The optimizer host layout the bytes assume (:data:`LAYOUTS`)."""
    rows: int = 0
    """``overlap``'s buffers for stepping the next call's embedding rows first."""
    state_dtype: str = "fp32"
    """How the optimizer state is kept (:data:`STATE_BYTES`)."""
    staged: int = 0
    """Of ``gradients``: the staged copy of the call in flight while calls accumulate
    (``staged_grads``), in the dtype it is kept in."""

    @property
    def total(self) -> int:
        """Peak host bytes: every kind, the transient included."""
        return (self.weights + self.masters + self.optimizer + self.gradients
                + self.pinned_buffers + self.checkpoints + self.bounce_buffers
                + self.transient + self.snapshots + self.rows)

    @property
    def state(self) -> int:
        """The model state's bytes, which no plan changes: weights, masters, optimizer
        state, gradients and undo snapshots (:meth:`describe_state`)."""
        return self.weights + self.masters + self.optimizer + self.gradients + self.snapshots

    @property
    def pinned(self) -> int:
        """Page-locked bytes in steady state (see the module docstring)."""
        weights = 0 if self.pin is PinMode.OFF else self.weights
        return weights + self.pinned_buffers + self.checkpoints + self.bounce_buffers

    @property
    def pageable(self) -> int:
        """Bytes the kernel may swap or evict (the transient counts here)."""
        return self.total - self.pinned

    def as_dict(self) -> dict[str, int]:
        """Bytes by kind and their ``total`` (the kinds sum to it)."""
        return {"weights": self.weights, "masters": self.masters,
                "optimizer": self.optimizer, "gradients": self.gradients,
                "pinned_buffers": self.pinned_buffers, "checkpoints": self.checkpoints,
                "bounce_buffers": self.bounce_buffers, "transient": self.transient,
                "snapshots": self.snapshots, "rows": self.rows, "total": self.total}

    def describe(self) -> str:
        """``612.3 GB = weights 65.5 + masters 131.0 + ...`` in decimal GB, or MB below a
        GB (the bounce buffers and transient only where they exist)."""
        optional = ("bounce_buffers", "transient", "snapshots", "rows")
        return self._parts(self.total, [k for k, v in self.as_dict().items()
                                        if k != "total" and (v or k not in optional)])

    def _parts(self, total: int, kinds) -> str:
        state = "" if self.state_dtype == "fp32" else f" ({self.state_dtype} state)"
        unit, name = (GB, "GB") if total >= GB else (10**6, "MB")
        return f"{total / unit:.1f} {name} = " + " + ".join(
            f"{k.replace('_', ' ')} {getattr(self, k) / unit:.1f}"
            + (state if k == "optimizer" else "") for k in kinds)

    def describe_state(self) -> str:
        """``53.1 GB = weights 3.4 + masters 6.9 + ...``: :attr:`state` by kind (in MB
        below a GB)."""
        return self._parts(self.state, ("weights", "masters", "optimizer", "gradients")
                           + (("snapshots",) if self.snapshots else ()))

    def describe_pinned(self) -> str:
        """``page-locked (pin="register"): 74.5 GB, pageable 662.3 GB``."""
        return (f'page-locked (pin="{self.pin.value}"): {self.pinned / GB:.1f} GB, '
                f"pageable {self.pageable / GB:.1f} GB")


def size_text(n: int) -> str:
    """Bytes in decimal GB, or MB below a GB (as :meth:`HostMemory.describe`)."""
    return f"{n / GB:.1f} GB" if n >= GB else f"{n / 10**6:.1f} MB"


def lora_params(config, rank: int = 16,
                targets: Sequence[str] = ("q", "k", "v", "o", "gate", "up", "down")
                ) -> tuple[int, ...]:
    """Trainable parameters of LoRA adapters of ``rank`` per layer (embedding, decoder
    blocks, LM head: the layers of :func:`~rotapipe.plan.model_work`): ``rank x (fan_in
    + fan_out)`` on each of a block's matrices (:func:`rotapipe.plan.configs.block_linears`)
    whose role is in ``targets``, as PEFT's ``target_modules="all-linear"`` puts them
    with the default targets: attention projections (a fused ``qkv`` matrix when any
    of ``q``, ``k``, ``v`` is targeted, DeepSeek's latent projections under ``q`` and
    ``k``/``v``), dense MLPs and shared experts (a fused ``gate_up`` under ``gate`` or
    ``up``). Routed MoE experts and their router are left frozen (PEFT adapts them:
    ``docs/planning.md``); the embedding and head are frozen."""
    if rank < 1:
        raise ConfigError(f"LoRA rank must be >= 1, got {rank}")
    cfg = text_settings(load_config(config))
    wanted = set(targets)
    roles = {"qkv": {"q", "k", "v"}, "kv": {"k", "v"}, "gate_up": {"gate", "up"}}
    out = [0]
    for i in range(_get(cfg, "num_hidden_layers")):
        out.append(sum(rank * (a + b) for role, a, b in block_linears(cfg, i)
                       if roles.get(role, {role}) & wanted))
    return tuple(out + [0])


def host_memory(costs: ModelCosts, plan: Plan, microbatches: int, workers: int, *,
                trainable_params: Sequence[int] | None = None, dtype_bytes: int = 2,
                optimizer_states: int = 2, grad_bytes: int = 4,
                staged_grads: bool = True, staged_bytes: int | None = None,
                pin: PinMode | str = PinMode.REGISTER,
                chunk_mb: float = 32.0, largest_tensor: int | None = None,
                quantized: bool = False, layout: str = "sync",
                prefetch: int = 1, state_dtype: str = "fp32",
                clip: bool = False) -> HostMemory:
    """Host bytes of a run of ``plan`` over ``costs`` with ``microbatches`` microbatches.

    ``trainable_params`` per layer (default: every parameter, full fine-tuning; LoRA:
    :func:`lora_params`, whose adapters also get a compute-dtype copy).
    ``optimizer_states``: fp32 tensors of optimizer state per trainable parameter
    (Adam: 2, SGD with momentum: 1). ``staged_grads``: count the call's staged
    gradients beside the accumulated ones (what the runtime holds while calls
    accumulate; with one call per step the staged gradients become ``.grad``, one fp32
    copy at the peak); ``staged_bytes``: their bytes per parameter, by default the
    compute dtype's ``dtype_bytes`` (the runtime keeps them as they arrive; with data
    parallelism they are fp32: :func:`per_server`).

    ``pin``: the weights' pin mode (module docstring); ``chunk_mb``: the bounce buffers'
    chunk in MiB (``PipeConfig.copy_chunk_mb``); ``largest_tensor``: compute-dtype bytes
    of the largest weight, the ``"copy"`` transient (default: the largest layer's
    weights, an upper bound: the runtime copies tensor by tensor).

    ``quantized``: QLoRA, the decoder blocks' frozen weights held as NF4 (needs
    ``trainable_params``). ``layout``: the optimizer's host layout (:data:`LAYOUTS`);
    ``prefetch``: ``PipeConfig.prefetch``, for ``"lean"``. ``state_dtype``: how the
    optimizer state is kept (:data:`STATE_BYTES`; the undo snapshot copies it as kept).
    ``clip``: a global-norm clip is set (``PipeConfig.clip_grad_norm``); ``"stale"``
    then steps whole, without undo snapshots."""
    if state_dtype not in STATE_BYTES:
        raise ConfigError(f"state_dtype={state_dtype!r}: use one of "
                          f"{', '.join(map(repr, STATE_BYTES))}")
    state_bytes = STATE_BYTES[state_dtype]
    if layout not in LAYOUTS:
        raise ConfigError(f"layout={layout!r}: use one of {', '.join(map(repr, LAYOUTS))}")
    if quantized and trainable_params is None:
        raise ConfigError("quantized=True is QLoRA: pass the adapters' trainable_params "
                          "(rotapipe.plan.lora_params)")
    mode = _pin_mode(pin)
    if not chunk_mb > 0:
        raise ConfigError(f"chunk_mb={chunk_mb!r}: use the copy chunk in MiB, > 0 (e.g. 32)")
    layers, chunk = costs.layers, int(chunk_mb * 2**20)
    params = [l.weight_bytes // dtype_bytes for l in layers]
    # A head tied to the embedding holds no weight of its own on the host.
    held = params[:-1] + [params[-1] - costs.shared_bytes // dtype_bytes] \
        if len(params) > 1 else params
    trainable = list(trainable_params) if trainable_params is not None else held
    if len(trainable) != len(layers):
        raise ConfigError(f"trainable_params has {len(trainable)} entries for "
                          f"{len(layers)} layers")
    full = trainable_params is None
    n_train = sum(trainable)
    base = [nf4_bytes(n) if quantized and 0 < i < len(held) - 1 else n * dtype_bytes
            for i, n in enumerate(held)]
    # Compute copies: the frozen base, plus one per trainable parameter (two for
    # stale's views), none where an fp32 run's master is its own copy.
    views = 2 if layout == "stale" else 1
    frozen = sum(base) - (n_train * dtype_bytes if full else 0)
    weights = frozen + n_train * dtype_bytes * views \
        - (4 * n_train if dtype_bytes == 4 and views == 1 else 0)
    # Pinned staging for weight-gradient downloads: two stages' worth per worker, of
    # the largest stage that produces gradients (the tail and backward stages).
    grad_stages = (plan.tail,) + plan.backward
    per_param = [params, trainable][not full]
    stage_bytes = max(sum(per_param[s.start:s.stop]) * dtype_bytes for s in grad_stages)
    boundaries = plan.checkpoint_boundaries() | {s.stop for s in plan.forward}
    per_mb = sum(costs.input_bytes if b == 0 else layers[b - 1].output_bytes
                 for b in boundaries)
    per_mb += costs.input_bytes + layers[plan.tail.start - 1].output_bytes \
        if plan.tail.start > 0 else costs.input_bytes
    if largest_tensor is None:
        largest_tensor = max(l.weight_bytes for l in layers)
    # stale: the next call's staged gradients arrive while this step's are held.
    staged = (dtype_bytes if staged_bytes is None else staged_bytes) * n_train \
        if staged_grads or layout == "stale" else 0
    gradients = grad_bytes * n_train + staged
    if layout == "lean":
        # Stages whose gradients are on the host at once: the schedule's gradient
        # window (a download waits for the hand-off prefetch + 2 jobs back).
        per_stage = [sum(trainable[s.start:s.stop]) for s in grad_stages]
        gradients = grad_bytes * min(n_train, (prefetch + 2) * max(per_stage))
        staged = 0      # one call per step
    optimizer = int(state_bytes * optimizer_states * n_train)
    rows = 0
    if layout in ("overlap", "lean") and state_dtype != "int8" and trainable[0] and \
            costs.rows_first_pays():
        # Elements of the rows one call looks up: fp32 weight and gradient, the
        # optimizer state as kept, two outputs in the compute dtype.
        rows = int(costs.rows_bytes // dtype_bytes
                   * (8 + state_bytes * optimizer_states + 2 * dtype_bytes))
    snapshots = 0
    if layout == "overlap":
        snapshots = 4 * n_train + optimizer
    elif layout == "stale" and not clip:
        # stale without a clip steps each stage as it hands off, speculatively: the
        # undo copy of the weights, their state and the compute copy it overwrites.
        snapshots = 4 * n_train + optimizer + dtype_bytes * n_train
    return HostMemory(weights=weights, masters=4 * n_train,
                      optimizer=optimizer,
                      gradients=gradients,
                      snapshots=snapshots,
                      layout=layout, state_dtype=state_dtype, staged=staged, rows=rows,
                      pinned_buffers=2 * workers * stage_bytes,
                      checkpoints=microbatches * per_mb,
                      bounce_buffers=2 * workers * (
                          chunk if mode is PinMode.OFF else min(chunk, costs.rows_bytes)),
                      transient=int(largest_tensor) if mode is PinMode.COPY else 0,
                      pin=mode)


def _pin_mode(pin: PinMode | str) -> PinMode:
    try:
        return PinMode(pin)
    except ValueError:
        raise ConfigError(f"pin={pin!r}: use one of "
                          f"{', '.join(repr(m.value) for m in PinMode)}") from None


# -- data parallelism across servers (DataParallelConfig.shard) ---------------------------

SHARD_MODES = ("none", "optimizer", "gradients")


def per_server(mem: HostMemory, nodes: int, shard: str, in_flight: int = 0, *,
               stage: int = 0) -> HostMemory:
    """Host bytes per server of a run of ``nodes`` data-parallel servers, each holding
    ``mem`` for its share of the batch (docs/distributed.md, "Sharding"), in ``mem``'s
    layout (calls run one at a time, so no rows are stepped first: ``rows`` is 0):

    - ``"none"``: every server holds everything; its gradients are all-reduced in fp32,
      so a staged copy (``mem.staged``, counted in the compute dtype) is fp32, and the
      flat buckets in flight beside them are ``in_flight`` at most (the runtime's cap,
      ``DataParallelConfig.inflight_mb``, :class:`rotapipe.runtime.allreduce.InFlight`);
    - ``"optimizer"`` / ``"gradients"``: masters and optimizer state are 1/N, and the
      state is fp32 whatever ``mem.state_dtype`` (the sharded optimizer keeps fp32
      state; ``PipeConfig`` refuses another), and so is ``overlap``'s undo snapshot of
      what a server steps (the sharded ``overlap`` and ``lean`` layouts always take it).
      With one call per step (what ``rotapipe train`` does) a stage's gradients are
      copied into send buffers at its hand-off and dropped, so a server keeps the fp32
      1/N it owns plus what waits for the network: the send and receive buffers of the
      collectives in flight (``in_flight``, at most the cap, in bytes whatever
      ``DataParallelConfig.grad_dtype``: bf16 halves the traffic, not these bytes) and
      ``stage``, one stage's fp32 gradients waiting at its hand-off; the backward then
      waits, with at most two stages per worker downloaded ahead (the pinned staging
      buffers, already counted). With several calls per step ``"optimizer"`` also keeps
      a full local fp32 gradient between the calls.
    """
    if shard not in SHARD_MODES:
        raise ConfigError(f"shard={shard!r}: use one of {', '.join(map(repr, SHARD_MODES))}")
    if nodes < 1:
        raise ConfigError(f"nodes={nodes}: use 1 or more servers")
    if nodes == 1:
        return mem
    n_train = mem.masters // 4
    if shard == "none":
        staged = 4 * n_train if mem.staged else 0
        return replace(mem, gradients=mem.gradients - mem.staged + staged + in_flight,
                       staged=staged, rows=0)
    optimizer = int(mem.optimizer * 4 / STATE_BYTES[mem.state_dtype])     # fp32 state
    return replace(mem, masters=-(-mem.masters // nodes),
                   optimizer=-(-optimizer // nodes), state_dtype="fp32", staged=0,
                   gradients=-(-4 * n_train // nodes) + min(stage + in_flight,
                                                            mem.gradients),
                   snapshots=(-(-(4 * n_train + optimizer) // nodes)
                              if mem.layout in ("overlap", "lean") else 0), rows=0)


def bytes_sent(trainable: int, nodes: int, shard: str, *, dtype_bytes: int = 2,
               grad_bytes: int = 4, calls_per_step: int = 1) -> int:
    """Bytes one server sends per optimizer step (what rotapipe issues over gloo):

    - ``"none"``: an fp32 all-reduce of every gradient per call, modelled as a ring
      (``2 (N - 1) / N`` of the bytes; gloo chooses its own algorithm);
    - sharded: a reduce-scatter (an all-to-all: ``(N - 1) / N`` of the gradients in
      ``grad_bytes``) per call (``"gradients"``) or per step (``"optimizer"``), plus
      the all-gather of the updated weights in the compute dtype, ``(N - 1) / N``."""
    if nodes <= 1:
        return 0
    f = (nodes - 1) / nodes
    if shard == "none":
        return int(calls_per_step * 2 * f * 4 * trainable)
    scatters = calls_per_step if shard == "gradients" else 1
    return int(scatters * f * grad_bytes * trainable + f * dtype_bytes * trainable)
