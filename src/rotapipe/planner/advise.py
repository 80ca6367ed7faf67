"""`rotapipe plan`'s analysis: will a run fit (device and host memory, and which
binds), with which plan, how fast, the longest sequence that fits, and what to change
when it does not fit. Arithmetic and simulation only: no weights are loaded."""

from __future__ import annotations

import math
from dataclasses import replace

from .._enums import RecomputeGrain
from .._validate import PLAN_LIMITS, check_limits
from ..errors import ConfigError, PlanError
from ..plan import Hardware, ModelCosts, model_costs, model_work
from ..plan.configs import folded_expert_stacks, load_config, text_settings
from ..plan.hostmem import (GB, SHARD_MODES, HostMemory, bytes_sent, host_memory,
                            lora_params, per_server)
from ..plan.partitioner import Direction, Footprint, assemble_plan
from .analysis import LAYOUT_TEXT, PlanAnalysis, ServerMode
from .autoplan import OPTIMIZER_RATE, PlannerConfig, choose_plan, optimizer_modes

__all__ = ["LAYOUT_TEXT", "PlanAnalysis", "analyze", "default_host_ram", "longest_sequence"]


def default_host_ram(hw: Hardware) -> int:
    """Host RAM assumed when none is given: 64 GB per device, at least 128 GB."""
    return max(128, 64 * hw.count) * GB


LOSS_CHUNK_BYTES = 2 * 256 * 2**20
"""Device bytes of the chunked LM-head loss's logits and their gradient: the adapters
run the loss ``loss_chunk_tokens`` tokens at a time (256 MiB of logits; see
docs/huggingface.md), so full-sequence logits never exist."""


def _costs(model, hw: Hardware, seq: int, microbatch_size: int = 1,
           quantize: str | None = None, adapters=None,
           global_batch: int | None = None) -> ModelCosts:
    """:func:`model_costs` with the head's activations as the chunked loss keeps them:
    its input and output gradient (two hidden states per token) plus one chunk.
    ``adapters``: LoRA's trainable parameters per layer (:func:`lora_params`). With
    ``global_batch`` the token embedding moves by the rows of a call's ``global_batch x
    seq`` tokens (what wrapped Hugging Face models do)."""
    costs = model_costs(model, hw, seq=seq, microbatch_size=microbatch_size,
                        quantize=quantize, adapters=adapters,
                        call_tokens=None if global_batch is None else global_batch * seq)
    head = costs.layers[-1]
    hidden = 2 * costs.layers[-2].output_bytes
    saved = min(head.saved_bytes, hidden + LOSS_CHUNK_BYTES)
    return replace(costs, layers=costs.layers[:-1] + (replace(head, saved_bytes=saved),))


def _divisors(n: int, cap: int = 64) -> tuple[int, ...]:
    return tuple(d for d in range(1, min(n, cap) + 1) if n % d == 0)


def _singles_plan(n: int):
    """Every stage one layer: the most checkpoints a plan can keep in host memory."""
    body = n - 1
    runs = [(i, i + 1) for i in range(body)]
    return assemble_plan(n, runs, body, runs)


def _fits_device(costs: ModelCosts, memory: int, grad_bytes, prefetch: int = 1) -> bool:
    """Whether some plan fits: every layer alone fits (layer grain) beside ``prefetch``
    stages as large as the largest single layer."""
    fp = Footprint.of(costs, 1, RecomputeGrain.LAYER, grad_bytes, prefetch)
    n = len(costs.layers)
    cap = max(fp.resident(Direction.BACKWARD, i, i + 1) for i in range(n))
    return all(fp.needs(d, i, i + 1, cap) <= memory
               for i in range(n) for d in (Direction.FORWARD, Direction.BACKWARD))


