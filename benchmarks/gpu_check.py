"""A GPU check in one command: exactness on the real backend, then its timing against
the timed emulation and the simulator.

(a) Exactness matrix. Tiny models (``rotapipe.model.tiny.tiny_gpt``, and a 3-layer
random Hugging Face Qwen3 through ``rotapipe.adapters.wrap_hf`` when ``transformers``
is installed) train for ``--steps`` steps with AdamW (lr 1e-2, eps 1e-3 as in
``tests/test_exactness.py``) on ``--backend`` workers, and from the same initial
weights on the same batches in plain PyTorch on the CPU, in fp32 (TF32 off on CUDA).
Every combination of workers (1..GPUs; emulated: 1..3, ``--quick`` 1..2),
microbatches {1, 4}, recompute grain {stage, layer}, optimizer mode {sync, overlap,
stale} and pin mode {copy, register, off} is compared:

- the gradients the optimizer receives at the first step, element by element;
- every weight after the last step (stale: after ``flush()``);
- the loss of every step.

``stale`` is compared with its own definition, the one-step-delayed reference of
``tests/test_optimizer_modes.py``: ``w[t+1] = opt(w[t], grad L_t(w[t-1]))``. A case
passes when every element is within ``|got - want| <= atol + rtol * |want|`` (emulated:
rtol 1e-5, atol 1e-6, the test suite's; CUDA: rtol 1e-4, atol 1e-5, since cuBLAS and
the CPU sum in different orders). The table has one row per (model, optimizer, pin)
with the worst case over workers x microbatches x grain; ``--detail`` prints every case.
``rel`` is normwise: max |got - want| / max |want| over a tensor, worst tensor shown.
Then dropout 0.1 (:func:`dropout_exactness`): the first call's gradients against plain
PyTorch on the same device type, each layer seeded as the pipeline seeds it.

(b) Timing. CUDA: a Qwen3-like model (``--layers`` decoder layers of hidden 2048,
sequence ``--seq``, bf16, one sequence per microbatch) runs ``forward_backward`` on all
GPUs; the same plan and schedule are simulated on a hardware profile measured here
(bf16 matmul TFLOPS and pinned host-to-device bandwidth of GPU 0, memory from
``torch.cuda.get_device_properties``), and run on the timed emulation of that profile
(emulated workers with a stand-in model that sleep for the modeled times). Emulated
backend: only the last two (timed emulation against the simulator; there is no real
GPU to time). On CUDA a ``copy engines`` line per direction first tests the copy model
(:func:`copy_engines`). Step = one ``forward_backward`` call (no optimizer), median of
``--timing-steps`` after a warm-up.

    python benchmarks/gpu_check.py                         # on a machine with GPUs
    python benchmarks/gpu_check.py --backend emulated --quick   # checks the script here

Exit code: 0 all within tolerance, 1 a case failed, 2 no CUDA GPU (without
``--backend emulated``). See docs/gpu_check.md for how to read and act on the tables.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import statistics
import sys
import time
import traceback
from dataclasses import dataclass

import torch

import rotapipe
from rotapipe.model.tiny import lm_loss, stride_batch, tiny_gpt
from rotapipe.plan import DeviceProfile, Hardware, hardware
from rotapipe.runtime.emulation import TimedEmulation
from rotapipe.sim import ActionTimes, run as simulate

TOLERANCE = {"emulated": (1e-5, 1e-6), "cuda": (1e-4, 1e-5)}     # rtol, atol
OPTIMIZER = dict(lr=1e-2, eps=1e-3)   # eps: see OPTIMIZERS in tests/test_exactness.py
BATCH = 8                             # samples per step, split into the microbatches


# -- the models under test -------------------------------------------------------------

@dataclass
class Subject:
    """A tiny model: how to build it, its batches, its pipeline and its plain step."""

    name: str
    build: object       # seed -> nn.Module (fp32, CPU)
    batch: object       # step -> batch
    pipe: object        # (model, PipeConfig, optimizer factory) -> RoundPipe
    call: object        # (pipe, batch) -> (inputs, labels) of train_step
    plain: object       # (model, batch) -> loss, after its backward (plain PyTorch)


def tiny_gpt_subject() -> Subject:
    vocab, seq = 64, 16

    def build(seed):
        torch.manual_seed(seed)
        return tiny_gpt(vocab, dim=32, layers=3, heads=4, seq=seq)

    def batch(step):
        return stride_batch(BATCH, seq, vocab, generator=torch.Generator().manual_seed(step))

    def plain(model, b):
        loss = lm_loss(model(b[0]), b[1])
        loss.backward()
        return loss.item()

    return Subject("tiny-gpt", build, batch,
                   lambda model, cfg, opt: rotapipe.RoundPipe(model, lm_loss, config=cfg,
                                                              optimizer=opt),
                   lambda pipe, b: b, plain)


def hf_qwen3_subject() -> Subject | None:
    try:
        import transformers
    except ImportError:
        return None
    from rotapipe.adapters import wrap_hf
    vocab, seq = 97, 7

    def build(seed):
        torch.manual_seed(seed)
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
            vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            max_position_embeddings=64, tie_word_embeddings=True, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, attn_implementation="eager"))

    def batch(step):
        # Token ids with left and right padding, labels -100 on the padding.
        g = torch.Generator().manual_seed(100 + step)
        ids = torch.randint(3, vocab, (BATCH, seq), generator=g)
        mask = torch.ones(BATCH, seq, dtype=torch.long)
        mask[0, :3] = 0
        mask[BATCH // 2, seq - 2:] = 0
        ids[mask == 0] = 0
        return ids, mask, ids.masked_fill(mask == 0, -100)

    def pipe(model, cfg, opt):
        return wrap_hf(model, loss_chunk_tokens=5).pipe(cfg, optimizer=opt)

    def call(pipe, b):
        return {"input_ids": b[0], "attention_mask": b[1]}, b[2]

    def plain(model, b):
        loss = model(input_ids=b[0], attention_mask=b[1], labels=b[2]).loss
        loss.backward()
        return loss.item()

    return Subject("hf-qwen3", build, batch, pipe, call, plain)


# -- one case --------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    subject: str
    workers: int
    microbatches: int
    grain: str
    optimizer: str
    pin: str


@dataclass
class Trained:
    losses: list[float]
    grads: dict[str, torch.Tensor]      # what the first optimizer step received
    weights: dict[str, torch.Tensor]    # after the last step


def make_optimizer(params):
    return torch.optim.AdamW(params, **OPTIMIZER)


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()
            if p.grad is not None}


def train_pipe(subject: Subject, model, case: Case, backend: str, steps: int) -> Trained:
    names = {id(p): n for n, p in model.named_parameters()}
    cfg = rotapipe.PipeConfig(workers=case.workers, microbatches=case.microbatches,
                              grain=case.grain, backend=backend, optimizer_mode=case.optimizer,
                              pin=case.pin)
    seen: dict[str, torch.Tensor] = {}

    def record(opt, args, kwargs):      # each parameter's first gradient (overlap steps
        for group in opt.param_groups:  # stage by stage, so several calls)
            for p in group["params"]:
                if p.grad is not None:
                    seen.setdefault(names[id(p)], p.grad.detach().cpu().clone())

    with subject.pipe(model, cfg, make_optimizer) as pipe:
        hook = pipe.optimizer.register_step_pre_hook(record)
        losses = [pipe.train_step(*subject.call(pipe, subject.batch(t))) for t in range(steps)]
        pipe.flush()                    # stale: apply the pending step
        hook.remove()
        weights = _params(model)
    return Trained(losses, seen, weights)


def train_plain(subject: Subject, model, stale: bool, steps: int) -> Trained:
    """Plain PyTorch on the CPU; ``stale``: the one-step-delayed optimizer."""
    opt = make_optimizer(model.parameters())
    losses, first = [], None
    if not stale:
        for t in range(steps):
            losses.append(subject.plain(model, subject.batch(t)))
            first = first or _grads(model)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return Trained(losses, first, _params(model))
    shadow = copy.deepcopy(model)       # runs call t on w[t-1] (w[-1] = w[0])

    def apply(grads):
        for n, p in model.named_parameters():
            p.grad = grads.get(n)
        opt.step()
        opt.zero_grad(set_to_none=True)

    runs_on, pending = copy.deepcopy(model.state_dict()), None
    for t in range(steps):
        shadow.load_state_dict(runs_on)
        shadow.zero_grad(set_to_none=True)
        losses.append(subject.plain(shadow, subject.batch(t)))
        if pending is not None:
            apply(pending)
        runs_on = copy.deepcopy(model.state_dict())
        pending = _grads(shadow)
        first = first or pending
    apply(pending)
    return Trained(losses, first, _params(model))


@dataclass
class Diff:
    grad_abs: float = 0.0
    grad_rel: float = 0.0
    weight_abs: float = 0.0
    weight_rel: float = 0.0
    loss_abs: float = 0.0
    ok: bool = True
    note: str = ""

    def worst(self, other: Diff) -> Diff:
        return Diff(*(max(getattr(self, f), getattr(other, f)) for f in
                      ("grad_abs", "grad_rel", "weight_abs", "weight_rel", "loss_abs")),
                    self.ok and other.ok, self.note or other.note)


def compare(got: dict, want: dict, rtol: float, atol: float) -> tuple[float, float, bool, str]:
    """Max abs difference, worst normwise relative difference, within tolerance, note."""
    if got.keys() != want.keys():
        missing = sorted(set(want) ^ set(got))
        return float("inf"), float("inf"), False, f"tensors differ: {missing[:3]}"
    abs_, rel, ok, note = 0.0, 0.0, True, ""
    for k, w in want.items():
        g = got[k].to(w.dtype)
        d = (g - w).abs()
        abs_ = max(abs_, d.max().item())
        rel = max(rel, d.max().item() / max(w.abs().max().item(), 1e-30))
        if not bool((d <= atol + rtol * w.abs()).all()):
            ok, note = False, note or f"{k} out of tolerance"
    return abs_, rel, ok, note


def run_case(subject: Subject, case: Case, backend: str, steps: int) -> Diff:
    rtol, atol = TOLERANCE[backend]
    model = subject.build(0)
    reference = copy.deepcopy(model)    # before the pipeline pins or moves anything
    try:
        got = train_pipe(subject, model, case, backend, steps)
    except Exception as exc:   # noqa: BLE001 - a failing case is a row, not a crash
        traceback.print_exc(limit=3)
        return Diff(ok=False, note=f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
    want = train_plain(subject, reference, case.optimizer == "stale", steps)
    ga, gr, gok, gnote = compare(got.grads, want.grads, rtol, atol)
    wa, wr, wok, wnote = compare(got.weights, want.weights, rtol, atol)
    loss = max(abs(a - b) for a, b in zip(got.losses, want.losses))
    lok = all(abs(a - b) <= atol + rtol * abs(b) for a, b in zip(got.losses, want.losses))
    return Diff(ga, gr, wa, wr, loss, gok and wok and lok,
                gnote or wnote or ("" if lok else "loss out of tolerance"))


def exactness(args, backend: str, devices: int) -> bool:
    subjects = [tiny_gpt_subject()]
    hf = hf_qwen3_subject()
    if hf is None:
        print("hf-qwen3 skipped: transformers is not installed")
    else:
        subjects.append(hf)
    if backend == "cuda":
        workers = list(range(1, devices + 1))
    else:
        workers = [1, 2] if args.quick else [1, 2, 3]
    rtol, atol = TOLERANCE[backend]
    print(f"\n(a) exactness on {backend}: workers {workers}, microbatches {{1, 4}}, grain "
          f"{{stage, layer}}, {args.steps} AdamW steps, fp32, batch {BATCH}; tolerance "
          f"rtol {rtol:g} atol {atol:g}; torch threads {torch.get_num_threads()}")
    rows: dict[tuple, tuple[Diff, int, Case | None]] = {}
    t0 = time.perf_counter()
    for subject in subjects:
        for mode, pin, w, m, grain in itertools.product(
                ("sync", "overlap", "stale"), ("copy", "register", "off"), workers, (1, 4),
                ("stage", "layer")):
            case = Case(subject.name, w, m, grain, mode, pin)
            diff = run_case(subject, case, backend, args.steps)
            if args.detail:
                print(f"  {case}: grads {diff.grad_abs:.1e}/{diff.grad_rel:.1e} weights "
                      f"{diff.weight_abs:.1e}/{diff.weight_rel:.1e} loss "
                      f"{diff.loss_abs:.1e} {'ok' if diff.ok else 'FAIL ' + diff.note}")
            key = (subject.name, mode, pin)
            old, n, bad = rows.get(key, (Diff(), 0, None))
            rows[key] = (old.worst(diff), n + 1, bad or (None if diff.ok else case))
    dropout_ok = dropout_exactness(backend, workers)
    print(f"{len(rows)} rows, {sum(n for _, n, _ in rows.values())} cases in "
          f"{time.perf_counter() - t0:.0f} s\n")
    print(f"{'model':9s} {'optimizer':9s} {'pin':8s} {'cases':>5s} {'grad abs':>9s} "
          f"{'grad rel':>9s} {'weight abs':>10s} {'weight rel':>10s} {'loss abs':>9s}  result")
    for (name, mode, pin), (d, n, bad) in rows.items():
        result = "ok" if d.ok else (f"FAIL (first: w{bad.workers} m{bad.microbatches} "
                                    f"{bad.grain}: {d.note})")
        print(f"{name:9s} {mode:9s} {pin:8s} {n:5d} {d.grad_abs:9.1e} {d.grad_rel:9.1e} "
              f"{d.weight_abs:10.1e} {d.weight_rel:10.1e} {d.loss_abs:9.1e}  {result}")
    return dropout_ok and all(d.ok for d, _, _ in rows.values())


def dropout_exactness(backend: str, workers: list[int]) -> bool:
    """Dropout 0.1 in every block: the first call's gradients against plain PyTorch on
    the same device type, each layer seeded as the pipeline seeds it
    (``rotapipe.layer_seed``). The matrix above has no dropout; this is the case that
    shows whether a backward stage's recompute (grad on) draws the masks its forward
    (no grad) drew, with GPU kernels that may differ between the two."""
    dev = torch.device("cuda", 0) if backend == "cuda" else torch.device("cpu")
    rtol, atol = TOLERANCE[backend]
    vocab, seq, M = 64, 16, 2
    torch.manual_seed(0)
    model = tiny_gpt(vocab, dim=32, layers=3, heads=4, seq=seq, dropout=0.1)
    ref = copy.deepcopy(model).to(dev)
    x, y = stride_batch(BATCH, seq, vocab, generator=torch.Generator().manual_seed(0))
    for m, (xm, ym) in enumerate(zip(x.tensor_split(M), y.tensor_split(M))):
        h = xm.to(dev)
        for l, layer in enumerate(ref):
            torch.manual_seed(rotapipe.layer_seed(0, 0, m, l))   # CPU and every GPU
            h = layer(h)
        (lm_loss(h, ym.to(dev)) * (xm.shape[0] / x.shape[0])).backward()
    want = {n: p.grad.cpu() for n, p in ref.named_parameters()}
    ok = True
    for w, grain in itertools.product(workers, ("stage", "layer")):
        cfg = rotapipe.PipeConfig(workers=w, microbatches=M, grain=grain, backend=backend,
                                  seed=0)
        got_model = copy.deepcopy(model)
        with rotapipe.RoundPipe(got_model, lm_loss, config=cfg) as pipe:
            pipe.forward_backward(x, y)
        abs_, rel, good, note = compare(_grads(got_model), want, rtol, atol)
        ok = ok and good
        print(f"dropout 0.1, {w} worker(s), grain {grain}: gradients {abs_:.1e} abs, "
              f"{rel:.1e} rel  {'ok' if good else 'FAIL ' + note}")
    return ok


# -- timing ----------------------------------------------------------------------------

def qwen3_like(layers: int) -> dict:
    """A Qwen3-1.7B-shaped decoder with ``layers`` blocks and a 32k vocabulary."""
    return dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=2048,
                intermediate_size=6144, num_hidden_layers=layers, num_attention_heads=16,
                num_key_value_heads=8, head_dim=128, vocab_size=32000,
                max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1e6,
                tie_word_embeddings=False, attention_bias=False, hidden_act="silu")


def measured_hardware(count: int, efficiency: float) -> Hardware:
    """A profile of GPU 0: bf16 matmul TFLOPS and pinned host->device GB/s measured now."""
    props = torch.cuda.get_device_properties(0)
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    end.synchronize()
    tflops = 2 * n**3 * 10 / (start.elapsed_time(end) / 1e3) / 1e12
    host = torch.empty(256 * 2**20, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device="cuda")
    dev.copy_(host, non_blocking=True)
    start.record()
    for _ in range(5):
        dev.copy_(host, non_blocking=True)
    end.record()
    end.synchronize()
    gbps = host.numel() * 5 / (start.elapsed_time(end) / 1e3) / 1e9
    del a, b, dev
    torch.cuda.empty_cache()
    name = props.name.lower().replace(" ", "-")
    print(f"measured {props.name}: bf16 matmul {tflops:.0f} TFLOPS, pinned H2D {gbps:.1f} "
          f"GB/s, {props.total_memory / 2**30:.0f} GiB; layers assumed at {efficiency:.0%} "
          "of that matmul rate")
    return Hardware(DeviceProfile(name, props.total_memory / 2**30, tflops, tflops, gbps),
                    count, efficiency=efficiency)


def copy_engines() -> None:
    """Whether the runtime's copy model holds on GPU 0 (docs/concepts.md, "Copy
    engines"): a 4 MiB copy issued on a second stream just after a 512 MiB one in the
    same direction waits for all of it (one engine per direction, in issue order), also
    from a high-priority stream. Several engines per direction (data-centre GPUs) let
    it run beside the big one: then the gated chunks buy less than the emulation says."""
    dev = torch.device("cuda", 0)
    big_h = torch.empty(512 << 20, dtype=torch.uint8, pin_memory=True)
    small_h = torch.empty(4 << 20, dtype=torch.uint8, pin_memory=True)
    big_d = torch.empty_like(big_h, device=dev)
    small_d = torch.empty_like(small_h, device=dev)

    def timed(stream, fn):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        ev[0].record(stream)
        with torch.cuda.stream(stream):
            fn()
        ev[1].record(stream)
        return ev
    directions = (("host->device", (big_h, big_d, small_h, small_d)),
                  ("device->host", (big_d, big_h, small_d, small_h)))
    for name, (src_b, dst_b, src_s, dst_s) in directions:
        alone = timed(torch.cuda.Stream(dev), lambda: dst_s.copy_(src_s, non_blocking=True))
        torch.cuda.synchronize(dev)
        line = f"copy engines, {name}: 4 MiB alone {alone[0].elapsed_time(alone[1]):.2f} ms"
        for label, priority in (("default", 0), ("high", -1)):
            a, b = torch.cuda.Stream(dev), torch.cuda.Stream(dev, priority=priority)
            big = timed(a, lambda: dst_b.copy_(src_b, non_blocking=True))
            small = timed(b, lambda: dst_s.copy_(src_s, non_blocking=True))
            torch.cuda.synchronize(dev)
            big_ms, small_ms = big[0].elapsed_time(big[1]), small[0].elapsed_time(small[1])
            verdict = "waits" if small_ms > 0.5 * big_ms else "runs beside it"
            line += (f"; behind 512 MiB ({big_ms:.1f} ms) on a {label}-priority stream "
                     f"{small_ms:.2f} ms ({verdict})")
        print(line)
    del big_h, small_h, big_d, small_d
    torch.cuda.empty_cache()


def median_call_s(pipe, inputs, labels, steps: int) -> float:
    pipe.forward_backward(inputs, labels)          # warm-up (allocator, autograd)
    pipe.zero_grad()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        pipe.forward_backward(inputs, labels)
        times.append(time.perf_counter() - t0)
        pipe.zero_grad()
    return statistics.median(times)


def timed_emulation_ms(em: TimedEmulation, plan, workers: int, microbatches: int,
                       steps: int) -> float:
    """One call of the stand-in on timed-emulated workers, in emulated ms."""
    torch.manual_seed(0)
    cfg = rotapipe.PipeConfig(workers=workers, microbatches=microbatches,
                              backend="emulated", emulation=em, check_races=False)
    with rotapipe.RoundPipe(em.stand_in(), lm_loss, config=cfg, plan=plan) as pipe:
        x, y = stride_batch(microbatches, 16, 32)
        return median_call_s(pipe, x, y, steps) / em.dilation * 1e3


def timing(args, backend: str, devices: int) -> None:
    config, M = qwen3_like(args.layers), args.microbatches
    print(f"\n(b) timing: Qwen3-like, {args.layers} layers, hidden 2048, vocab 32000, seq "
          f"{args.seq}, bf16, {M} microbatches of 1 sequence; median of {args.timing_steps} "
          "forward_backward calls after a warm-up")
    rows = []
    if backend == "cuda":
        import transformers
        from rotapipe.adapters import wrap_hf
        hw = measured_hardware(devices, args.efficiency)
        copy_engines()
        torch.manual_seed(0)
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
            **config, attn_implementation="sdpa"))
        wrapped = wrap_hf(model)
        cfg = rotapipe.PipeConfig(workers=devices, microbatches=M, backend="cuda",
                                  precision=rotapipe.PrecisionConfig(compute_dtype="bf16"))
        ids = torch.randint(0, config["vocab_size"], (M, args.seq))
        with wrapped.pipe(cfg) as pipe:
            before = pipe.host_seconds()
            real_ms = median_call_s(pipe, wrapped.inputs(ids), ids, args.timing_steps) * 1e3
            after = pipe.host_seconds()
            plan, schedule = pipe.plan, pipe.schedule()
            switch_intervals(pipe, wrapped.inputs(ids), ids, args)
            if args.trace:
                trace_call(pipe, wrapped.inputs(ids), ids, args.trace)
        rows.append(("real CUDA", real_ms))
        calls = args.timing_steps + 1                  # with the warm-up
        print("the caller's thread per real call, ms (RoundPipe.host_seconds, mean of "
              f"{calls}): " + ", ".join(f"{k} {(after[k] - before.get(k, 0)) * 1e3 / calls:.1f}"
                                        for k in after))
    else:
        if args.switch_interval_ms or args.trace:
            print("--switch-interval-ms, --trace: only with a real GPU (the real call), "
                  "ignored")
        hw = hardware(f"rtx4090x{devices}")
        em = TimedEmulation.of(config, hw, seq=args.seq)
        choice_pipe = rotapipe.PipeConfig(workers=devices, microbatches=M,
                                          backend="emulated", emulation=em)
        with rotapipe.RoundPipe(em.stand_in(), lm_loss, config=choice_pipe) as pipe:
            plan, schedule = pipe.plan, pipe.schedule()
        print(f"no real GPU on the emulated backend: timed emulation of {hw.name} against "
              "the simulator only")
    em = TimedEmulation.of(config, hw, seq=args.seq)
    if len(em.costs.layers) != plan.num_layers:
        print(f"skipped the simulator: the costs have {len(em.costs.layers)} layers, the "
              f"plan {plan.num_layers}")
        sim_ms = None
    else:
        sim_ms = simulate(schedule, ActionTimes(plan, em.costs)).makespan
        em = em.calibrated(plan, schedule, min_action_ms=args.min_action_ms)
        rows.append(("timed emulation",
                     timed_emulation_ms(em, plan, devices, M, args.timing_steps)))
        rows.append(("simulator", sim_ms))
    print(f"plan {plan.to_text()} on {devices} worker(s), hardware {hw.name}: "
          f"{hw.flops / 1e12:.0f} TFLOPS per layer, link {hw.device.pcie_gbps:.1f} GB/s; "
          f"timed emulation dilated {em.dilation:.0f}x\n")
    real = rows[0][1] if rows[0][0] == "real CUDA" else None
    print(f"{'what':16s} {'call ms':>9s} {'/ real':>8s} {'/ simulator':>12s}")
    for what, ms in rows:
        vs_real = f"{ms / real:8.3f}" if real else f"{'-':>8s}"
        vs_sim = f"{ms / sim_ms:12.3f}" if sim_ms else f"{'-':>12s}"
        print(f"{what:16s} {ms:9.1f} {vs_real} {vs_sim}")


def trace_call(pipe, inputs, labels, path: str) -> None:
    """One real call under torch.profiler (CPU and CUDA activities), exported as a
    Chrome trace to ``path`` and summarized (``benchmarks/cuda_trace.py``)."""
    from cuda_trace import load, summarize
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        pipe.forward_backward(inputs, labels)
        pipe.zero_grad()
    prof.export_chrome_trace(path)
    print(f"one real call traced to {path}:\n{summarize(load(path))}")


def switch_intervals(pipe, inputs, labels, args) -> None:
    """The real call under each interpreter switch interval of ``--switch-interval-ms``,
    on the same pipeline, the rounds interleaved. Threads that run C++ (the autograd
    engine's device thread freeing tensors Python has seen, saved-tensor hooks) need
    the GIL back from threads running Python (other dispatchers, the host lane); a
    thread that waits asks for it only after the switch interval (5 ms by default)."""
    if not args.switch_interval_ms:
        return
    default = sys.getswitchinterval()
    wanted = [float(v) for v in args.switch_interval_ms.split(",")]
    times: dict[float, list[float]] = {v: [] for v in wanted}
    try:
        for _ in range(3):
            for v in wanted:
                sys.setswitchinterval(v / 1e3)
                times[v].append(median_call_s(pipe, inputs, labels, args.timing_steps))
    finally:
        sys.setswitchinterval(default)
    print("real call by interpreter switch interval (sys.setswitchinterval; median of "
          f"{args.timing_steps} calls, best of 3 interleaved rounds): " +
          ", ".join(f"{v:g} ms: {min(ts) * 1e3:.1f} ms" for v, ts in times.items()))


# -- main ------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("cuda", "emulated"), default="cuda")
    ap.add_argument("--quick", action="store_true",
                    help="fewer workers and steps, shorter timing")
    ap.add_argument("--steps", type=int, default=None, help="training steps per case "
                    "(default 3, --quick 2)")
    ap.add_argument("--detail", action="store_true", help="print every case")
    ap.add_argument("--skip-exactness", action="store_true")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--layers", type=int, default=4, help="timing model: decoder layers")
    ap.add_argument("--seq", type=int, default=1024, help="timing model: sequence length")
    ap.add_argument("--microbatches", type=int, default=None,
                    help="timing: microbatches (default 4 per worker)")
    ap.add_argument("--timing-steps", type=int, default=None, help="default 5, --quick 3")
    ap.add_argument("--efficiency", type=float, default=0.8,
                    help="fraction of the measured bf16 matmul rate a layer reaches")
    ap.add_argument("--min-action-ms", type=float, default=20.0,
                    help="timed emulation: real ms of the shortest compute action")
    ap.add_argument("--switch-interval-ms", default="",
                    help="also time the real call under these interpreter switch "
                    "intervals, e.g. 5,0.5")
    ap.add_argument("--trace", default="", metavar="PATH",
                    help="also trace one real call with torch.profiler to PATH (Chrome "
                    "trace) and summarize where its time went")
    args = ap.parse_args(argv)
    args.steps = args.steps or (2 if args.quick else 3)
    args.timing_steps = args.timing_steps or (3 if args.quick else 5)
    if args.backend == "cuda":
        if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
            print("no CUDA GPU visible: torch.cuda.is_available() is False (torch "
                  f"{torch.__version__}, CUDA build {torch.version.cuda}); run with "
                  "--backend emulated to check the script itself", file=sys.stderr)
            return 2
        devices = torch.cuda.device_count()
        # fp32 exactness needs true fp32 matmuls: TF32 rounds inputs to 10-bit mantissas.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        print(f"{devices} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
              f"CUDA {torch.version.cuda}; TF32 off")
    else:
        devices = 2
        print(f"emulated CPU workers, torch {torch.__version__}")
    args.microbatches = args.microbatches or 4 * devices
    ok = True
    if not args.skip_exactness:
        ok = exactness(args, args.backend, devices)
    if not args.skip_timing:
        timing(args, args.backend, devices)
    print("\nexactness: " + ("skipped" if args.skip_exactness else
                             "all within tolerance" if ok else "FAILURES above"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
