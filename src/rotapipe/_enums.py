"""The closed sets of pipeline settings that ``rotapipe.train.TrainConfig`` and the
command line and the planner use, importable without torch (``rotapipe train --help``
and ``rotapipe plan`` stay fast); :mod:`rotapipe.config` re-exports them, and that is
where they are documented and used."""

from __future__ import annotations

import enum

__all__ = ["BackendKind", "NonFinite", "OptimizerMode", "PinMode", "RecomputeGrain",
           "ShardMode", "StateDtype"]


class RecomputeGrain(str, enum.Enum):
    """How a backward stage recomputes its forward from the host checkpoint."""

    STAGE = "stage"
    """Re-run the whole stage with autograd on, then run its backward (fastest)."""
    LAYER = "layer"
    """Re-run the stage without autograd keeping each layer's input, then recompute and
    backpropagate one layer at a time (least device memory)."""


class BackendKind(str, enum.Enum):
    """Which device backend runs the workers."""

    AUTO = "auto"
    """All CUDA GPUs when present, else emulated CPU workers."""
    CUDA = "cuda"
    EMULATED = "emulated"


class OptimizerMode(str, enum.Enum):
    """When :meth:`rotapipe.RoundPipe.train_step` runs the optimizer (docs/optimizer.md)."""

    SYNC = "sync"
    """After the call, over all gradients at once (exact)."""
    OVERLAP = "overlap"
    """During the call: each stage's parameters as soon as their gradients are in host
    memory, while shallower stages run backward; the next call starts while this one
    drains, each stage waiting for its own layers' update (exact)."""
    STALE = "stale"
    """Once the call is complete, while the next calls run on weights one step old
    (the RoundPipe paper's asynchronous step; not exact)."""


class NonFinite(str, enum.Enum):
    """What a training call does when its loss or a gradient is not finite (NaN or
    infinite; a gradient whose L2 norm overflows fp32 counts, as in
    ``clip_grad_norm_(error_if_nonfinite=True)``). Under dynamic loss scaling a
    non-finite gradient is an fp16 overflow: the step is skipped and the scale lowered,
    whatever this says."""

    RAISE = "raise"
    """The call fails with :class:`rotapipe.errors.NonFiniteError` and changes nothing
    (the API's default)."""
    SKIP = "skip"
    """The optimizer step is skipped (its gradients dropped) and counted
    (:attr:`rotapipe.RoundPipe.nonfinite_skips`); training goes on (``rotapipe train``'s
    default, which stops after ``max_nonfinite_skips`` skips in a row)."""


class ShardMode(str, enum.Enum):
    """What data-parallel ranks split between them (docs/distributed.md, "Sharding")."""

    NONE = "none"
    """Every rank holds the full fp32 masters, optimizer state and gradients; gradients
    are all-reduced after every call."""
    OPTIMIZER = "optimizer"
    """Each rank keeps the fp32 masters and optimizer state of 1/W of every parameter
    (ZeRO stage 1): the gradients accumulated over a step are reduce-scattered to their
    owners once per step, each rank steps its shard, and the updated compute-dtype
    weights are all-gathered. A full local fp32 gradient is kept between calls."""
    GRADIENTS = "gradients"
    """As ``optimizer``, and the gradients are reduce-scattered after every call, so
    the gradients accumulated between steps are sharded too (ZeRO stage 2)."""


class StateDtype(str, enum.Enum):
    """How the optimizer's per-parameter state (Adam's two moments, SGD's momentum) is
    kept in host memory between steps (docs/optimizer.md, "Optimizer-state precision").
    The fp32 masters and the update itself are fp32 in every case."""

    FP32 = "fp32"
    """As the optimizer keeps it (fp32 for fp32 masters): exact."""
    BF16 = "bf16"
    """bfloat16 between steps (half the bytes), widened to fp32 around each step of
    ``torch.optim`` Adam, AdamW or SGD, and rounded back to nearest after it: an
    approximation (the moments lose 16 mantissa bits at every step)."""
    INT8 = "int8"
    """8-bit blockwise state, for a bitsandbytes 8-bit optimizer
    (``bitsandbytes.optim.AdamW8bit``, which keeps it so itself; about a quarter of the
    bytes): an approximation."""


class PinMode(str, enum.Enum):
    """How the model state the workers upload is kept in host memory
    (docs/host_memory.md). A copy engine reads page-locked ("pinned") memory without the
    CPU; from pageable memory a copy is partly synchronous with the host (CUDA runtime
    API, "API synchronization behavior")."""

    COPY = "copy"
    """Copy every compute-dtype weight into newly allocated pinned memory (the original
    is dropped; for a moment both exist)."""
    REGISTER = "register"
    """Page-lock the existing storages in place (``cudaHostRegister``): no second copy.
    The emulated backend records and accounts the registration."""
    OFF = "off"
    """Keep the weights pageable (e.g. a memory-mapped safetensors frozen base) and
    stream them through a small pool of pinned bounce buffers, chunk by chunk."""