def longest_sequence(model, hw: Hardware, *, global_batch: int, device_limit: int,
                     host_limit: int | None = None, lora_rank: int | None = None,
                     limit: int = 1 << 20, pin: str = "register",
                     chunk_mb: float = 32.0, qlora: bool = False,
                     layout: str = "sync", prefetch: int = 1) -> int:
    """Longest sequence (multiple of 128) for which some plan fits device memory with
    one sequence per microbatch and, if ``host_limit`` is given, host memory holds the
    model state and every checkpoint (0: none)."""
    trainable, grads = _trainable(model, hw, lora_rank)

    def ok(seq: int) -> bool:
        costs = _costs(model, hw, seq, global_batch=global_batch)
        if not _fits_device(costs, device_limit, grads, prefetch):
            return False
        if host_limit is None:
            return True
        host = host_memory(costs, _singles_plan(len(costs.layers)), global_batch,
                           hw.count, trainable_params=trainable, pin=pin, chunk_mb=chunk_mb,
                           quantized=qlora, layout=layout)
        return host.total <= host_limit

    lo, hi = 0, limit // 128   # in units of 128 tokens: ok(lo * 128), not ok(hi * 128)
    if ok(hi * 128):
        return hi * 128
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid * 128) else (lo, mid)
    return lo * 128


def _trainable(model, hw: Hardware, lora_rank: int | None):
    """(trainable params per layer or None, device gradient bytes per layer or None)."""
    if lora_rank is None:
        return None, None
    t = lora_params(model, lora_rank)
    return t, tuple(2 * x for x in t)


