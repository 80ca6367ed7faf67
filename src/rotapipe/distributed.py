"""Multi-server data parallelism: process-group setup, rank helpers, batch sharding.

One process per server (``torchrun --nnodes=2 --nproc-per-node=1 ...``), each driving
all of its GPUs (or emulated workers) with one :class:`rotapipe.RoundPipe`. Gradients
live in host memory, so the group uses gloo. A trainer does::

    info = rotapipe.distributed.init_from_env(timeout_s=300)
    pipe = rotapipe.RoundPipe(layers, loss_fn, config=config)   # data parallel when world > 1
    for batch in loader:                                         # the same global batch on every rank
        x, y = rotapipe.distributed.shard_batch(batch, info.rank, info.world_size)
        loss = pipe.forward_backward(x, y)                       # global mean loss
        pipe.step()
    if info.is_main:
        save(pipe.state_dict())                                  # identical on every rank

See ``docs/distributed.md`` for the semantics and the failure behaviour.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .errors import ConfigError, InputError
from .runtime import trees
from .runtime.allreduce import collectives_in_flight
from .runtime.batch import as_tree
from .runtime.heartbeat import stop_heartbeats

__all__ = ["DistInfo", "env_int", "init_from_env", "info", "rank", "world_size", "is_main",
           "shard_batch", "any_rank", "barrier", "shutdown", "full_weights"]

_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

log = logging.getLogger("rotapipe.distributed")


@dataclass(frozen=True)
class DistInfo:
    """Where this process stands in the data-parallel job."""

    rank: int
    """This process's rank, 0..world_size-1 (0 without a process group)."""
    world_size: int
    """Number of processes (servers); 1 without a process group."""
    local_rank: int
    """``LOCAL_RANK`` from torchrun (0 when absent)."""

    @property
    def is_main(self) -> bool:
        """True on rank 0, the rank that writes checkpoints and logs."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def env_int(name: str, default: int, least: int = 0, most: int | None = None) -> int:
    """The integer environment variable ``name`` (``default`` when unset or empty), or a
    :class:`ConfigError` naming the variable, its value and what torchrun would set."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < least or (most is not None and value > most):
        allowed = f"an integer >= {least}" + (f" and <= {most}" if most is not None else "")
        raise ConfigError(f"environment variable {name}={raw!r}: use {allowed} (torchrun "
                          "sets it; unset it to run as one process)")
    return value


def init_from_env(timeout_s: float = 300.0, backend: str = "gloo") -> DistInfo:
    """Join the job described by torchrun's environment, or run alone without one.

    - A process group already initialized (by the caller) is used as it is.
    - Else, with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set (as
      ``torchrun`` does), initialize the default group with ``backend`` (gloo: the
      gradients rotapipe reduces live in host memory) and a ``timeout_s`` timeout on
      every collective and on the rendezvous.
    - Else (a plain ``python train.py``), return rank 0 of 1 without a group.

    ``timeout_s`` bounds how long the other ranks wait for a dead or hung one; set
    ``PipeConfig.data_parallel.timeout_s`` to at most this value.

    A process that exits without :func:`shutdown` (an error on any path) leaves the
    group at exit, before the interpreter shuts down (:func:`_leave_at_exit`).
    """
    if not timeout_s > 0:
        raise ConfigError(f"timeout_s={timeout_s!r}: use seconds > 0")
    if not dist.is_available():
        raise ConfigError("this torch build has no torch.distributed: install a build "
                          "with distributed support to run data parallel")
    if not dist.is_initialized():
        present = [k for k in _ENV if k in os.environ]
        if not present:
            return DistInfo(0, 1, 0)
        missing = [k for k in _ENV if k not in os.environ]
        if missing:
            raise ConfigError(f"the environment sets {present} but not {missing}: launch "
                              "with torchrun, or set all of RANK, WORLD_SIZE, MASTER_ADDR "
                              "and MASTER_PORT")
        world = env_int("WORLD_SIZE", 1, least=1)
        env_int("RANK", 0, most=world - 1)
        env_int("MASTER_PORT", 0, least=1, most=65535)
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    atexit.unregister(_leave_at_exit)      # once, and after the handlers registered so far
    atexit.register(_leave_at_exit)
    return info()


