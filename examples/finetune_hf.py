"""Fine-tune a Hugging Face causal LM with rotapipe: full fine-tuning and LoRA.

A tiny random Qwen3 (built from its config class, nothing downloaded) learns a
synthetic task (counting by a per-sequence step) on emulated CPU workers
(or all GPUs, with --backend auto). Batches carry padding (attention mask with zeros,
labels -100 there), as a data collator would build them. After training the model is
saved with save_pretrained and loaded back with plain transformers (full) or PEFT
(LoRA), and its logits are compared with the pipeline's.

    python examples/finetune_hf.py                 # both modes, ~30 s on 2 CPU cores
    python examples/finetune_hf.py --mode lora --steps 40
    python examples/finetune_hf.py --mode lora --optimizer-mode overlap

With ``--optimizer-mode overlap`` (exact) or ``stale`` the calls are pipelined: each
step's call returns with its loss while its backward drains, and with LoRA the next
call uploads the frozen base without waiting for the optimizer (only the adapters
wait: the ``UT`` actions counted at the end; docs/optimizer.md).
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import transformers

import rotapipe
import rotapipe.adapters


def tiny_qwen3(seed: int = 0) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    config = transformers.Qwen3Config(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=64, tie_word_embeddings=True, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, attn_implementation="sdpa")
    return transformers.Qwen3ForCausalLM(config)


def batch(n: int, t: int, g: torch.Generator):
    """Counting sequences (each token is the previous one plus a per-sequence step,
    modulo the vocabulary), right-padded to length ``t``."""
    start = torch.randint(0, 61, (n, 1), generator=g)
    step = torch.randint(1, 3, (n, 1), generator=g)
    ids = 3 + (start + step * torch.arange(t)) % 61
    lengths = torch.randint(t // 2, t + 1, (n,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).long()
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask, ids.masked_fill(mask == 0, -100)


def train(model, args, lr: float):
    """Train ``args.steps`` steps; return the wrapped model, the losses, and an
    evaluation batch with the pipeline's logits for it."""
    # verify="full": before training, the whole model's logits on a few tokens must
    # equal its own forward's (the tail is always checked; this also runs the blocks).
    wrapped = rotapipe.adapters.wrap_hf(model, verify="full")
    config = rotapipe.PipeConfig(workers=args.workers, microbatches=4, backend=args.backend,
                                 optimizer_mode=args.optimizer_mode)
    g = torch.Generator().manual_seed(1)
    losses = []
    with wrapped.pipe(config) as pipe:
        pipe.attach_optimizer(torch.optim.AdamW(pipe.parameters(), lr=lr, fused=True))
        print(f"  {len(wrapped.layers)} layers ({wrapped.parts['layers']} + embedding + "
              f"head), {sum(p.numel() for p in pipe.parameters()):,} trainable parameters")
        for step in range(args.steps):
            ids, mask, labels = batch(16, 24, g)
            if args.optimizer_mode == "sync":
                losses.append(pipe.forward_backward(wrapped.inputs(ids, mask), labels))
                pipe.step()
            else:       # pipelined: returns once the loss is known
                losses.append(pipe.train_step(wrapped.inputs(ids, mask), labels))
            if step % 15 == 0 or step == args.steps - 1:
                print(f"  step {step:3d}  loss {losses[-1]:.4f}")
        if args.optimizer_mode != "sync":
            pipe.flush()
            ran = pipe.last_timeline(calls=min(args.steps, 8)).schedule
            split = sum(a.kind is rotapipe.schedule.ActionKind.UPLOAD_TRAINED
                        for a in ran.actions)
            print(f"  last {min(args.steps, 8)} calls: {split} stage uploads split into a "
                  "frozen part (not waiting for the optimizer) and a trained part")
        ids, mask, _ = batch(4, 24, g)
        evaluated = (ids, mask, pipe(wrapped.inputs(ids, mask)))   # logits, no grad
    return wrapped, losses, evaluated


def check(loaded, evaluated) -> None:
    ids, mask, logits = evaluated
    with torch.no_grad():
        want = loaded(input_ids=ids, attention_mask=mask).logits
    diff = (logits - want).abs().max().item()
    print(f"  reloaded model's logits vs the pipeline's: max |diff| = {diff:.2e}")
    assert diff < 1e-4


def full(args) -> None:
    print("full fine-tuning")
    wrapped, losses, evaluated = train(tiny_qwen3(), args, lr=1e-2)
    with tempfile.TemporaryDirectory() as d:
        wrapped.save_pretrained(d)          # the trained weights, HF format
        check(transformers.AutoModelForCausalLM.from_pretrained(d), evaluated)
    assert losses[-1] < losses[0]


def lora(args) -> None:
    import peft
    print("LoRA (r=8 on attention and MLP projections) of a random base")
    with tempfile.TemporaryDirectory() as d:
        tiny_qwen3(seed=1).save_pretrained(f"{d}/base")
        base = rotapipe.adapters.load_hf(f"{d}/base")
        model = peft.get_peft_model(base, peft.LoraConfig(
            r=8, lora_alpha=16, lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                            "up_proj", "down_proj"]))
        # Only the adapter trains (fp32 masters); the base stays frozen in its dtype.
        # A random base's frozen embeddings and head limit how far LoRA gets here.
        wrapped, losses, evaluated = train(model, args, lr=3e-2)
        wrapped.save_pretrained(f"{d}/adapter")       # adapter_model.safetensors
        loaded = rotapipe.adapters.load_hf(f"{d}/base", adapter=f"{d}/adapter")
        check(loaded, evaluated)
    assert losses[-1] < losses[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=["full", "lora", "both"], default="both")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--backend", default="emulated", choices=["emulated", "auto", "cuda"])
    p.add_argument("--optimizer-mode", default="sync", choices=["sync", "overlap", "stale"])
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.mode in ("full", "both"):
        full(args)
    if args.mode in ("lora", "both"):
        lora(args)


if __name__ == "__main__":
    main()
