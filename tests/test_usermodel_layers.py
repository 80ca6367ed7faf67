"""Users' own layers the workers run as copies, against plain PyTorch.

- A buffer a forward *replaces* (``self.ema = 0.9 * self.ema + ...``, not in place)
  carries from one microbatch to the next on the stage's worker, as in plain PyTorch
  (each microbatch used to start from the value the stage uploaded, so only the last
  microbatch's update survived the call).
- A gradient hook on a trained parameter (``register_hook``,
  ``register_post_accumulate_grad_hook``) never runs on the workers' copies: it is
  refused with the fix (at construction, or at the next call when added later), and
  the fix it names trains as the hook would.
- A layer ``copy.deepcopy`` cannot copy (the old ``torch.nn.utils.weight_norm``) is
  refused with a ``ConfigError`` naming it, before the pipeline converts any weight;
  so are a layer holding its own ``torch.Generator``, a trained parameter that is a
  view of another (neither can train as in plain PyTorch) and a lazy module not run
  yet.
- Attributes set and hooks registered after wrapping (``dropout.p = 0.5``, PEFT's
  ``disable_adapter()``) reach the workers' copies.
- Layers sharing one submodule, forward hooks, parametrizations, a layer running
  ``torch.utils.checkpoint`` itself, pytrees with ``None``, bool and integer parts:
  exact against plain PyTorch across workers, microbatches, grains and modes.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

import rotapipe
from rotapipe.runtime.trees import split
from models import emulated

RTOL, ATOL = 1e-5, 1e-6


def mse(out, y):
    return nn.functional.mse_loss(out, y)


def batches(n: int, width: int = 4, out: int = 3, rows: int = 12):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, width, generator=g), torch.randn(rows, out, generator=g))
            for _ in range(n)]


def reference_call(layers, x, y, microbatches: int, call: int) -> float:
    """Plain PyTorch: what one ``forward_backward`` promises (seeded per layer, each
    microbatch weighted by its share of the batch)."""
    total = 0.0
    for m, (xm, ym) in enumerate(zip(split(x, microbatches), split(y, microbatches))):
        h = xm
        for l, layer in enumerate(layers):
            torch.manual_seed(rotapipe.layer_seed(0, call, m, l))
            h = layer(h)
        loss = mse(h, ym)
        (loss * ym.shape[0] / y.shape[0]).backward()
        total += loss.item() * ym.shape[0] / y.shape[0]
    return total


def assert_trains_like_plain_pytorch(build, workers, microbatches, grain="stage",
                                     mode="sync", calls: int = 3) -> None:
    """Losses, gradients of every call and the state after every step (weights and
    buffers) equal plain PyTorch's on the same layers."""
    torch.manual_seed(0)
    mine = build()
    torch.manual_seed(0)
    ref = build()
    ours, theirs = nn.ModuleList(mine), nn.ModuleList(ref)
    ref_opt = torch.optim.SGD([p for p in theirs.parameters() if p.requires_grad],
                              lr=0.1, momentum=0.9)
    config = emulated(workers, microbatches, grain=grain, optimizer_mode=mode)
    with rotapipe.RoundPipe(mine, mse, config=config, optimizer=lambda ps: torch.optim.SGD(
            ps, lr=0.1, momentum=0.9)) as pipe:
        for call, (x, y) in enumerate(batches(calls)):
            loss = pipe.forward_backward(x, y)
            pipe.flush()
            want = reference_call(ref, x, y, microbatches, call)
            assert loss == pytest.approx(want, rel=RTOL, abs=ATOL), f"call {call}"
            for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
                assert (p.grad is None) == (q.grad is None), f"call {call} grad of {name}"
                if q.grad is not None:
                    torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL,
                                               msg=lambda m, n=name: f"grad {n}: {m}")
            pipe.step()
            ref_opt.step()
            ref_opt.zero_grad()
            got, want_state = ours.state_dict(), theirs.state_dict()
            assert got.keys() == want_state.keys()
            for k, v in want_state.items():
                torch.testing.assert_close(got[k], v, rtol=RTOL, atol=ATOL,
                                           msg=lambda m, k=k: f"call {call} {k}: {m}")


# -- a buffer replaced in forward ----------------------------------------------------------

