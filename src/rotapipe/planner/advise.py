"""`rotapipe plan`'s analysis: will a run fit (device and host memory, and which
binds), with which plan, how fast, the longest sequence that fits, and what to change
when it does not fit. Arithmetic and simulation only: no weights are loaded."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from .._enums import RecomputeGrain
from .._validate import PLAN_LIMITS, check_limits
from ..errors import ConfigError, PlanError
from ..plan import Hardware, ModelCosts, model_costs, model_work
from ..plan.configs import FAMILIES, folded_expert_stacks, load_config, text_settings
from ..plan.hostmem import (GB, SHARD_MODES, HostMemory, bytes_sent, host_memory,
                            lora_params, per_server)
from ..plan.partitioner import Direction, Footprint, assemble_plan
from .autoplan import (OPTIMIZER_RATE, ModeSteps, PlanChoice, PlannerConfig, choose_plan,
                       optimizer_modes)

__all__ = ["PlanAnalysis", "analyze", "default_host_ram", "longest_sequence"]


def default_host_ram(hw: Hardware) -> int:
    """Host RAM assumed when none is given: 64 GB per device, at least 128 GB."""
    return max(128, 64 * hw.count) * GB


@dataclass(frozen=True)
class ServerMode:
    """One shard mode of a multi-server run: host memory per server and the bytes each
    server sends per step, at ``network_gbps`` (:func:`rotapipe.plan.hostmem.bytes_sent`)."""

    shard: str
    host: HostMemory
    sent_bytes: int
    network_gbps: float
    compute_s: float = 0.0
    """The plan's step without communication (the pipeline's prediction)."""
    window_s: float = 0.0
    """The part of it gradients can be sent in: the backward (from the first hand-off)."""
    gather_bytes: int = 0
    """Of ``sent_bytes``, the all-gather of the updated weights: after the whole step
    (the exact optimizer with clipping), so never hidden."""
    optimizer_s: float = 0.0
    """The host optimizer's step on the parameters this server steps (all of them
    unsharded, its 1/N share sharded), after the gradients arrive and before the
    weights are gathered: calls run one at a time under data parallelism (``sync``)."""

    @property
    def comm_s(self) -> float:
        """Seconds per step to send ``sent_bytes`` at the link's rate."""
        return self.sent_bytes * 8 / (self.network_gbps * 1e9)

    @property
    def exposed_s(self) -> float:
        """Communication the step waits for: gradients beyond the backward window (the
        backward waits on the in-flight cap: :class:`rotapipe.runtime.allreduce.InFlight`)
        plus the weight all-gather after the step."""
        gather_s = self.gather_bytes * 8 / (self.network_gbps * 1e9)
        return max(0.0, self.comm_s - gather_s - self.window_s) + gather_s

    @property
    def step_s(self) -> float:
        """Predicted step time: the call, the communication it does not hide, and the
        host optimizer's step on this server's share."""
        return self.compute_s + self.exposed_s + self.optimizer_s


