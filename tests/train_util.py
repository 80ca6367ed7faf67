"""Tiny corpora, tiny configs and a subprocess runner shared by the training-job tests."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import random
import signal
import socket
import subprocess
import sys

WORDS = ("the a cat dog sat ran on under mat tree big small red blue and then "
         "quickly slowly jumped over fox river hill").split()

# A 2-layer Qwen3 of width 32 on 32-token sequences: a step takes milliseconds.
TINY = dict(layers=2, dim=32, heads=2, vocab=300, tokenizer_bytes=100_000, seq=32, batch=4,
            microbatches=2, eval_sequences=4, holdout=0.15, warmup=2, lr=1e-2,
            workers=2, backend="emulated", progress=False, sample_tokens=0, log_every=1000)


def text_jsonl(path: pathlib.Path, n: int = 240, seed: int = 0) -> pathlib.Path:
    """``n`` lines of ``{"text": ...}`` made of simple repeated sentence patterns."""
    rnd = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            words = [rnd.choice(WORDS) for _ in range(rnd.randint(20, 40))]
            f.write(json.dumps({"text": " ".join(words) + "."}) + "\n")
    return path


def sft_jsonl(path: pathlib.Path, n: int = 400, seed: int = 0) -> pathlib.Path:
    """Prompt/response pairs where the response is a fixed function of the prompt
    (the prompt's words reversed), so the response loss can fall."""
    rnd = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            words = [rnd.choice(WORDS) for _ in range(4)]
            f.write(json.dumps({"prompt": "reverse: " + " ".join(words) + " =>",
                                "response": " " + " ".join(reversed(words))}) + "\n")
    return path


def flags(**settings) -> list[str]:
    """``rotapipe train`` flags for ``TINY`` updated with ``settings``."""
    out = []
    for k, v in {**TINY, **settings}.items():
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            out.append(flag if v else "--no-" + k.replace("_", "-"))
        else:
            out += [flag, str(v)]
    return out


def env() -> dict:
    # One intra-op thread in every process, so runs compare bit for bit.
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1"}


def popen(args: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rotapipe", "train", *args], env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rotapipe", "train", *args], env=env(),
                          capture_output=True, text=True, timeout=timeout)


def run_here(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    """``rotapipe train ARGS`` in this process (``rotapipe.cli.main``), as :func:`run`
    reports it: exit code, stdout, stderr; a run still going after ``timeout`` seconds
    fails the test (:func:`deadline`), as :func:`run`'s does. One intra-op thread while
    it runs, as in :func:`env`'s processes, so its results compare with theirs bit for
    bit. For runs that need no process of their own (no signal, no environment read at
    import): each saves an interpreter start (about 6 s of imports)."""
    import io
    import torch
    from rotapipe.cli import main
    out, err = io.StringIO(), io.StringIO()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with deadline(timeout), contextlib.redirect_stdout(out), \
                contextlib.redirect_stderr(err):
            rc = main(["train", *args])
    finally:
        torch.set_num_threads(threads)
    return subprocess.CompletedProcess(args, rc, out.getvalue(), err.getvalue())


@contextlib.contextmanager
def deadline(seconds: float):
    """Fail with TimeoutError if the block still runs after ``seconds`` (a hang fails
    the test instead of the run; main thread only)."""
    def expired(signum, frame):
        raise TimeoutError(f"still running after {seconds:g} s")
    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)



# -- a tiny pretrained-model directory with a chat tokenizer -------------------------------
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n"
                 "{{ m['content'] }}<|end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
"""Llama-3-like in shape: BOS from the template, a role header, the turn ends with the
end-of-text token."""
SPECIALS = ["<s>", "<|end|>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>"]


def chat_tokenizer(words=WORDS):
    """A word-level tokenizer (whitespace split, so tokens are predictable) that adds
    ``<s>`` to plain text itself, with ``<|end|>`` as end-of-text and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + ["<unk>"] + sorted(set(words) | {
        "reverse:", "=>", "hi", "there", "more"}))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|end|>",
                                   pad_token="<pad>", unk_token="<unk>",
                                   additional_special_tokens=SPECIALS[3:])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_model_dir(path: pathlib.Path, tokenizer=None, seed: int = 0, layers: int = 2,
                   dim: int = 32) -> pathlib.Path:
    """A randomly initialised tiny Qwen3 and ``tokenizer`` saved as a model directory."""
    import torch
    import transformers

    tokenizer = tokenizer or chat_tokenizer()
    torch.manual_seed(seed)
    config = transformers.Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=dim, intermediate_size=2 * dim,
        num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2,
        head_dim=dim // 2, max_position_embeddings=256, tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    transformers.Qwen3ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def chat_jsonl(path: pathlib.Path, n: int = 200, seed: int = 0) -> pathlib.Path:
    """Chats whose assistant turns reverse the user's words (two turns each)."""
    rnd = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            msgs = []
            for _ in range(2):
                words = [rnd.choice(WORDS) for _ in range(3)]
                msgs += [{"role": "user", "content": " ".join(words)},
                         {"role": "assistant", "content": " ".join(reversed(words))}]
            f.write(json.dumps({"messages": msgs}) + "\n")
    return path


def free_port() -> int:
    """A free TCP port on loopback (for a gloo rendezvous or torchrun)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
