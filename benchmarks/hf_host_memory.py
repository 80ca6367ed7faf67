"""Host memory of Hugging Face models under rotapipe: loading from a local safetensors
directory, and LoRA fine-tuning with a frozen bf16 base.

A random Qwen3-architecture model (about 0.3B parameters by default) is saved in bf16
to a temporary directory. Each measurement runs in a fresh subprocess and reports
resident set sizes (RSS, from /proc) against the bytes the weights need:

- load: ``rotapipe.adapters.load_hf`` (``from_pretrained``, safetensors memory-mapped):
  RSS after loading and the peak during loading, over the process baseline.
- LoRA: load, add LoRA adapters (r=16, every linear of the blocks), wrap, build the
  pipeline (bf16 compute, 2 emulated workers), run 2 training steps; the RSS growth
  over the loaded model, with the frozen base's bytes (they must stay 1x bf16) and the
  adapter's (fp32 masters + bf16 copies + gradients + AdamW state).

    python benchmarks/hf_host_memory.py [--layers 12 --hidden 1024]
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile

from rss import run_child

# The children import the RSS sampler shared with planner_host_memory.py from here.
COMMON = f"import sys\nsys.path.insert(0, {str(pathlib.Path(__file__).parent)!r})\n" + r"""
import json, torch
from rss import Sampler, rss   # peak RSS over a block (ru_maxrss counts import peaks)
torch.set_num_threads(2)
import rotapipe, rotapipe.adapters
import transformers, peft
from transformers import AutoModelForCausalLM
def touch(model):   # fault in every weight page (memory-mapped weights load lazily)
    with torch.no_grad():
        return sum(float(p.sum()) for p in model.parameters())
"""

LOAD = COMMON + r"""
base = rss()
with Sampler() as s:
    model = rotapipe.adapters.load_hf({path!r}, dtype=torch.bfloat16)
after, load_peak = rss() - base, s.peak - base
touch(model)
n = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps(dict(weights=n, after=after, touched=rss() - base, peak=load_peak)))
"""

LORA = COMMON + r"""
model = rotapipe.adapters.load_hf({path!r}, dtype=torch.bfloat16)
targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32,
                                                   target_modules=targets))
touch(model)
base = rss()
frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
wrapped = rotapipe.adapters.wrap_hf(model)
cfg = rotapipe.PipeConfig(workers=2, microbatches=2, backend="emulated",
                          precision=rotapipe.PrecisionConfig("bf16"))
pipe = wrapped.pipe(cfg)
pipe.attach_optimizer(torch.optim.AdamW(pipe.parameters(), lr=1e-4))
built = rss() - base
ids = torch.randint(0, model.config.vocab_size, (4, 128))
for _ in range(2):
    pipe.forward_backward(wrapped.inputs(ids), ids)
    pipe.step()
lora = sum(p.numel() for p in pipe.parameters())
fp32_base = [p for p in model.parameters() if not p.requires_grad and p.dtype != torch.bfloat16]
print(json.dumps(dict(frozen=frozen, lora=lora, built=built, trained=rss() - base,
                      devices=sum(pipe.peak_memory()), frozen_not_bf16=len(fp32_base))))
pipe.close()
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    args = p.parse_args()
    import torch
    import transformers
    cfg = transformers.Qwen3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256), head_dim=64,
        tie_word_embeddings=False)
    mib = 2**20
    with tempfile.TemporaryDirectory() as d:
        torch.manual_seed(0)
        transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(d)
        load = run_child(LOAD.format(path=d))
        print(f"Qwen3-architecture model, {args.layers} layers, hidden {args.hidden}, "
              f"vocab {args.vocab}: {load['weights'] / mib:.0f} MiB of bf16 weights\n")
        print("load_hf (from_pretrained, safetensors memory-mapped):")
        print(f"  RSS after load   {load['after'] / mib:8.0f} MiB "
              f"({load['after'] / load['weights']:.2f}x the weights; pages fault in lazily)")
        print(f"  RSS, all touched {load['touched'] / mib:8.0f} MiB "
              f"({load['touched'] / load['weights']:.2f}x the weights)")
        print(f"  peak during load {load['peak'] / mib:8.0f} MiB "
              f"({load['peak'] / load['weights']:.2f}x the weights)\n")
        lora = run_child(LORA.format(path=d))
        adapter = lora["lora"] * (4 + 2 + 4 + 8)   # master, bf16 copy, grad, AdamW m+v
        print("LoRA r=16 on every block linear, bf16 compute, 2 steps:")
        print(f"  frozen base                 {lora['frozen'] / mib:8.0f} MiB bf16 "
              f"(frozen tensors not in bf16: {lora['frozen_not_bf16']})")
        print(f"  adapter parameters          {lora['lora'] / 1e6:8.2f} M "
              f"-> master+copy+grad+AdamW {adapter / mib:.0f} MiB")
        print(f"  RSS growth, pipeline built  {lora['built'] / mib:8.0f} MiB "
              f"(an fp32 copy of the base would add {2 * lora['frozen'] / mib:.0f} MiB)")
        print(f"  RSS growth after 2 steps    {lora['trained'] / mib:8.0f} MiB "
              f"(includes the emulated workers' memory: peaks sum to "
              f"{lora['devices'] / mib:.0f} MiB)")


if __name__ == "__main__":
    main()
