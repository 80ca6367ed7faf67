"""QLoRA with rotapipe: LoRA adapters on a frozen base kept in host memory as NF4.

A tiny random Qwen3 (no download) gets PEFT LoRA adapters; ``wrap_hf(quantize="nf4")``
turns every frozen weight matrix of its blocks into 4-bit NormalFloat (bitsandbytes),
which the workers upload packed and dequantize before each stage. The optimizer runs
in the lean host layout (``overlap`` without undo snapshots: each stage's gradients
are freed at its step). The loss falls, and the adapter saves in PEFT format.

    python examples/qlora.py
"""

import tempfile

import peft
import torch
import transformers

import rotapipe
import rotapipe.adapters

torch.manual_seed(0)
config = transformers.Qwen3Config(vocab_size=256, hidden_size=128, intermediate_size=384,
                                  num_hidden_layers=4, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=32,
                                  max_position_embeddings=64)
model = peft.get_peft_model(transformers.Qwen3ForCausalLM(config), peft.LoraConfig(
    r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                        "gate_proj", "up_proj", "down_proj"]))
wrapped = rotapipe.adapters.wrap_hf(model, quantize="nf4")

cfg = rotapipe.PipeConfig(workers=2, microbatches=2, backend="emulated",
                          optimizer_mode="overlap", undo_steps=False)
ids = torch.randint(3, 256, (8, 32))
with wrapped.pipe(cfg) as pipe:
    host = pipe.host
    packed = sum(q.nbytes for q in host.quantized.values())
    bf16 = sum(2 * q.shape.numel() for q in host.quantized.values())
    print(f"{len(host.quantized)} frozen weights as NF4: {packed / 1e6:.2f} MB in host "
          f"memory, {packed / bf16:.2f}x their bf16 bytes")
    pipe.attach_optimizer(torch.optim.AdamW(pipe.parameters(), lr=3e-3))
    losses = [pipe.train_step(wrapped.inputs(ids), ids) for _ in range(20)]
    pipe.flush()
print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
assert losses[-1] < losses[0]
with tempfile.TemporaryDirectory() as d:
    wrapped.save_pretrained(d)          # the adapter, in PEFT format
    print("saved adapter:", sorted(p for p in __import__("os").listdir(d)))