@dataclass(frozen=True)
class PlanAnalysis:
    """Everything ``rotapipe plan`` prints (``as_dict`` is its ``--json``)."""

    model: str
    hardware: str
    seq: int
    global_batch: int
    lora: bool
    device_limit: int
    host_limit: int
    choice: PlanChoice | None
    """None when no plan fits device memory."""
    host: HostMemory
    device_error: str | None
    longest_seq: int
    """Longest sequence some plan fits in device memory (one sequence per microbatch)."""
    longest_seq_host: int
    """The same, also holding host memory (0: host RAM is short at any length)."""
    mfu: float
    suggestions: tuple[str, ...] = field(default=())
    nodes: int = 1
    """Data-parallel servers (``--nodes``); the other fields are per server (its share
    of the global batch)."""
    shard: str = "none"
    """The shard mode ``host`` assumes: the first of none / optimizer / gradients whose
    host bytes fit (the last when none does)."""
    servers: tuple[ServerMode, ...] = field(default=())
    """Per shard mode: host bytes per server and traffic per step (``nodes`` > 1)."""
    qlora: bool = False
    """LoRA on an NF4-quantized frozen base (``--qlora``)."""
    inflight_mb: float = 100.0
    """``nodes`` > 1: the runtime's cap on collective buffers in flight per server
    (``DataParallelConfig.inflight_mb``), as the host memory counts it."""
    grad_dtype: str = "float32"
    """``nodes`` > 1: dtype the sharded modes send gradients in
    (``DataParallelConfig.grad_dtype``; ``"none"`` always sends fp32)."""
    family: str = ""
    """The config's ``model_type``; one outside :data:`rotapipe.plan.configs.FAMILIES` is
    priced as a Llama-style block, and the text says so."""
    modes: ModeSteps | None = None
    """The plan's step in each optimizer mode with the host optimizer's time
    (``overlap`` and ``stale`` only with ``--modes``); ``None`` when no plan fits."""
    folded_stacks: int = 0
    """LoRA: the fused expert stacks ``rotapipe train --lora``'s default targets (PEFT
    ``all-linear``) would adapt, which this plan prices frozen
    (:func:`rotapipe.plan.configs.folded_expert_stacks`); the text says so."""

    @property
    def fits_device(self) -> bool:
        return self.choice is not None

    @property
    def fits_host(self) -> bool:
        return self.host.total <= self.host_limit

    @property
    def fits(self) -> bool:
        return self.fits_device and self.fits_host

    @property
    def binding(self) -> str:
        """``device`` or ``host``: the constraint closer to (or past) its limit."""
        if not self.fits_device:
            return "device"
        dev = self.choice.device_bytes / self.device_limit
        return "host" if self.host.total / self.host_limit > dev else "device"

    def as_dict(self) -> dict:
        c = self.choice
        out = {"model": self.model, "hardware": self.hardware, "seq": self.seq,
               "global_batch": self.global_batch, "lora": self.lora, "qlora": self.qlora,
               "model_type": self.family, "counted_exactly": self.family in FAMILIES,
               "lora_folded_expert_stacks": self.folded_stacks,
               "layout": self.host.layout, "fits": self.fits,
               "fits_device": self.fits_device, "fits_host": self.fits_host,
               "binding": self.binding, "device_limit_bytes": self.device_limit,
               "host_limit_bytes": self.host_limit, "host_bytes": self.host.as_dict(),
               "pin": self.host.pin.value, "host_pinned_bytes": self.host.pinned,
               "longest_seq": self.longest_seq,
               "longest_seq_with_host": self.longest_seq_host, "suggestions": list(self.suggestions),
               "device_error": self.device_error, "nodes": self.nodes,
               "shard": self.shard, "grad_dtype": self.grad_dtype,
               "servers": [{"shard": m.shard, "layout": m.host.layout,
                            "host_bytes": m.host.as_dict(),
                            "sent_bytes_per_step": m.sent_bytes, "comm_s": m.comm_s,
                            "network_gbps": m.network_gbps, "exposed_s": m.exposed_s,
                            "optimizer_s": m.optimizer_s, "step_s": m.step_s}
                           for m in self.servers]}
        if c is not None:
            r = c.report
            out.update({"plan": c.plan.to_text(), "forward_stages": len(c.plan.forward),
                        "backward_stages": len(c.plan.backward),
                        "tail": [c.plan.tail.start, c.plan.tail.stop],
                        "microbatches": c.microbatches, "grain": c.grain.value,
                        "tokens_per_microbatch": c.costs.tokens,
                        "device_bytes": c.device_bytes, "step_ms": r.step_ms,
                        "tokens_per_s": r.tokens_per_s, "mfu": self.mfu,
                        "bubble": r.bubble.total, "estimate_ms": c.estimate_ms,
                        "candidates_simulated": c.simulated})
        if self.modes is not None:
            m = self.modes
            out["optimizer"] = {"rate": m.rate, "params": m.params, "clip": m.clip,
                                "step_ms": m.step_ms, "call_ms": m.call_ms,
                                "sync_ms": m.sync_ms, "overlap_ms": m.overlap_ms,
                                "stale_ms": m.stale_ms}
        return out

    def to_text(self) -> str:
        c, gib = self.choice, 2**30
        lines = [f"{self.model} on {self.hardware}, {self.global_batch} x {self.seq} tokens "
                 f"per step, {'QLoRA (NF4 base)' if self.qlora else 'LoRA' if self.lora else 'full fine-tuning'}"]
        if self.family not in FAMILIES:
            lines.append(f"cost model: model_type {self.family!r} is not a family it counts "
                         "block by block; its blocks are priced as Llama-style (pre-norms, "
                         "gated MLP), so sizes and times may be off (docs/simulate.md, "
                         "\"The cost model\")")
        if self.folded_stacks:
            lines.append(f"note: this plan prices LoRA with the routed experts frozen; "
                         f"rotapipe train --lora's default targets (PEFT all-linear) also "
                         f"adapt this model's {self.folded_stacks} fused expert stacks, "
                         f"folding B·A into each whole stack on every forward "
                         f"(docs/training.md); --lora-targets with the attention's "
                         f"projection names only (q_proj,k_proj,v_proj,o_proj on "
                         f"Qwen3-MoE; rotapipe train's summary prints them) leaves the "
                         f"experts frozen")
        verdict = "fits" if self.fits else "does NOT fit"
        lines.append(f"verdict: {verdict} (binding constraint: {self.binding} memory)")
        if c is not None:
            lines.append(f"device memory: {c.device_bytes / gib:.1f} GiB of "
                         f"{self.device_limit / gib:.1f} GiB usable per worker")
        else:
            lines.append(f"device memory: no plan fits: {self.device_error}")
        lines.append(f"host memory: needs {self.host.total / GB:.1f} GB of host RAM, you "
                     f"have {self.host_limit / GB:.0f}" + ("" if self.fits_host else
                                                           " (does not fit)"))
        lines.append(f"  {self.host.describe()}")
        lines.append(f"  host layout: {LAYOUT_TEXT[self.host.layout]}")
        lines.append(f"  {self.host.describe_pinned()}")
        if c is not None:
            r, p = c.report, c.plan
            lines.append(f"plan: {len(p.forward)} forward stages, fused tail "
                         f"[{p.tail.start}:{p.tail.stop}], {len(p.backward)} backward stages; "
                         f"{c.grain.value} recompute; {c.microbatches} microbatches of "
                         f"{c.costs.tokens} tokens")
            lines.append(f"  {p.to_text()}")
            lines.append(f"predicted: step {r.step_ms / 1e3:.2f} s, {r.tokens_per_s:,.0f} "
                         f"tokens/s, MFU {100 * self.mfu:.1f}%, bubble "
                         f"{100 * r.bubble.total:.1f}%")
            if self.modes is not None:
                lines += self._mode_lines(c.costs.tokens * c.microbatches)
        host_note = (f"{self.longest_seq_host:,} with this host RAM"
                     if self.longest_seq_host else "host RAM short at any length")
        lines.append(f"longest sequence that fits device memory (1 sequence per "
                     f"microbatch, layer recompute): {self.longest_seq:,} tokens "
                     f"({host_note})")
        if self.nodes > 1:
            lines.append(f"per server ({self.nodes} servers, data parallel, "
                         f"{self.servers[0].network_gbps:g} Gb/s each; exact optimizer, "
                         "a step = the call + exposed traffic + the host step on the "
                         f"server's share; sharded gradients sent in {self.grad_dtype}):")
            lines.append(f"  {'shard':>10} {'layout':>7} {'host RAM (GB)':>14} {'masters':>8} "
                         f"{'optimizer':>10} {'gradients':>10} {'sent/step (GB)':>15} "
                         f"{'comm (s)':>9} {'exposed (s)':>12} {'host step (s)':>14} "
                         f"{'step (s)':>9} {'tokens/s':>9}")
            tokens = self.nodes * self.global_batch * self.seq
            for m in self.servers:
                mark = "  <- fits" if m.shard == self.shard and self.fits_host else ""
                rate = tokens / m.step_s if m.step_s > 0 else 0.0
                lines.append(f"  {m.shard:>10} {m.host.layout:>7} {m.host.total / GB:>14.1f} "
                             f"{m.host.masters / GB:>8.1f} {m.host.optimizer / GB:>10.1f} "
                             f"{m.host.gradients / GB:>10.1f} {m.sent_bytes / GB:>15.1f} "
                             f"{m.comm_s:>9.2f} {m.exposed_s:>12.2f} "
                             f"{m.optimizer_s:>14.2f} {m.step_s:>9.2f} {rate:>9,.0f}{mark}")
            lines.append(f"  gradients in flight capped at {self.inflight_mb:g} MiB per server "
                         "(DataParallelConfig.inflight_mb): a slower link makes the backward "
                         "wait (exposed) instead of queueing gradients in host RAM")
        lines += [f"suggestion: {s}" for s in self.suggestions]
        return "\n".join(lines)

    def _mode_lines(self, tokens: int) -> list[str]:
        """The host optimizer's time and each optimizer mode's step."""
        m = self.modes
        clip = "with a global-norm clip" if m.clip else "no clipping (--clip prices it)"
        head = (f"host optimizer: {_sci(m.params)} parameters at {_sci(m.rate)} per second "
                f"(--optimizer-rate): {m.step_ms / 1e3:.2f} s a step; {clip}")
        if m.overlap_ms is None:
            return [head, f"  sync (the default optimizer_mode: the call, then the step): "
                          f"{m.sync_ms / 1e3:.2f} s, {tokens / m.sync_ms * 1e3:,.0f} "
                          f"tokens/s (--modes: overlap and stale too)"]
        rows = [("sync", m.sync_ms, "the call, then the step (the default)"),
                ("overlap", m.overlap_ms, "exact; pipelined calls, each stage stepped at "
                                          "its hand-off"),
                ("stale", m.stale_ms, "one step stale; pipelined calls"
                                      + ("" if self.choice.report.calls > 1 else
                                         " (--stale plans for it)"))]
        return [head] + [f"  {name:8s} {ms / 1e3:7.2f} s a step {tokens / ms * 1e3:>10,.0f} "
                         f"tokens/s  {what}" for name, ms, what in rows]