class ReplacedEMA(nn.Module):
    """An EMA of its inputs and a step count, both buffers *replaced* in forward."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.register_buffer("ema", torch.zeros(dim))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        if self.training:
            self.ema = 0.9 * self.ema + 0.1 * x.detach().mean(0)
            self.seen = self.seen + x.shape[0]
        return torch.tanh(self.lin(x))


def ema_mlp() -> list[nn.Module]:
    # One in a forward stage, one in the fused tail.
    return [nn.Linear(4, 8), ReplacedEMA(), nn.Linear(8, 8), nn.Tanh(), ReplacedEMA(),
            nn.Linear(8, 3)]


@pytest.mark.parametrize("workers, microbatches, grain", [
    (1, 3, "stage"), (2, 2, "layer"), (3, 4, "stage"), (4, 3, "layer")])
def test_a_buffer_replaced_in_forward_carries_over_microbatches(workers, microbatches,
                                                                grain):
    """Before the fix the EMA after a call was 0.9 * ema + 0.1 * mean(last microbatch)
    (off by 0.027-0.12 after 3 calls) and ``seen`` counted the last microbatch only."""
    assert_trains_like_plain_pytorch(ema_mlp, workers, microbatches, grain)


# -- gradient hooks on parameters ------------------------------------------------------------

def mlp() -> list[nn.Module]:
    return [nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)]


@pytest.mark.parametrize("kind", ["register_hook", "register_post_accumulate_grad_hook"])
def test_a_gradient_hook_on_a_trained_parameter_is_refused(kind):
    """The hook never ran (the gradient was that of the unhooked weight: off by 0.02
    in the first call). Refused when the pipeline is built, or at the next call when
    added later, changing nothing."""
    torch.manual_seed(0)
    layers = mlp()
    hooks = {"register_hook": lambda g: g * 0.5,
             "register_post_accumulate_grad_hook": lambda p: None}
    handle = getattr(layers[2].weight, kind)(hooks[kind])
    with pytest.raises(rotapipe.ConfigError,
                       match=rf"parameter 2\.weight has a gradient hook \({kind}\):.*"
                             r"p\.grad\.mul_\(mask\) before pipe\.step\(\)"):
        rotapipe.RoundPipe(layers, mse, config=emulated(2, 2))
    handle.remove()
    (x, y), = batches(1)
    with rotapipe.RoundPipe(layers, mse, config=emulated(2, 2),
                            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1)) as pipe:
        pipe.train_step(x, y)
        before = {k: v.clone() for k, v in pipe.state_dict().items()}
        getattr(layers[4].bias, kind)(hooks[kind])
        with pytest.raises(rotapipe.InputError,
                           match=rf"parameter 4\.bias has a gradient hook \({kind}\) "
                                 "since the pipeline was built"):
            pipe.train_step(x, y)
        assert pipe.calls == 1 and all(p.grad is None for p in pipe.parameters())
        assert all(torch.equal(v, before[k]) for k, v in pipe.state_dict().items())


def test_the_fix_for_a_gradient_hook_trains_like_the_hook():
    """The refusal's fix: mask the gradient between forward_backward and step()."""
    torch.manual_seed(0)
    layers = mlp()
    torch.manual_seed(0)
    ref = mlp()
    mask = (torch.arange(64).reshape(8, 8) % 3 != 0).float()
    ref[2].weight.register_hook(lambda g: g * mask)
    ref_opt = torch.optim.AdamW(nn.ModuleList(ref).parameters(), lr=1e-2)
    with rotapipe.RoundPipe(layers, mse, config=emulated(3, 3),
                            optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2)) as pipe:
        for call, (x, y) in enumerate(batches(3)):
            pipe.forward_backward(x, y)
            layers[2].weight.grad.mul_(mask)
            pipe.step()
            reference_call(ref, x, y, 3, call)
            ref_opt.step()
            ref_opt.zero_grad()
    for p, q in zip(nn.ModuleList(layers).parameters(), nn.ModuleList(ref).parameters()):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)


# -- a layer that cannot be copied ---------------------------------------------------------

def test_a_layer_deepcopy_cannot_copy_is_refused_before_anything_changes():
    """The old ``weight_norm`` raised torch's RuntimeError from deep inside the
    constructor, after the frozen weights had been cast to the compute dtype."""
    torch.manual_seed(0)
    layers = mlp()
    layers[0].weight.requires_grad_(False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)     # deprecated: the point here
        nn.utils.weight_norm(layers[2])
    config = emulated(2, 2, precision=rotapipe.PrecisionConfig(compute_dtype="bf16"))
    with pytest.raises(rotapipe.ConfigError,
                       match=r"layer 2 \(Linear\) cannot be copied for the workers.*"
                             r"use torch\.nn\.utils\.parametrizations\.weight_norm"):
        rotapipe.RoundPipe(layers, mse, config=config)
    assert all(p.dtype == torch.float32 for p in nn.ModuleList(layers).parameters())


