"""LoRA with ``lora_dropout > 0`` in train mode: the masks are the ones a plain PEFT model
draws when each layer is seeded as the pipeline seeds it (``rotapipe.layer_seed``),
in the forward and in the backward stages' recompute, for the blocks' adapters and the
LM head's (which the chunked loss runs on a stream of its own)."""

from __future__ import annotations

import pytest
import torch

import rotapipe
import rotapipe.adapters
from hf_models import assert_grads_equal, batch, clone, tiny

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")


def seeded_peft_backward(model, ids, mask, labels, microbatches: int, seed: int = 0,
                         call: int = 0) -> float:
    """PEFT's own forward and backward, microbatch by microbatch, each piece drawing from
    the stream the pipeline gives it: the embedding layer 0, block ``i`` layer
    ``i + 1``, the final norm layer ``N + 1`` and the LM head (run by the loss) ``N + 2``;
    each microbatch's loss weighted by its share of the counted tokens."""
    base = model.get_base_model()
    n = len(base.model.layers)
    at = {"m": 0}

    def seeding(layer):
        def hook(module, args):
            torch.manual_seed(rotapipe.layer_seed(seed, call, at["m"], layer))
        return hook

    pieces = [(base.model.embed_tokens, 0), *((b, i + 1) for i, b in
                                              enumerate(base.model.layers)),
              (base.model.norm, n + 1), (base.lm_head, n + 2)]
    hooks = [module.register_forward_pre_hook(seeding(layer)) for module, layer in pieces]
    total = int((labels[..., 1:] != -100).sum())
    loss = 0.0
    try:
        for m, (i, k, y) in enumerate(zip(ids.tensor_split(microbatches),
                                          mask.tensor_split(microbatches),
                                          labels.tensor_split(microbatches))):
            at["m"] = m
            share = int((y[..., 1:] != -100).sum()) / total
            out = model(input_ids=i, attention_mask=k, labels=y)
            (out.loss * share).backward()
            loss += out.loss.item() * share
    finally:
        for h in hooks:
            h.remove()
    return loss


@pytest.mark.parametrize("workers,microbatches,grain", [(3, 4, "layer"), (2, 2, "stage")])
def test_lora_dropout_in_training_draws_the_reference_masks(workers, microbatches, grain):
    torch.manual_seed(0)
    model = peft.get_peft_model(tiny("llama"), peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.3, use_dora=grain == "stage",
        target_modules=["q_proj", "v_proj", "down_proj", "lm_head"],
        init_lora_weights=False))
    model.train()
    ids, mask, labels = batch()
    ref, m = clone(model), clone(model)
    want = seeded_peft_backward(ref, ids, mask, labels, microbatches)
    # The chunked loss draws the head's mask chunk by chunk (5 tokens), from one stream:
    # the same mask as PEFT's head drawing it over all tokens at once.
    wrapped = rotapipe.adapters.wrap_hf(m, loss_chunk_tokens=5)
    cfg = rotapipe.PipeConfig(workers=workers, microbatches=microbatches,
                              backend="emulated", grain=grain)
    with wrapped.pipe(cfg) as pipe:
        got = pipe.train().forward_backward(wrapped.inputs(ids, mask), labels)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert_grads_equal(m, ref)
    evaluated = clone(model).eval()
    with torch.no_grad():
        plain = evaluated(input_ids=ids, attention_mask=mask, labels=labels).loss.item()
    assert got != pytest.approx(plain, rel=1e-4)      # the masks matter