def _sci(x: float) -> str:
    """``2.03e9``: three significant digits, a plain exponent."""
    e = int(math.floor(math.log10(x))) if x > 0 else 0
    return f"{x / 10**e:.3g}e{e}"


LOSS_CHUNK_BYTES = 2 * 256 * 2**20
"""Device bytes of the chunked LM-head loss's logits and their gradient: the adapters
run the loss ``loss_chunk_tokens`` tokens at a time (256 MiB of logits; see
docs/huggingface.md), so full-sequence logits never exist."""


LAYOUT_TEXT = {
    "sync": "sync (the default optimizer_mode: exact; fp32 gradients of the whole model, "
            "plus a call's staged copy while calls accumulate)",
    "overlap": "overlap with undo_steps=True (exact; gradients of the whole model plus "
               "snapshots of stepped weights and optimizer state)",
    "lean": "lean: PipeConfig(optimizer_mode='overlap', undo_steps=False), one call per "
            "step (exact; each stage's gradients freed at its step; a failed call needs "
            "the last checkpoint)",
    "stale": "stale (one step stale; the gradients of sync, plus a second compute copy "
             "of the trained weights for the step in flight)",
}
"""How ``rotapipe plan`` names each host layout (:data:`rotapipe.plan.hostmem.LAYOUTS`)."""


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