class OwnGenerator(nn.Linear):
    """Noise from a generator of its own: each worker's copy would hold its own
    generator, and the backward stage's recompute drew other noise than the forward
    (gradients off by 0.002-0.008 even on one worker)."""

    def __init__(self):
        super().__init__(8, 8)
        self.gen = torch.Generator().manual_seed(0)

    def forward(self, x):
        return torch.tanh(super().forward(x) + torch.rand(x.shape, generator=self.gen))


class Views(nn.Module):
    """``w2`` is a view of ``w``: plain PyTorch's step on one changes the other, the
    pipeline's separate masters did not (weights off by 0.002 after one step)."""

    def __init__(self, frozen: bool = False):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8), requires_grad=not frozen)
        self.w2 = nn.Parameter(self.w.data[:, 2:6])

    def forward(self, x):
        return torch.tanh(x @ self.w) + (x @ self.w2).repeat(1, 2)


@pytest.mark.parametrize("case", ["generator", "views", "frozen view", "lazy"])
def test_layers_the_copies_cannot_run_as_plain_pytorch_are_refused(case):
    """(A lazy module failed with torch's ValueError from inside the planner.)"""
    torch.manual_seed(0)
    layers = mlp()
    layers[2] = {"generator": OwnGenerator, "views": Views,
                 "frozen view": lambda: Views(frozen=True),
                 "lazy": lambda: nn.LazyLinear(8)}[case]()
    before = [p.detach().clone() for p in nn.ModuleList(layers).parameters()
              if not isinstance(p, nn.parameter.UninitializedParameter)]
    match = {"generator": r"layer 2 \(OwnGenerator\) holds a torch\.Generator \(gen\).*"
                          r"Draw from the default generator",
             "views": r"parameters 2\.w and 2\.w2 share memory.*nn\.Parameter\(t\.clone",
             "frozen view": r"parameters 2\.w and 2\.w2 share memory",
             "lazy": r"parameter 2\.weight is not initialized yet.*run the model once"}[case]
    with pytest.raises(rotapipe.ConfigError, match=match):
        rotapipe.RoundPipe(layers, mse, config=emulated(2, 2))
    after = [p for p in nn.ModuleList(layers).parameters()
             if not isinstance(p, nn.parameter.UninitializedParameter)]
    assert all(torch.equal(p, q) for p, q in zip(after, before))


def test_parameters_sharing_a_storage_without_overlapping_train_exactly():
    """Slices of one flat buffer (as a flattening optimizer makes them) overlap nowhere:
    allowed, and exact."""

    def build():
        layers = mlp()
        flat = torch.cat([p.detach().reshape(-1) for p in layers[2].parameters()])
        w, b = layers[2].weight, layers[2].bias
        layers[2].weight = nn.Parameter(flat[:w.numel()].view_as(w))
        layers[2].bias = nn.Parameter(flat[w.numel():].view_as(b))
        return layers
    assert_trains_like_plain_pytorch(build, 2, 2)


# -- layers plain PyTorch runs as they are ---------------------------------------------------

class Sym(nn.Module):
    def forward(self, w):
        return w.triu() + w.triu(1).transpose(-1, -2)