def _leave_at_exit() -> None:
    """Leave the process group at interpreter exit, while the interpreter still runs.

    Otherwise gloo's threads outlive it: a worker thread frees a finished collective's
    last reference a moment after the collective returned, and when that moment falls
    into the interpreter's shutdown (a rank exiting right after a collective: an error
    line and ``sys.exit``, on a loaded machine), freeing a tensor Python created takes
    the GIL from a thread the shutdown no longer lets run, and the process aborts
    (SIGABRT, "terminate called without an active exception") instead of exiting with
    its status. Destroying the group first joins those threads. Not while a collective
    of a pipeline is still in flight (a failed call's, which its peers never joined):
    the destroy would wait for it, up to the group's timeout."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    stop_heartbeats()
    stuck = collectives_in_flight()
    if stuck:
        log.debug("leaving %d collective(s) in flight: not destroying the process group "
                  "at exit", stuck)
        return
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - exiting anyway; the group is half gone
        pass


def info() -> DistInfo:
    """This process's rank, world size and local rank (rank 0 of 1 without a group)."""
    local = env_int("LOCAL_RANK", 0)
    if not (dist.is_available() and dist.is_initialized()):
        return DistInfo(0, 1, local)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local)


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return info().rank


def world_size() -> int:
    """Number of ranks (1 without a process group)."""
    return info().world_size


def is_main() -> bool:
    """True on rank 0 (or without a process group): the rank that writes checkpoints."""
    return info().rank == 0


def shard_batch(batch, rank: int | None = None, world: int | None = None):
    """This rank's contiguous shard of a global batch (any pytree of tensors, split
    along dim 0): rank ``r`` of ``W`` gets rows ``[r * n / W, (r + 1) * n / W)``.

    The global batch size must be divisible by ``world`` so that every rank's share of
    the global mean is the same as in a one-process run with the whole batch (and the
    pipelines' microbatches line up: rank ``r``'s microbatch ``m`` is microbatch
    ``r * M + m`` of a one-process run with ``W * M`` microbatches, random streams
    included). ``rank``/``world`` default to this process's. A tokenizer's
    ``BatchEncoding`` (or another mapping) comes back as a dict of its shards.
    """
    batch = as_tree(batch)
    if rank is None or world is None:
        here = info()
        rank = here.rank if rank is None else rank
        world = here.world_size if world is None else world
    if world < 1 or not 0 <= rank < world:
        raise InputError(f"rank={rank} of world={world}: need 0 <= rank < world")
    n = trees.batch_size(batch, "batch")
    if n % world:
        raise InputError(f"the global batch has {n} rows, not divisible by the {world} "
                         f"ranks: pass a multiple of {world}")
    size = n // world
    return trees.map_tensors(lambda t: t[rank * size:(rank + 1) * size], batch)


