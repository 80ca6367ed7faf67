"""Check that rotapipe trains a Hugging Face architecture exactly: the way to trust a
family rotapipe's tests do not name.

Three checks, from cheap to thorough:

1. ``wrap_hf(model, verify="full")``: the adapter's layers, run one after another on a
   few padded tokens, give the model's own logits (the wrap-time tail check runs too);
2. one ``forward_backward`` on emulated CPU workers (2 workers, 2 microbatches, padding
   in the batch) gives the model's own loss;
3. every gradient equals the one from the model's own ``loss.backward()``.

    python examples/verify_hf.py --model-type olmo       # a tiny random model
    python examples/verify_hf.py --path ./my-model       # a local model (fp32 advised)

A family that cannot be trained exactly is refused at step 1 with the reason.
"""

from __future__ import annotations

import argparse
import copy

import torch
import transformers

import rotapipe
import rotapipe.adapters

TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            attn_implementation="eager")


def build(args) -> transformers.PreTrainedModel:
    if args.path:
        return transformers.AutoModelForCausalLM.from_pretrained(args.path,
                                                                 dtype=torch.float32)
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(args.model_type, **TINY)
    return transformers.AutoModelForCausalLM.from_config(config)


def padded_batch(vocab: int, n: int = 4, t: int = 8):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (n, t), generator=g)
    mask = torch.ones(n, t, dtype=torch.long)
    mask[0, :3] = 0                     # left padding
    mask[-1, t - 2:] = 0                # right padding
    return ids, mask, ids.masked_fill(mask == 0, -100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model-type", help="a transformers model_type, built tiny and random")
    src.add_argument("--path", help="a local Hugging Face model directory")
    p.add_argument("--no-grads", action="store_true", help="skip the gradient check")
    args = p.parse_args()
    torch.set_num_threads(1)
    model = build(args).eval()          # eval: no dropout, so both sides compute alike
    ref = copy.deepcopy(model)

    try:
        wrapped = rotapipe.adapters.wrap_hf(model, verify="full")
    except rotapipe.adapters.AdapterError as exc:
        raise SystemExit(f"refused: {exc}") from None
    print(f"{type(model).__name__}: pieces {wrapped.parts}")
    print("1. whole-model logits equal the model's own (verify='full')")

    ids, mask, labels = padded_batch(model.config.get_text_config().vocab_size)
    out = ref(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    config = rotapipe.PipeConfig(workers=2, microbatches=2, backend="emulated")
    with wrapped.pipe(config) as pipe:
        loss = pipe.forward_backward(wrapped.inputs(ids, mask), labels)
    print(f"2. loss: pipeline {loss:.6f}, model {out.loss.item():.6f}")
    want = out.loss.item()
    assert abs(loss - want) <= 1e-6 + 1e-5 * abs(want), (loss, want)
    if args.no_grads:
        return
    theirs = dict(ref.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        if theirs[name].grad is None:
            assert p.grad is None or not p.grad.any(), name
            continue
        torch.testing.assert_close(p.grad, theirs[name].grad, rtol=1e-5, atol=1e-6,
                                   msg=name)
        worst = max(worst, (p.grad - theirs[name].grad).abs().max().item())
    print(f"3. every gradient equal (max |diff| {worst:.2e})")


if __name__ == "__main__":
    main()
