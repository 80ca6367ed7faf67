"""fp32 exactness: rotapipe against the same model trained in plain PyTorch.

Every case trains a fresh tiny transformer (blocks of uneven MLP widths) for three
steps with rotapipe on emulated workers and, from the same initial weights, on the
same data with the same optimizer, in plain PyTorch (``models.reference_forward_backward``
draws the same per-(call, microbatch, layer) random streams and weights each
microbatch by its share of the batch). Compared element by element:

- the gradients after the first step's ``forward_backward`` calls (before the optimizer),
- the full ``state_dict`` (weights and BatchNorm buffers) after the first call and after
  the third step, and the loss of every step,

within rtol 1e-5 / atol 1e-6. On top of that, the worker count and the plan must not
change a single bit, nor must the recompute grain: every run is compared bitwise with
the one-worker, stage-grain run of the default plan (except a plan that puts both uses of the tied weight in one stage, where
autograd, not the host, sums them: a different, equally exact, summation order).

AdamW gets eps=1e-3 (see ``OPTIMIZERS``); SGD with momentum runs a part of the matrix.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import rotapipe
from models import (VOCAB, emulated, lm_loss, reference_forward_backward, tiny_transformer,
                    token_batch)

RTOL, ATOL = 1e-5, 1e-6
STEPS = 3

OPTIMIZERS = {
    # eps=1e-3, not 1e-8: the key biases of attention get gradients that are zero up to
    # rounding (softmax ignores a shift shared by all keys). Adam with a tiny eps turns
    # that ~1e-9 noise into full-size updates, so two correct programs that sum the tied
    # embedding's two gradients in a different order (1 ulp apart) drift apart by 1e-3.
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, eps=1e-3),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
}

FEATURES = {
    # name: (tiny_transformer kwargs, samples of each forward_backward call of a step)
    "dropout": (dict(dropout=0.1), (8,)),
    "tied": (dict(tied=True), (8,)),
    "buffers": (dict(buffers=True), (8,)),
    # Two calls of different sizes before each step, with all of the above at once.
    "accumulate": (dict(dropout=0.1, tied=True, buffers=True), (8, 12)),
    # The same with weights of 80-160 KiB, so copies go beyond small-tensor paths.
    "large": (dict(dim=128, widths=(160, 320, 64, 256), dropout=0.1, tied=True,
                   buffers=True), (8, 12)),
}
MATRIX_FEATURES = ["dropout", "tied", "buffers", "accumulate"]


@dataclass(frozen=True)
class Trained:
    losses: tuple[float, ...]          # mean loss over each step's samples
    grads: dict[str, torch.Tensor]     # after the first step's calls, before the optimizer
    first_state: dict[str, torch.Tensor]   # state_dict after the very first call
    state: dict[str, torch.Tensor]     # state_dict after the last step


def step_batches(sizes: tuple[int, ...], steps: int = STEPS):
    """``steps`` lists of (inputs, labels), one per call, 6 tokens per sample."""
    return [[token_batch(n, 6, seed=100 * s + c) for c, n in enumerate(sizes)]
            for s in range(steps)]


def _snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    """Gradients by name; parameters no loss depends on (grad None) are left out."""
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def train_pipe(model: nn.Module, sizes, config: rotapipe.PipeConfig, optimizer: str,
               loss_fn=lm_loss, plan=None, data=None, setup=None) -> Trained:
    """``setup(pipe)``, if given, runs once before training (e.g. ``use_schedule``)."""
    data = data or step_batches(sizes)
    losses, grads, first = [], None, None
    with rotapipe.RoundPipe(model, loss_fn, config=config, plan=plan,
                            optimizer=OPTIMIZERS[optimizer]) as pipe:
        if setup is not None:
            setup(pipe)
        for calls in data:
            total = sum(y.shape[0] for _, y in calls)
            loss = 0.0
            for x, y in calls:
                loss += pipe.forward_backward(x, y) * y.shape[0] / total
                first = first or _snapshot(model)
            grads = grads or _grads(model)
            assert pipe.step()
            losses.append(loss)
        return Trained(tuple(losses), grads, first, pipe.state_dict())


def train_reference(model: nn.Module, sizes, microbatches: int, optimizer: str,
                    loss_fn=lm_loss, forward_backward=reference_forward_backward,
                    data=None, clip: float | None = None) -> Trained:
    """Plain PyTorch; call ``c`` (counted over all steps) uses random streams of call c.
    ``clip``: ``clip_grad_norm_`` to that norm before each step (``grads`` are before)."""
    data = data or step_batches(sizes)
    opt = OPTIMIZERS[optimizer](model.parameters())
    losses, grads, first, call = [], None, None, 0
    for calls in data:
        total = sum(y.shape[0] for _, y in calls)
        loss = 0.0
        for x, y in calls:
            share = y.shape[0] / total

            def scaled(out, labels, share=share):
                return loss_fn(out, labels) * share

            loss += forward_backward(model, x, y, microbatches, call, loss_fn=scaled)
            first = first or _snapshot(model)
            call += 1
        grads = grads or _grads(model)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss)
    return Trained(tuple(losses), grads, first, _snapshot(model))


# Memoised: many cases compare with the same reference and the same one-worker run.
# Results are never mutated.
@functools.lru_cache(maxsize=None)
def reference(feature: str, microbatches: int, optimizer: str = "adamw") -> Trained:
    kw, sizes = FEATURES[feature]
    return train_reference(tiny_transformer(**kw), sizes, microbatches, optimizer)


@functools.lru_cache(maxsize=None)
def run(feature: str, workers: int, microbatches: int, grain: str,
        optimizer: str = "adamw", plan_text: str | None = None, **config) -> Trained:
    kw, sizes = FEATURES[feature]
    model = tiny_transformer(**kw)
    plan = rotapipe.Plan.from_text(plan_text) if plan_text else None
    return train_pipe(model, sizes, emulated(workers, microbatches, grain=grain, **config),
                      optimizer, plan=plan)


def assert_close_trained(got: Trained, want: Trained) -> None:
    torch.testing.assert_close(got.losses, want.losses, rtol=RTOL, atol=ATOL)
    for what in ("grads", "first_state", "state"):
        g, w = getattr(got, what), getattr(want, what)
        assert g.keys() == w.keys(), what
        for k in w:
            torch.testing.assert_close(g[k], w[k], rtol=RTOL, atol=ATOL,
                                       msg=lambda m, k=k, what=what: f"{what} {k}: {m}")


def assert_bitwise_equal(got: Trained, want: Trained) -> None:
    assert got.losses == want.losses
    for what in ("grads", "first_state", "state"):
        g, w = getattr(got, what), getattr(want, what)
        differ = [k for k in w if not torch.equal(g[k], w[k])]
        assert not differ, f"{what} differ bitwise in {differ}"


def assert_same_state(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    assert not differ, f"state differs in {differ}"


# -- the matrix ---------------------------------------------------------------------------

@pytest.mark.parametrize("feature", MATRIX_FEATURES)
@pytest.mark.parametrize("grain", ["stage", "layer"])
@pytest.mark.parametrize("microbatches", [1, 3, 8])
@pytest.mark.parametrize("workers", [1, 2, 3, 4])
def test_matches_plain_pytorch(workers, microbatches, grain, feature):
    got = run(feature, workers, microbatches, grain)
    assert_close_trained(got, reference(feature, microbatches))
    # Random streams belong to (call, microbatch, layer) and gradients are summed in
    # schedule order, so the worker count (and with it the plan) and the recompute
    # grain change no bit.
    assert_bitwise_equal(got, run(feature, 1, microbatches, "stage"))
    if FEATURES[feature][0].get("buffers"):
        # Once per microbatch forward, as plain PyTorch: recompute must not count.
        calls = len(FEATURES[feature][1])
        assert got.first_state["3.bn.num_batches_tracked"].item() == microbatches
        assert got.state["3.bn.num_batches_tracked"].item() == STEPS * calls * microbatches


def test_dropout_changes_the_result():
    """Guard against a vacuous dropout matrix: the masks must matter."""
    plain = train_reference(tiny_transformer(), (8,), 3, "adamw")
    dropped = run("dropout", 2, 3, "stage")
    assert not torch.allclose(dropped.grads["1.up.weight"], plain.grads["1.up.weight"],
                              rtol=1e-2, atol=1e-4)


@pytest.mark.parametrize("grain", ["stage", "layer"])
@pytest.mark.parametrize("workers", [1, 2, 3, 4])
def test_sgd_with_momentum(workers, grain):
    got = run("accumulate", workers, 3, grain, optimizer="sgd")
    assert_close_trained(got, reference("accumulate", 3, optimizer="sgd"))


@pytest.mark.parametrize("grain", ["stage", "layer"])
@pytest.mark.parametrize("workers", [1, 2, 4])
def test_larger_tensors(workers, grain):
    got = run("large", workers, 3, grain)
    assert_close_trained(got, reference("large", 3))
    assert_bitwise_equal(got, run("large", 1, 3, "stage"))


PLANS = {
    # name: (workers, microbatches, PipeConfig plan fields or explicit plan text)
    "tail-of-2": (2, 3, dict(tail_layers=2)),
    "one-forward-stage": (3, 8, dict(forward_stages=1, backward_stages=2)),
    "multi-layer-backward": (4, 3, dict(forward_stages=3, backward_stages=2)),
    "single-layer-backward": (2, 8, dict(forward_stages=2, backward_stages=6)),
    # The BatchNorm layer (layer 3) sits in the fused tail.
    "tail-holds-buffers": (3, 3, dict(tail_layers=4, forward_stages=2, backward_stages=3)),
    # One stage holds both uses of the tied weight: autograd sums them per microbatch
    # instead of per stage, which is a different (equally exact) summation order.
    "tail-is-everything": (2, 3, dict(tail_layers=7)),
    "explicit-uneven": (4, 8, "F0[0:1] F1[1:5] T[5:7] B0[0:3] B1[3:4] B2[4:5]"),
}


@pytest.mark.parametrize("grain", ["stage", "layer"])
@pytest.mark.parametrize("plan", list(PLANS))
def test_plans(plan, grain):
    workers, microbatches, spec = PLANS[plan]
    if isinstance(spec, str):
        got = run("accumulate", workers, microbatches, grain, plan_text=spec)
    else:
        got = run("accumulate", workers, microbatches, grain, **spec)
    assert_close_trained(got, reference("accumulate", microbatches))
    if plan != "tail-is-everything":
        assert_bitwise_equal(got, run("accumulate", 1, microbatches, "stage"))


# -- single features in more detail ------------------------------------------------------

@pytest.mark.parametrize("workers", [1, 4])
def test_tied_weight_has_one_master(workers):
    model = tiny_transformer(tied=True)
    emb = model[0].emb.weight
    with rotapipe.RoundPipe(model, lm_loss, config=emulated(workers, 3),
                            optimizer=OPTIMIZERS["adamw"]) as pipe:
        params = list(pipe.parameters())
        assert sum(p is emb for p in params) == 1
        assert len({id(p) for p in params}) == len(params) == len(list(model.parameters()))
        names = [n for n, _ in pipe.named_parameters()]
        assert len(names) == len(set(names))
        pipe.forward_backward(*token_batch(8, 6))
        pipe.step()
        assert model[-1].tied.weight is emb
        state = pipe.state_dict()
        torch.testing.assert_close(state["0.emb.weight"], state[f"{len(model) - 1}.tied.weight"],
                                   rtol=0, atol=0)


@pytest.mark.parametrize("microbatches", [1, 3, 8])
@pytest.mark.parametrize("grain", ["stage", "layer"])
@pytest.mark.parametrize("workers", [1, 2, 3, 4])
def test_accumulation_equals_one_big_batch(workers, grain, microbatches):
    """Without dropout or batch statistics, two calls of 8 and 12 samples before a step
    give the gradients (and weights) of one plain-PyTorch pass over all 20 samples."""
    data = step_batches((8, 12))

    def whole_batch(model, x, y, microbatches, call, loss_fn):
        loss = loss_fn(model(x), y)
        loss.backward()
        return loss.item()

    joined = [[(torch.cat([x for x, _ in calls]), torch.cat([y for _, y in calls]))]
              for calls in data]
    want = train_reference(tiny_transformer(tied=True), None, 1, "adamw",
                           forward_backward=whole_batch, data=joined)
    got = train_pipe(tiny_transformer(tied=True), None,
                     emulated(workers, microbatches, grain=grain), "adamw", data=data)
    torch.testing.assert_close(got.losses, want.losses, rtol=RTOL, atol=ATOL)
    for k in want.grads:
        torch.testing.assert_close(got.grads[k], want.grads[k], rtol=RTOL, atol=ATOL)
    for k in want.state:
        torch.testing.assert_close(got.state[k], want.state[k], rtol=RTOL, atol=ATOL)


def test_zero_grad_drops_accumulated_gradients():
    x, y = token_batch(8, 6)
    fresh = tiny_transformer()
    with rotapipe.RoundPipe(fresh, lm_loss, config=emulated(2, 3)) as pipe:
        pipe.forward_backward(x, y)
        want = _grads(fresh)
    model = tiny_transformer()
    with rotapipe.RoundPipe(model, lm_loss, config=emulated(2, 3)) as pipe:
        pipe.forward_backward(*token_batch(12, 6, seed=7))
        pipe.zero_grad()
        assert all(p.grad is None for p in model.parameters())
        pipe.forward_backward(x, y)
        got = _grads(model)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=RTOL, atol=ATOL)


# -- evaluation ------------------------------------------------------------------------

@pytest.mark.parametrize("microbatches", [1, 3, 8])
@pytest.mark.parametrize("workers", [1, 2, 3, 4])
def test_eval_matches_plain_model(workers, microbatches):
    """After a training step, ``pipe(x)`` in eval mode equals the plain model's output
    (dropout off, BatchNorm on its running statistics), and changes no buffer."""
    model = tiny_transformer(dropout=0.1, tied=True, buffers=True)
    x = token_batch(10, 6, seed=5)[0]
    with rotapipe.RoundPipe(model, lm_loss, config=emulated(workers, microbatches),
                            optimizer=OPTIMIZERS["adamw"]) as pipe:
        pipe.forward_backward(*token_batch(8, 6))
        pipe.step()
        pipe.eval()
        before = _snapshot(model)
        got = pipe(x)
        with torch.no_grad():
            want = model(x)
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
        assert_same_state(_snapshot(model), before)


def _seeded_forward(model, x, microbatches: int, call: int):
    outs = []
    with torch.no_grad():
        for m, xm in enumerate(x.tensor_split(microbatches)):
            for l, layer in enumerate(model):
                torch.manual_seed(rotapipe.layer_seed(0, call, m, l))
                xm = layer(xm)
            outs.append(xm)
    return torch.cat(outs)


def test_eval_in_train_mode_has_its_own_streams():
    """``pipe(x)`` with layers in train mode draws evaluation streams (call -1, -2, ...
    of ``layer_seed``), keeps no BatchNorm update and never shifts training's streams:
    a training call after two evaluations is still call 1."""
    model = tiny_transformer(dropout=0.1, buffers=True)
    ref = copy.deepcopy(model)
    x = token_batch(9, 6, seed=5)[0]
    batches = [token_batch(8, 6, seed=s) for s in (0, 1)]
    with rotapipe.RoundPipe(model, lm_loss, config=emulated(3, 3)) as pipe:
        pipe.forward_backward(*batches[0])
        reference_forward_backward(ref, *batches[0], 3, call=0)
        before = _snapshot(model)
        evals = [pipe(x), pipe(x)]
        assert_same_state(_snapshot(model), before)
        assert pipe.calls == 1
        pipe.forward_backward(*batches[1])
    for k, got in enumerate(evals):
        want = _seeded_forward(copy.deepcopy(ref), x, 3, call=-1 - k)
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    reference_forward_backward(ref, *batches[1], 3, call=1)
    # Accumulated over both calls: the reference summed two batch means, rotapipe
    # keeps the mean over all 16 samples.
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad / 2, rtol=RTOL, atol=ATOL, msg=name)
    want = _snapshot(ref)
    for k, v in _snapshot(model).items():
        torch.testing.assert_close(v, want[k], rtol=RTOL, atol=ATOL, msg=k)


# -- pytree activations ------------------------------------------------------------------
# Layers pass (hidden, aux) where aux is a dict holding a float tensor that carries
# gradient, an integer tensor, a float tensor without gradient and a Python int.

class TreeEmbed(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.gate = nn.Linear(dim, 1)

    def forward(self, inputs):
        ids = inputs["ids"]
        h = self.emb(ids) * inputs["scale"]                     # (b, t, dim)
        pos = torch.arange(ids.shape[1], dtype=h.dtype).expand(ids.shape)  # (b, t)
        return h, {"gate": torch.sigmoid(self.gate(h)), "ids": ids, "pos": pos, "depth": 0}


class TreeBlock(nn.Module):
    def __init__(self, dim: int, hidden: int, regate: bool):
        super().__init__()
        self.regate = regate
        self.mlp = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, hidden), nn.GELU(),
                                 nn.Linear(hidden, dim))
        self.mix = nn.Linear(dim, 1)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        h, aux = x
        assert aux["ids"].dtype == torch.long and not aux["ids"].requires_grad
        h = h + self.drop(self.mlp(h)) * aux["gate"]
        gate = aux["gate"] * torch.sigmoid(self.mix(h)) if self.regate else aux["gate"]
        return h, {**aux, "gate": gate, "depth": aux["depth"] + 1}


class TreeHead(nn.Module):
    def __init__(self, dim: int, depth: int):
        super().__init__()
        self.depth = depth
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, VOCAB)

    def forward(self, x):
        h, aux = x
        assert aux["depth"] == self.depth
        logits = self.out(self.norm(h)) + aux["gate"] + 0.01 * aux["pos"].unsqueeze(-1)
        return {"logits": logits, "gate": aux["gate"]}


def tree_model() -> nn.Sequential:
    torch.manual_seed(3)
    widths = (24, 40, 8, 32)
    blocks = [TreeBlock(16, w, regate=i % 2 == 0) for i, w in enumerate(widths)]
    return nn.Sequential(TreeEmbed(16), *blocks, TreeHead(16, len(widths)))


def tree_loss(out, labels):
    return lm_loss(out["logits"], labels) + out["gate"].mean()


def tree_batches():
    data = []
    for s in range(STEPS):
        ids, labels = token_batch(8, 6, seed=s)
        scale = torch.linspace(0.5, 1.5, 8).reshape(8, 1, 1)
        data.append([({"ids": ids, "scale": scale}, labels)])
    return data


def tree_reference_forward_backward(model, inputs, labels, microbatches, call, loss_fn):
    total = 0.0
    parts = {k: v.tensor_split(microbatches) for k, v in inputs.items()}
    for m, y in enumerate(labels.tensor_split(microbatches)):
        h = {k: v[m] for k, v in parts.items()}
        for l, layer in enumerate(model):
            torch.manual_seed(rotapipe.layer_seed(0, call, m, l))
            h = layer(h)
        loss = loss_fn(h, y) * (y.shape[0] / labels.shape[0])
        loss.backward()
        total += loss.item()
    return total


@pytest.mark.parametrize("tail", [1, 2])
@pytest.mark.parametrize("grain", ["stage", "layer"])
@pytest.mark.parametrize("workers", [1, 3])
def test_pytree_activations(workers, grain, tail):
    data = tree_batches()
    want = train_reference(tree_model(), None, 3, "adamw", loss_fn=tree_loss,
                           forward_backward=tree_reference_forward_backward, data=data)
    got = train_pipe(tree_model(), None, emulated(workers, 3, grain=grain, tail_layers=tail),
                     "adamw", loss_fn=tree_loss, data=data)
    assert_close_trained(got, want)


def test_loss_weight_gives_the_token_mean_over_the_whole_batch():
    """With ``loss_weight`` counting non-ignored tokens, the gradient is that of the mean
    over every non-ignored token of the batch (Hugging Face loss semantics), not the
    mean of per-microbatch means."""
    def token_loss(logits, labels):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 labels.reshape(-1), ignore_index=-100)

    x, y = token_batch(8, 6)
    y = y.clone()
    y[:3, 2:] = -100          # uneven: microbatch 0 has far fewer counted tokens
    model, ref = tiny_transformer(), tiny_transformer()
    with rotapipe.RoundPipe(model, token_loss, config=emulated(2, 4),
                            loss_weight=lambda lab: int((lab != -100).sum())) as pipe:
        loss = pipe.forward_backward(x, y)
    want = token_loss(ref(x), y)
    want.backward()
    assert loss == pytest.approx(want.item(), rel=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_tail_context_gives_whole_batch_statistics_and_an_unweighted_extra_term():
    """``tail_context`` sees every microbatch's tail input; a loss returning
    ``(mean_loss, extra)`` adds ``extra`` unweighted. Here extra = 0.1 * (the batch-wide
    mean of the tail input) * (this microbatch's sum of it), summed over microbatches:
    a term no per-microbatch loss could compute, checked against plain PyTorch."""
    x, y = token_batch(8, 6)
    M = 4

    def context(xs, ys):
        return torch.cat([t.reshape(-1) for t in xs]).mean().detach()

    def loss3(out, labels, batch_mean):
        return lm_loss(out, labels), 0.1 * batch_mean * out.sum() / 1000.0

    model, ref = tiny_transformer(), tiny_transformer()
    with rotapipe.RoundPipe(model, loss3, config=emulated(3, M),
                            tail_context=context) as pipe:
        last = pipe.plan.forward[-1].name   # the stage that downloads the tail's input
        assert f"DA:{last}:m{M - 1}@5" in pipe.schedule().by_key()["FT:T:m0"].host_deps
        loss = pipe.forward_backward(x, y)
    # plain PyTorch: whole-batch statistic of the head's input, then the same sum
    hidden = ref[:-1](x)
    batch_mean = hidden.detach().mean()
    logits = ref[-1](hidden)
    want = lm_loss(logits, y) + 0.1 * batch_mean * logits.sum() / 1000.0
    want.backward()
    assert loss == pytest.approx(want.item(), rel=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
