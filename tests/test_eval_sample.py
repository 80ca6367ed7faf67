"""Samples of the training job (``rotapipe.train.sample``) against a plain decode of the
same Hugging Face model: greedy is the argmax token by token, whatever the model's own
``generation_config`` says, and sampling leaves every module's train/eval flag as it
was."""

from __future__ import annotations

import copy

import pytest
import torch

import rotapipe.adapters
from train_util import chat_tokenizer

transformers = pytest.importorskip("transformers")

from rotapipe.train import TrainConfig  # noqa: E402
from rotapipe.train.sample import generate_sample  # noqa: E402

NEW = 12


def _model(tokenizer, seed: int = 2):
    """A tiny random Qwen3 whose greedy decode of "cat dog" repeats tokens (seed 2)."""
    torch.manual_seed(seed)
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=256, tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id))


def _greedy(model, tokenizer, prompt: str) -> str:
    """Plain PyTorch: the argmax of the model's last logits, one token at a time."""
    ids = tokenizer(prompt, return_tensors="pt").input_ids     # "<s> cat dog"
    model.eval()
    with torch.no_grad():
        for _ in range(NEW):
            nxt = model(ids).logits[0, -1].argmax().view(1, 1)
            ids = torch.cat([ids, nxt], 1)
            if nxt.item() == tokenizer.eos_token_id:
                break
    return tokenizer.decode(ids[0], skip_special_tokens=True)


@pytest.mark.parametrize("setting", [{"repetition_penalty": 1.3},
                                     {"no_repeat_ngram_size": 1}, {"num_beams": 2}])
def test_greedy_sample_ignores_the_models_generation_config(setting):
    """A checkpoint's ``generation_config.json`` often sets a repetition penalty (or
    beams): ``generate()`` applied it to the "greedy" sample, which then differed from
    the argmax decode ("cat dog a under jumped reverse: ..." against "cat dog a a a
    ...") with repetition_penalty 1.3."""
    tok = chat_tokenizer()
    tok.chat_template = None
    ref = _model(tok)
    want = _greedy(ref, tok, "cat dog")
    assert want.split().count("a") > 2          # the decode repeats: a penalty shows
    model = _model(tok)
    for k, v in setting.items():
        setattr(model.generation_config, k, v)
    before = model.generation_config.to_dict()
    wrapped = rotapipe.adapters.wrap_hf(model)
    cfg = TrainConfig(sample_prompt="cat dog", sample_tokens=NEW)
    assert generate_sample(wrapped, tok, cfg) == want
    assert model.generation_config.to_dict() == before      # the model's own, given back


def test_sampling_gives_every_module_its_own_flag_back():
    """A model in train mode with one block frozen in eval mode (dropout off there)
    keeps it so: ``model.train(True)`` after the sample turned the block back on."""
    tok = chat_tokenizer()
    tok.chat_template = None
    model = _model(tok).train()
    model.model.layers[0].eval()
    wrapped = rotapipe.adapters.wrap_hf(model)
    flags = [m.training for m in model.modules()]
    generate_sample(wrapped, tok, TrainConfig(sample_prompt="cat dog", sample_tokens=3))
    assert [m.training for m in model.modules()] == flags


def test_a_prompt_filling_the_context_is_refused_by_name():
    """A prompt as long as the model's context (256 positions here) left no room for a
    new token: ``generate()`` failed with its own ``ValueError: max_new_tokens must be
    greater than 0`` at the end of the run (or mid-run, with ``sample_interval``).
    Now a ``ConfigError`` names the prompt, its length and the context, and
    :func:`check_prompts` says so before any work."""
    from rotapipe.errors import ConfigError
    from rotapipe.train.sample import check_prompts
    tok = chat_tokenizer()
    tok.chat_template = None
    model = _model(tok)
    wrapped = rotapipe.adapters.wrap_hf(model)
    long = " ".join(["cat"] * 255)                   # 256 tokens with <s>
    with pytest.raises(ConfigError, match="is 256 tokens, and the model's context holds "
                                          "256 .*Shorten the prompt"):
        generate_sample(wrapped, tok, TrainConfig(sample_prompt=long, sample_tokens=3))
    with pytest.raises(ConfigError, match="is 256 tokens"):
        check_prompts(["cat dog", long], tok, model.config)
    check_prompts(["cat dog", " ".join(["cat"] * 254)], tok, model.config)
    assert len(generate_sample(wrapped, tok, TrainConfig(
        sample_prompt=" ".join(["cat"] * 254), sample_tokens=3)).split()) == 255


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")
def test_qlora_sample_decodes_the_dequantized_base():
    """QLoRA keeps the frozen weights as NF4 and leaves a NaN placeholder in the model
    (``rotapipe.model.quant``): the sample, a forward of the model itself, decoded NaN
    logits ("cat dog" then token 0 over and over, hidden as a special token). It now
    equals the greedy decode of the model whose quantized weights are dequantized,
    and the model keeps its placeholders (the same tensors) afterwards."""
    peft = pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    from rotapipe.model.quant import quantized
    tok = chat_tokenizer()
    tok.chat_template = None
    model = peft.get_peft_model(_model(tok), peft.LoraConfig(
        r=4, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"],
        init_lora_weights=False))
    ref = copy.deepcopy(model)
    wrapped = rotapipe.adapters.wrap_hf(model, quantize="nf4")
    refs = dict(ref.named_parameters())
    held = {}
    for name, p in model.named_parameters():
        if quantized(p) is not None:
            refs[name].data = quantized(p).dequantize()
            held[name] = p.data_ptr()
    assert held
    got = generate_sample(wrapped, tok, TrainConfig(sample_prompt="cat dog",
                                                    sample_tokens=NEW))
    assert got == _greedy(ref, tok, "cat dog")
    assert len(got.split()) > 2
    assert {n: p.data_ptr() for n, p in model.named_parameters() if n in held} == held


def test_the_models_own_cache_setting_is_kept():
    """xLSTM's forward fails with a cache (its config says ``use_cache=False``): the
    sample keeps that setting of the model's ``generation_config`` (how the model
    runs) while dropping those that change the decode, and equals the argmax decode."""
    from hf_models import FAMILIES
    tok = chat_tokenizer()
    tok.chat_template = None
    torch.manual_seed(0)
    model = FAMILIES["xlstm"]()
    model.resize_token_embeddings(len(tok))
    model.generation_config.eos_token_id = tok.eos_token_id
    assert model.generation_config.use_cache is False
    want = _greedy(copy.deepcopy(model), tok, "cat dog")
    wrapped = rotapipe.adapters.wrap_hf(model)
    got = generate_sample(wrapped, tok, TrainConfig(sample_prompt="cat dog",
                                                    sample_tokens=NEW))
    assert got == want and len(got.split()) > 4
