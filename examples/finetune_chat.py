"""Chat fine-tuning with the training job, the way a Hugging Face user's data looks.

Builds, on this machine and with nothing downloaded, a tiny "pretrained" model
directory: a random Qwen3 and a word-level tokenizer with a chat template (BOS from the
template, the assistant turn ending with the end-of-text token). Then fine-tunes it with
``rotapipe.train`` on chat records (``{"messages": [...]}``: the loss on the assistant
turns only, documents packed with per-document attention), evaluating on a separate file
(``eval_data``, ``holdout=0``), with the pretrained-model defaults for the learning rate,
warmup, weight decay and schedule length (two epochs), TensorBoard event files when the
``tensorboard`` package is installed, a sampled reply at the end and out/loss.png.

    python examples/finetune_chat.py                # about 20 s on 2 CPU cores
    python examples/finetune_chat.py --out runs/chat --epochs 3

The same run on the command line:
    rotapipe train --model DIR --data train.jsonl --eval-data eval.jsonl --holdout 0 \\
        --epochs 2 --lr 3e-3 --sample-prompt "red fox cat"
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import random
import tempfile

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from rotapipe.train import TrainConfig, train

WORDS = "cat dog fox red blue big small tree hill river sat ran jumped over under".split()
SPECIALS = ["<s>", "<|end|>", "<pad>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
            "<|end|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def model_dir(path: pathlib.Path) -> pathlib.Path:
    """A tiny random Qwen3 with a chat tokenizer, saved the way save_pretrained saves a
    downloaded model."""
    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", 0)])
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="<|end|>", pad_token="<pad>",
        unk_token="<unk>", additional_special_tokens=SPECIALS[4:])
    tokenizer.chat_template = TEMPLATE
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=256, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=1, pad_token_id=2)
    transformers.Qwen3ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def chats(path: pathlib.Path, n: int, seed: int) -> pathlib.Path:
    """Conversations whose assistant replies the user's words in reverse order."""
    rnd = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            words = [rnd.choice(WORDS) for _ in range(3)]
            f.write(json.dumps({"messages": [
                {"role": "system", "content": "reverse"},
                {"role": "user", "content": " ".join(words)},
                {"role": "assistant", "content": " ".join(reversed(words))}]}) + "\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="output directory (default: a temp dir)")
    ap.add_argument("--epochs", type=int, default=2)
    args = ap.parse_args()
    work = pathlib.Path(tempfile.mkdtemp(prefix="rotapipe-chat-"))
    out = pathlib.Path(args.out) if args.out else work / "run"
    model = model_dir(work / "tiny-chat")
    cfg = TrainConfig(
        model=str(model), data=str(chats(work / "train.jsonl", 1500, 0)),
        eval_data=str(chats(work / "eval.jsonl", 40, 1)), holdout=0.0,
        epochs=args.epochs, lr=3e-3,            # a random model: a higher lr than 2e-5
        seq=64, batch=16, microbatches=4, eval_interval=10, eval_sequences=8,
        sample_prompt="red fox cat", sample_tokens=8, workers=2, backend="emulated",
        report_to="tensorboard" if importlib.util.find_spec("tensorboard") else "none",
        out_dir=str(out), log_every=10)
    result = train(cfg)
    print(f"evaluation loss {result.eval_first:.3f} -> {result.eval_last:.3f} in "
          f"{result.step} steps; files in {out}: {sorted(p.name for p in out.iterdir())}")


if __name__ == "__main__":
    main()