class OwnCheckpoint(nn.Module):
    """A layer that runs ``torch.utils.checkpoint`` itself."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(
            lambda t: self.b(torch.tanh(self.a(t))), x, use_reentrant=False)


class Parts(nn.Module):
    """Returns ``(h, None, bool mask, int positions)``; reads the same back."""

    def __init__(self, first: bool):
        super().__init__()
        self.first, self.lin = first, nn.Linear(8, 8)

    def forward(self, x):
        if not self.first:
            h, none, mask, pos = x
            assert none is None and mask.dtype == torch.bool and pos.dtype == torch.int64
            x = h * mask + pos[:, None] * 0.01
        h = torch.tanh(self.lin(x))
        return h, None, h > 0, torch.arange(h.shape[0])


class Head(nn.Linear):
    def forward(self, parts):
        return super().forward(parts[0])


def shared_and_hooked() -> list[nn.Module]:
    shared = nn.Linear(8, 8)                   # one submodule in layers 2 and 6
    layers = [nn.Linear(4, 8), nn.Tanh(), shared, nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
              shared, nn.Tanh(), nn.Linear(8, 3)]
    layers[4].register_forward_hook(lambda m, i, o: 2 * o)
    layers[8].register_forward_pre_hook(lambda m, i: (0.5 * i[0],))
    parametrize.register_parametrization(layers[4], "weight", Sym())
    nn.utils.parametrizations.weight_norm(layers[8])
    return layers


def own_checkpoint_and_parts() -> list[nn.Module]:
    return [nn.Linear(4, 8), OwnCheckpoint(), Parts(True), Parts(False), Parts(False),
            Head(8, 3)]


@pytest.mark.parametrize("build", [shared_and_hooked, own_checkpoint_and_parts])
@pytest.mark.parametrize("workers, microbatches, grain, mode", [
    (1, 1, "stage", "sync"), (2, 3, "layer", "overlap"), (4, 2, "stage", "overlap")])
def test_users_layers_train_like_plain_pytorch(build, workers, microbatches, grain, mode):
    assert_trains_like_plain_pytorch(build, workers, microbatches, grain, mode)


# -- attributes changed after wrapping --------------------------------------------------------

class Scaled(nn.Linear):
    """``tanh(scale * linear(x))`` with a plain float attribute ``scale``."""

    scale = 1.0

    def forward(self, x):
        return torch.tanh(self.scale * super().forward(x))


def dropout_mlp() -> list[nn.Module]:
    return [nn.Linear(4, 8), nn.Dropout(0.0), Scaled(8, 8), nn.Linear(8, 3)]


@pytest.mark.parametrize("workers, microbatches, grain", [(1, 2, "stage"), (3, 3, "layer")])
def test_attributes_and_hooks_changed_after_wrapping_are_followed(workers, microbatches,
                                                                  grain):
    """The workers' copies of the layers were taken once, when the pipeline was built:
    ``dropout.p = 0.5`` or a forward hook registered later was silently ignored (the
    loss of the next call was that of the unchanged model). Each call now takes what
    changed since the last."""
    torch.manual_seed(0)
    layers = dropout_mlp()
    torch.manual_seed(0)
    ref = dropout_mlp()
    changes = [lambda ls: None,
               lambda ls: setattr(ls[1], "p", 0.5),
               lambda ls: setattr(ls[2], "scale", 3.0),
               lambda ls: ls[3].register_forward_hook(lambda m, i, o: 2 * o)]
    data = batches(len(changes))
    with rotapipe.RoundPipe(layers, mse, config=emulated(workers, microbatches,
                                                         grain=grain)) as pipe:
        for call, ((x, y), change) in enumerate(zip(data, changes)):
            change(layers)
            change(ref)
            got = pipe.forward_backward(x, y)
            want = reference_call(ref, x, y, microbatches, call)
            assert got == pytest.approx(want, rel=RTOL), f"call {call}"
            for p, q in zip(nn.ModuleList(layers).parameters(),
                            nn.ModuleList(ref).parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL)
                q.grad = None
            pipe.zero_grad()
        handles = list(layers[3]._forward_hooks)
        layers[3]._forward_hooks.pop(handles[0])            # handle.remove(), in effect
        layers[2].scale = 1.0
        pipe.eval()                                         # dropout off: comparable
        with torch.no_grad():
            torch.testing.assert_close(pipe(data[0][0]), nn.Sequential(*layers)(data[0][0]),
                                       rtol=RTOL, atol=ATOL)


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")  # PEFT's
def test_a_peft_models_disabled_adapters_are_followed():
    """``with model.disable_adapter(): pipe(x)`` (a reference model's logits, as in
    DPO) gave the adapted model's logits (off by 0.75): PEFT switches its layers by
    attribute."""
    peft = pytest.importorskip("peft")
    from hf_models import batch, tiny
    model = peft.get_peft_model(tiny("qwen3"), peft.LoraConfig(
        r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    ids, mask, _ = batch()
    wrapped = rotapipe.adapters.wrap_hf(model)
    with wrapped.pipe(emulated(2, 2)) as pipe, torch.no_grad():
        for disabled in (False, True, False):
            with model.disable_adapter() if disabled else contextlib.nullcontext():
                got = pipe(wrapped.inputs(ids, mask))
                want = model(input_ids=ids, attention_mask=mask).logits
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
