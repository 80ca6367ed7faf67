"""What ``rotapipe plan`` says: :class:`PlanAnalysis` (the verdict, plan, prediction and
host memory of one run, as text or JSON) and :class:`ServerMode` (one data-parallel
shard mode's host memory and traffic per server). :mod:`.advise` computes them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..plan.configs import FAMILIES
from ..plan.hostmem import GB, HostMemory
from .autoplan import ModeSteps, PlanChoice

__all__ = ["LAYOUT_TEXT", "PlanAnalysis", "ServerMode"]


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