def _fits_device(costs: ModelCosts, memory: int, grad_bytes) -> bool:
    """Whether some plan fits: every layer alone fits (layer grain) beside the
    largest single layer."""
    fp = Footprint.of(costs, 1, RecomputeGrain.LAYER, grad_bytes)
    n = len(costs.layers)
    cap = max(fp.resident(Direction.BACKWARD, i, i + 1) for i in range(n))
    return all(fp.needs(d, i, i + 1, cap) <= memory
               for i in range(n) for d in (Direction.FORWARD, Direction.BACKWARD))


def longest_sequence(model, hw: Hardware, *, global_batch: int, device_limit: int,
                     host_limit: int | None = None, lora_rank: int | None = None,
                     limit: int = 1 << 20, pin: str = "register",
                     chunk_mb: float = 32.0, qlora: bool = False,
                     layout: str = "sync") -> int:
    """Longest sequence (multiple of 128) for which some plan fits device memory with
    one sequence per microbatch and, if ``host_limit`` is given, host memory holds the
    model state and every checkpoint (0: none)."""
    trainable, grads = _trainable(model, hw, lora_rank)

    def ok(seq: int) -> bool:
        costs = _costs(model, hw, seq, global_batch=global_batch)
        if not _fits_device(costs, device_limit, grads):
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
                           tail_jobs=tuple(range(1, min(hw.count, 8) + 1)))

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
                               device_limit=device_limit, lora_rank=lora_rank)
    longest_host = longest_sequence(model, hw, global_batch=global_batch,
                                    device_limit=device_limit, host_limit=host_limit,
                                    lora_rank=lora_rank, pin=pin, chunk_mb=chunk_mb,
                                    qlora=qlora, layout=host.layout)
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