def analyze(model, hw: Hardware, *, seq: int, global_batch: int,
            lora_rank: int | None = None, host_ram: int | None = None,
            microbatches: int | None = None, stale: bool = False,
            memory_fraction: float = 0.9, pin: str = "register",
            chunk_mb: float = 32.0, nodes: int = 1, network_gbps: float = 25.0,
            qlora: bool = False, layout: str | None = None,
            prefetch: int = 1, inflight_mb: float = 100.0,
            optimizer_state: str = "fp32", grad_dtype: str = "float32",
            optimizer_rate: float = OPTIMIZER_RATE, modes: bool = False,
            clip: bool = False) -> PlanAnalysis:
    """Plan ``model`` on ``hw`` for steps of ``global_batch`` sequences of ``seq``
    tokens (LoRA of ``lora_rank`` if given) and judge the fit; see :class:`PlanAnalysis`.
    Host memory assumes the weights' pin mode ``pin`` (:class:`rotapipe.PinMode`) and
    copy chunks of ``chunk_mb`` MiB (:func:`rotapipe.plan.host_memory`).

    ``nodes`` > 1: data parallel over that many servers linked at ``network_gbps``;
    each plans its ``global_batch / nodes`` sequences, and the host memory is per
    server for the first shard mode that fits (:attr:`PlanAnalysis.servers` lists
    every mode), with ``inflight_mb`` MiB of collective buffers in flight (the
    runtime's backpressure cap, ``DataParallelConfig.inflight_mb``), the sharded modes
    sending gradients in ``grad_dtype`` (``DataParallelConfig.grad_dtype``: float32 or
    bfloat16, which halves their traffic but not the host bytes: the cap is in bytes).

    ``qlora``: the LoRA base is NF4 (needs ``lora_rank``). ``layout``: the optimizer's
    host layout (:data:`rotapipe.plan.hostmem.LAYOUTS`); ``None``: ``"stale"`` with
    ``stale``, else the first of ``"sync"`` and ``"lean"`` whose host memory fits (the
    cheapest exact layout).
    ``optimizer_state``: ``PipeConfig.optimizer_state_dtype`` (fp32, bf16 or int8).

    The host optimizer steps ``optimizer_rate`` parameters per second
    (:attr:`PlanAnalysis.modes`, :func:`~rotapipe.planner.autoplan.optimizer_modes`): the
    ``sync`` step always, with ``modes`` also the steady state of pipelined ``overlap``
    and ``stale`` calls, priced as with a global-norm clip with ``clip``; one server only
    (``nodes`` > 1: ``None``; data parallelism runs calls one at a time and the sharded
    modes step a share of the model each, which is not modelled)."""
    check_limits(PLAN_LIMITS, seq=seq, global_batch=global_batch, lora_rank=lora_rank,
                 host_ram=host_ram, microbatches=microbatches,
                 memory_fraction=memory_fraction, chunk_mb=chunk_mb, nodes=nodes,
                 network_gbps=network_gbps, prefetch=prefetch, inflight_mb=inflight_mb,
                 optimizer_rate=optimizer_rate)
    if qlora and lora_rank is None:
        raise ConfigError("qlora needs a LoRA rank: QLoRA trains LoRA adapters on the "
                          "quantized base")
    if global_batch % nodes:
        raise ConfigError(f"--nodes {nodes}: the global batch {global_batch} must split "
                          "evenly over the servers (a multiple of --nodes)")
    if grad_dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"--grad-dtype {grad_dtype}: use float32 or bfloat16")
    if grad_dtype != "float32" and nodes == 1:
        raise ConfigError("--grad-dtype bfloat16 is how sharded data parallelism sends "
                          "gradients between servers: add --nodes 2 (or more), or drop it")
    if nodes > 1:
        a = analyze(model, hw, seq=seq, global_batch=global_batch // nodes,
                    lora_rank=lora_rank, host_ram=host_ram, microbatches=microbatches,
                    stale=stale, memory_fraction=memory_fraction, pin=pin,
                    chunk_mb=chunk_mb, qlora=qlora, layout=layout, prefetch=prefetch,
                    optimizer_state=optimizer_state, optimizer_rate=optimizer_rate,
                    clip=clip)
        def server_mode(m: str) -> ServerMode:
            # Each shard mode in the first layout that fits it (the sharded overlap
            # step always snapshots its pieces, so lean is rarely their cheapest).
            opts = [_server_mode(replace(a, host=_relayout(a, model, hw, lora_rank, name,
                                                           pin, chunk_mb, qlora, prefetch,
                                                           optimizer_state)),
                                 hw, nodes, m, network_gbps, inflight_mb,
                                 2 if grad_dtype == "bfloat16" and m != "none" else 4)
                    for name in _layouts(layout, stale)]
            return next((o for o in opts if o.host.total <= a.host_limit), opts[-1])
        modes = tuple(server_mode(m) for m in SHARD_MODES)
        pick = next((m for m in modes if m.host.total <= a.host_limit), modes[-1])
        # The optimizer modes are priced for one server: with data parallelism calls
        # run one at a time, so each server's row prices sync with its share's step.
        out = PlanAnalysis(**{**a.__dict__, "host": pick.host, "nodes": nodes,
                              "shard": pick.shard, "servers": modes, "modes": None,
                              "suggestions": (), "inflight_mb": inflight_mb,
                              "grad_dtype": grad_dtype})
        return _with_suggestions(out, model, hw, lora_rank,
                                 (microbatches,) if microbatches else
                                 _divisors(global_batch // nodes))
    if microbatches is not None and global_batch % microbatches:
        raise ConfigError(f"--microbatches {microbatches} must divide the global batch "
                          f"{global_batch}")
    device_limit = int(hw.device.memory_bytes * memory_fraction)
    host_limit = host_ram or default_host_ram(hw)
    trainable, grads = _trainable(model, hw, lora_rank)
    counts = (microbatches,) if microbatches else _divisors(global_batch)
    # Tail splits up to one job per worker (at most 8): on 8 workers every worker then
    # runs one tail job (GPT-OSS-20B: 17.5% bubble with 8 jobs against 22.3% with 4).
    config = PlannerConfig(hw.count, device_limit, counts, stale=stale, grad_bytes=grads,
                           tail_jobs=tuple(range(1, min(hw.count, 8) + 1)),
                           prefetch=prefetch)

    quantize = "nf4" if qlora else None

    def costs_for(M: int) -> ModelCosts:
        return _costs(model, hw, seq, global_batch // M, quantize, trainable,
                      global_batch)

    def host_for(costs, plan, M) -> HostMemory:
        hosts = [host_memory(costs, plan, M, hw.count, trainable_params=trainable, pin=pin,
                             chunk_mb=chunk_mb, quantized=qlora, layout=name,
                             prefetch=prefetch, state_dtype=optimizer_state, clip=clip)
                 for name in _layouts(layout, stale)]
        return next((h for h in hosts if h.total <= host_limit), hosts[-1])

    choice, error = None, None
    try:
        choice = choose_plan(costs_for, config)
        host = host_for(choice.costs, choice.plan, choice.microbatches)
    except PlanError as exc:
        error = str(exc)
        costs = costs_for(max(counts))
        host = host_for(costs, _singles_plan(len(costs.layers)), max(counts))
    longest = longest_sequence(model, hw, global_batch=global_batch,
                               device_limit=device_limit, lora_rank=lora_rank,
                               prefetch=prefetch)
    longest_host = longest_sequence(model, hw, global_batch=global_batch,
                                    device_limit=device_limit, host_limit=host_limit,
                                    lora_rank=lora_rank, pin=pin, chunk_mb=chunk_mb,
                                    qlora=qlora, layout=host.layout, prefetch=prefetch)
    mfu = 0.0
    if choice is not None:
        flops = sum(w.forward_flops + w.backward_flops
                    for w in model_work(model, seq, adapters=trainable))
        peak = (hw.device.tflops_fp16_accumulate if hw.fp16_accumulate
                else hw.device.tflops) * 1e12
        mfu = flops * choice.report.tokens_per_s / (hw.count * peak)
    steps = None if choice is None else optimizer_modes(choice, hw.count, optimizer_rate,
                                                         pipelined=modes, clip=clip)
    settings = text_settings(load_config(model))      # read once: family and experts
    analysis = PlanAnalysis(str(model), hw.name, seq, global_batch, lora_rank is not None,
                            device_limit, host_limit, choice, host, error, longest,
                            longest_host, mfu, qlora=qlora, modes=steps,
                            family=str(settings.get("model_type", "")),
                            folded_stacks=0 if lora_rank is None else
                            folded_expert_stacks(settings))
    return _with_suggestions(analysis, model, hw, lora_rank, counts)


def _layouts(layout: str | None, stale: bool) -> tuple[str, ...]:
    """The host layouts to try, cheapest first: ``layout`` if given, ``"stale"`` for a
    stale pipeline, else the exact ones (``"sync"``, then ``"lean"``)."""
    return (layout,) if layout else ("stale",) if stale else ("sync", "lean")


def _relayout(a: PlanAnalysis, model, hw, lora_rank, layout: str, pin, chunk_mb, qlora,
              prefetch, optimizer_state) -> HostMemory:
    """``a.host`` in the optimizer host layout ``layout``."""
    if a.host.layout == layout:
        return a.host
    if a.choice is not None:
        costs, plan, M = a.choice.costs, a.choice.plan, a.choice.microbatches
    else:
        M = max(_divisors(a.global_batch))      # as analyze() when no plan fits
        costs = _costs(model, hw, a.seq, a.global_batch // M, "nf4" if qlora else None)
        plan = _singles_plan(len(costs.layers))
    return host_memory(costs, plan, M, hw.count,
                       trainable_params=_trainable(model, hw, lora_rank)[0], pin=pin,
                       chunk_mb=chunk_mb, quantized=qlora, layout=layout,
                       prefetch=prefetch, state_dtype=optimizer_state)


def _server_mode(a: PlanAnalysis, hw, nodes: int, shard: str, gbps: float,
                 inflight_mb: float, grad_bytes: int = 4) -> ServerMode:
    """Host bytes per server, traffic and step time of ``shard``. Gradients waiting for
    the network: the runtime caps them (:class:`rotapipe.runtime.allreduce.InFlight`)
    at ``inflight_mb`` of send and receive buffers plus one stage's fp32 gradients at
    its hand-off; a link slower than the backward then costs time, not memory:
    gradient traffic beyond the backward is exposed, and so is the all-gather of the
    weights after the step."""
    trainable = a.host.masters // 4
    sent = bytes_sent(trainable, nodes, shard, grad_bytes=grad_bytes)
    stage = a.host.pinned_buffers // max(1, hw.count)     # one stage, fp32
    cap = int(inflight_mb * 2**20)
    compute_s = window_s = 0.0
    if a.choice is not None:
        compute_s = a.choice.report.step_ms / 1e3
        layers = a.choice.costs.layers
        back = sum(l.backward_ms + l.recompute_ms for l in layers)
        window_s = compute_s * back / max(1e-9, back + sum(l.forward_ms for l in layers))
    gather = 0 if shard == "none" or nodes == 1 else \
        int((nodes - 1) / nodes * 2 * trainable)             # compute dtype (bf16)
    # The host step: every stepped parameter unsharded, this server's share sharded.
    optimizer_s = 0.0 if a.modes is None else \
        a.modes.params / (1 if shard == "none" else nodes) / a.modes.rate
    return ServerMode(shard, per_server(a.host, nodes, shard, cap, stage=stage), sent, gbps,
                      compute_s, window_s, gather, optimizer_s)


def _with_suggestions(a: PlanAnalysis, model, hw, lora_rank, counts) -> PlanAnalysis:
    out: list[str] = []
    if not a.fits_device:
        if a.global_batch > max(counts):
            out.append(f"more microbatches: --microbatches {a.global_batch} (one sequence, "
                       f"{a.seq} tokens, per microbatch)")
        out.append("layer recompute grain is already tried (the planner tries both grains); "
                   f"fewer tokens per microbatch: the longest sequence that fits is "
                   f"{a.longest_seq:,} tokens")
        if lora_rank is None:
            out.append("LoRA (--lora): frozen weights need no gradient on the device")
    if not a.fits_host:
        out.append(f"needs {a.host.total / GB:.0f} GB of host RAM, you have "
                   f"{a.host_limit / GB:.0f}: add RAM (--host-ram {math.ceil(a.host.total / GB)})")
        if lora_rank is None:
            t = lora_params(model, 16)
            costs = a.choice.costs if a.choice else _costs(model, hw, a.seq)
            plan = a.choice.plan if a.choice else _singles_plan(len(costs.layers))
            lo = host_memory(costs, plan, a.choice.microbatches if a.choice else max(counts),
                             hw.count, trainable_params=t, pin=a.host.pin)
            out.append(f"LoRA (--lora, rank 16) needs {lo.total / GB:.0f} GB of host RAM: "
                       "frozen weights have no master, gradient or optimizer state")
        if lora_rank is not None and not a.qlora:
            costs = a.choice.costs if a.choice else _costs(model, hw, a.seq)
            plan = a.choice.plan if a.choice else _singles_plan(len(costs.layers))
            q = host_memory(costs, plan, a.choice.microbatches if a.choice else max(counts),
                            hw.count, trainable_params=lora_params(model, lora_rank),
                            pin=a.host.pin, quantized=True, layout=a.host.layout)
            out.append(f"QLoRA (--qlora) needs {q.total / GB:.0f} GB of host RAM: the "
                       f"frozen base as NF4 ({q.weights / GB:.0f} GB of weights)")
        if a.host.checkpoints > 0.2 * a.host.total:
            out.append("fewer tokens per step (shorter --seq or smaller --global-batch): "
                       f"activation checkpoints take {a.host.checkpoints / GB:.0f} GB")
    positions = _max_positions(model)
    if positions is not None and a.seq > positions:
        out.append(f"--seq {a.seq:,} is beyond the model's max_position_embeddings "
                   f"({positions:,}): memory and time hold, but the model never saw "
                   f"positions that far; train at {positions:,} tokens or less, or extend "
                   "its positions first (rope_scaling in its config.json)")
    return PlanAnalysis(**{**a.__dict__, "suggestions": tuple(out)})


def _max_positions(model) -> int | None:
    """The config's ``max_position_embeddings`` (its text config's for a multimodal
    one), or ``None`` when it gives none."""
    n = text_settings(load_config(model)).get("max_position_embeddings")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None