def any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on any rank (a MAX all-reduce; ``flag``
    itself without a process group). Use it to stop all ranks at the same step (e.g.
    after Ctrl-C reached only some): a rank that stops alone leaves the others waiting
    in the next collective until their timeout."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return bool(flag)
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def barrier() -> None:
    """Wait for every rank (no-op without a process group)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def shutdown() -> None:
    """Leave the process group (no-op without one), after stopping the pipelines'
    heartbeat threads (they write to the group's store)."""
    if dist.is_available() and dist.is_initialized():
        stop_heartbeats()
        dist.destroy_process_group()


# -- sharded checkpoints ----------------------------------------------------------------
# A rank's shard (shard_state_dict) names every piece by its parameter's name and range,
# so the pieces of any world size reassemble into whole tensors (consolidate) and cut
# again for another (load_shard_state_dicts): a checkpoint written by 2 ranks resumes
# on 3, or on one process without data parallelism.

def _named(pipe) -> list[tuple[str, torch.nn.Parameter, int, int, torch.Size]]:
    """``(name, tensor the optimizer steps, start, end, whole shape)`` per trainable
    parameter this rank steps (a piece when sharded, the whole master otherwise)."""
    ls = pipe.layerset
    shard = getattr(pipe, "_shard", None)
    out = []
    for name, q in pipe.named_parameters():
        if shard is not None:
            pid, a, b = shard.owner_of(q)
        else:
            pid = ls.param_names.index(name)
            a, b = 0, q.numel()
        out.append((name, q, a, b, ls.params[pid].shape))
    return out


@contextlib.contextmanager
def full_weights(pipe):
    """Inside the block the model's trainable parameters hold the whole fp32 masters,
    so that ``pipe.state_dict()``, ``model.state_dict()`` and Hugging Face's
    ``save_pretrained`` write what a run without sharding writes. Sharded
    (``DataParallelConfig(shard=...)``), each rank keeps only its pieces of the fp32
    masters and the model's parameters hold the compute-dtype copies: in bf16 a save
    outside the block writes bf16-rounded weights (a LoRA adapter too). A collective
    when sharded (every rank enters it; the masters are all-gathered, holding one fp32
    copy of the trainable weights for the block); nothing to do otherwise. Train
    after the block, not inside it::

        with distributed.full_weights(pipe):
            if info.is_main:
                wrapped.save_pretrained("out")
    """
    shard = getattr(pipe, "_shard", None)
    if shard is None:
        yield
        return
    pipe.flush()            # a pending (stale) step lands in the masters first
    params = pipe.layerset.params
    full = shard.gather_masters()
    kept = {pid: params[pid].data for pid in full}
    try:
        for pid, t in full.items():
            params[pid].data = t
        shard.gathered = True
        yield
    finally:
        shard.gathered = False
        for pid, data in kept.items():
            params[pid].data = data


def shard_state_dict(pipe, optimizer: torch.optim.Optimizer) -> dict:
    """This rank's part of the training state, for a checkpoint every rank writes
    (``torch.save``-able; ``torch.load(weights_only=True)`` reads it): the fp32 masters
    and optimizer state of its pieces, each named by parameter and element range, and
    the optimizer's hyperparameters. Works unsharded too (one whole "piece" each).
    Flushes the pipeline first; no collective."""
    named = _named(pipe)
    by_id = {id(q): i for i, (_, q, *_rest) in enumerate(named)}
    groups, group_of = [], {}
    for g, group in enumerate(optimizer.param_groups):
        groups.append({k: v for k, v in group.items() if k != "params"})
        for q in group["params"]:
            group_of[named[by_id[id(q)]][0]] = g
    pieces = {}
    for name, q, a, b, shape in named:
        state = optimizer.state.get(q, {})
        pieces[name] = {"range": (a, b), "shape": tuple(shape), "group": group_of[name],
                        "master": q.detach().reshape(-1).clone(),
                        "state": {k: v.detach().reshape(-1).clone()
                                  if isinstance(v, torch.Tensor) and v.dim() > 0 else v
                                  for k, v in state.items()}}
    here = info()
    return {"format": "rotapipe-shard-1", "rank": here.rank, "world": here.world_size,
            "groups": groups, "pieces": pieces}


def consolidate(shards: list[dict]) -> dict:
    """Whole tensors from every rank's :func:`shard_state_dict` (of one checkpoint):
    ``{"masters": {name: fp32 tensor}, "state": {name: {key: tensor or value}},
    "groups": [...], "group_of": {name: index}}``. Elementwise state (a tensor the size
    of its piece) is concatenated in range order; the rest (AdamW's ``step``) is the
    same on every rank and taken once."""
    parts = _pieces(shards)
    out = {"masters": {}, "state": {}, "groups": shards[0]["groups"], "group_of": {}}
    for name, ps in parts.items():
        shape = ps[0]["shape"]
        out["masters"][name] = torch.cat([p["master"] for p in ps]).view(shape)
        out["group_of"][name] = ps[0]["group"]
        state = {}
        for key, value in ps[0]["state"].items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                state[key] = torch.cat([p["state"][key] for p in ps]).view(shape)
            else:
                state[key] = value
        out["state"][name] = state
    return out


def load_shard_state_dicts(pipe, optimizer: torch.optim.Optimizer, shards: list[dict]) -> None:
    """Resume from every rank's :func:`shard_state_dict` of one checkpoint, whatever the
    world size that wrote it: the masters (all of them: every compute copy is set) and
    this rank's pieces of the optimizer state, cut for the current layout. ``optimizer``
    is built over ``pipe.parameters()`` with the same parameter groups as the one
    saved. Every rank reads every shard (shared storage); no collective.

    One parameter at a time: each whole master exists only while its compute copies
    are written, and only the slices of the saved state this rank steps are read (with
    :func:`rotapipe.train.checkpoint.load_shards` ``mmap=True`` the rest is never
    read), so resuming needs no more memory than training."""
    parts = _pieces(shards)
    named = _named(pipe)
    missing = [name for name, *_ in named if name not in parts]
    if missing:
        raise InputError(f"the checkpoint has no {missing[0]!r}: it is from another model")
    groups_saved = shards[0]["groups"]
    if len(groups_saved) != len(optimizer.param_groups):
        raise InputError(f"the checkpoint's optimizer has {len(groups_saved)} parameter "
                         f"groups, this one {len(optimizer.param_groups)}: build it with "
                         "the same groups")
    group_now = {id(q): g for g, group in enumerate(optimizer.param_groups)
                 for q in group["params"]}
    moved = [(name, parts[name][0]["group"], group_now.get(id(q)))
             for name, q, *_ in named if parts[name][0]["group"] != group_now.get(id(q))]
    if moved:     # plain load_state_dict refuses groups of other sizes; this is finer
        name, was, now = moved[0]
        raise InputError(
            f"{name} was in parameter group {was} of the checkpoint's optimizer but is in "
            f"group {now} of this one ({len(moved)} parameter(s) moved): it would be "
            "stepped with another group's hyperparameters. Build the optimizer with the "
            "same groups as the one saved; nothing was loaded")
    pipe.flush()
    pipe._agree.loaded()       # data parallel: the next training call compares weights
    ls, shard = pipe.layerset, getattr(pipe, "_shard", None)
    with torch.no_grad():
        for pid in pipe.host.trainable:
            name = ls.param_names[pid]
            whole = _span(parts[name], "master", 0, ls.params[pid].numel())
            if shard is not None:
                shard.load_full({pid: whole})
            else:
                ls.params[pid].copy_(whole.view(ls.params[pid].shape))
    if shard is None:
        pipe.host.write_back()               # the compute-dtype copies follow the masters
    index = {id(q): i for i, q in enumerate(q for g in optimizer.param_groups
                                            for q in g["params"])}
    state = {}
    for name, q, a, b, _ in named:
        ps = parts[name]
        if not ps[0]["state"]:
            continue
        state[index[id(q)]] = {
            k: _span(ps, k, a, b).clone().view(q.shape)
            if isinstance(v, torch.Tensor) and v.dim() > 0 else v
            for k, v in ps[0]["state"].items()}
    groups = [{**groups_saved[g], "params": [index[id(q)] for q in group["params"]]}
              for g, group in enumerate(optimizer.param_groups)]
    from .pipe.state import PIECES      # the state is this rank's pieces' (cut above)
    tag = {} if shard is None else {PIECES: {"rank": shard.layout.rank,
                                             "world": shard.layout.world}}
    optimizer.load_state_dict({"state": state, "param_groups": groups, **tag})


def _pieces(shards: list[dict]) -> dict[str, list[dict]]:
    """``{parameter name: its saved pieces in range order}``; checks the shards are every
    rank's of one checkpoint and the pieces cover each parameter."""
    if not shards:
        raise InputError("no shards: pass every rank's shard_state_dict")
    worlds = {s["world"] for s in shards}
    ranks = sorted(s["rank"] for s in shards)
    if len(worlds) != 1 or ranks != list(range(shards[0]["world"])):
        raise InputError(f"the shards are ranks {ranks} of world sizes {sorted(worlds)}: "
                         "pass the shard of every rank of one checkpoint")
    parts: dict[str, list[dict]] = {}
    for s in shards:
        for name, piece in s["pieces"].items():
            parts.setdefault(name, []).append(piece)
    for name, ps in parts.items():
        ps.sort(key=lambda p: p["range"][0])
        n = int(torch.Size(ps[0]["shape"]).numel())
        got = [tuple(p["range"]) for p in ps]
        if got[0][0] != 0 or got[-1][1] != n or any(x[1] != y[0] for x, y in zip(got, got[1:])):
            raise InputError(f"the shards hold {got} of {name!r} ({n} elements): a rank's "
                             "shard is missing or from another checkpoint")
    return parts


def _span(pieces: list[dict], key: str, a: int, b: int) -> torch.Tensor:
    """Elements ``[a, b)`` of the flattened tensor ``key`` (``"master"`` or an optimizer
    state key) that ``pieces`` (in range order) hold between them, fp32 or as saved."""
    out = []
    for p in pieces:
        s, e = p["range"]
        lo, hi = max(a, s), min(b, e)
        if lo < hi:
            t = p["master"] if key == "master" else p["state"][key]
            out.append(t.reshape(-1)[lo - s:hi - s])
    if not out:
        dtype = pieces[0]["master"].dtype if key == "master" else \
            pieces[0]["state"][key].dtype
        return torch.empty(0, dtype=dtype)
    return torch.cat(out) if len(out) > 1 else out[0].clone()


def shard_from_state(pipe, masters: dict[str, torch.Tensor], optimizer_state: dict) -> dict:
    """A checkpoint written without sharding (whole fp32 ``masters`` by pipeline
    parameter name, and the ``state_dict()`` of an optimizer built over the unsharded
    ``pipe.parameters()``) as the one shard of a world of 1, for
    :func:`load_shard_state_dicts`: how a sharded run resumes an unsharded checkpoint.
    ``pipe`` is the pipeline resuming (any sharding): it gives the unsharded parameter
    order."""
    ls = pipe.layerset
    groups = [{k: v for k, v in g.items() if k != "params"}
              for g in optimizer_state["param_groups"]]
    group_of = {i: g for g, grp in enumerate(optimizer_state["param_groups"])
                for i in grp["params"]}
    pieces = {}
    for i, pid in enumerate(pipe.host.trainable):      # the unsharded optimizer's order
        name = ls.param_names[pid]
        t = masters[name]
        saved = optimizer_state["state"].get(i, {})
        pieces[name] = {"range": (0, t.numel()), "shape": tuple(t.shape),
                        "group": group_of.get(i, 0), "master": t.detach().reshape(-1).float(),
                        "state": {k: v.reshape(-1) if isinstance(v, torch.Tensor) and
                                  v.dim() > 0 else v for k, v in saved.items()}}
    return {"format": "rotapipe-shard-1", "rank": 0, "world": 1, "groups": groups,
            "pieces": pieces}
