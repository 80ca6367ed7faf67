"""Fine-tuning data the way Hugging Face users have it: chat records rendered with the
tokenizer's own chat template (loss on assistant turns only, BOS/EOS as the template
writes them), BOS for text when the tokenizer adds one, per-document attention when
packing (logits equal to each document run alone), padding, and the other file forms."""

from __future__ import annotations

import json

import pytest
import torch

from rotapipe.errors import ConfigError, InputError
from rotapipe.train.data import (IGNORE, PackedStream, TextFields, Tokens, TrainBatches,
                                 eval_set, iter_records, source_files)
from train_util import (CHAT_TEMPLATE, chat_jsonl, chat_tokenizer, sft_jsonl, text_jsonl,
                        tiny_model_dir)

transformers = pytest.importorskip("transformers")
FIELDS = TextFields()


def _tokens(tok, ids):
    return tok.convert_ids_to_tokens(ids)


def test_chat_record_counts_assistant_tokens_only():
    tok = chat_tokenizer()
    msgs = [{"role": "system", "content": "the fox"},
            {"role": "user", "content": "hi there"},
            {"role": "assistant", "content": "cat dog"},
            {"role": "user", "content": "more"},
            {"role": "assistant", "content": "red fox"}]
    ids, labels = Tokens(tok).record({"messages": msgs}, FIELDS, "x:1")
    # Token by token: BOS from the template, headers and user turns not counted; each
    # assistant turn's words and its end-of-text token (the template's turn end) counted.
    want = [("<s>", 0), ("<|system|>", 0), ("the", 0), ("fox", 0), ("<|end|>", 0),
            ("<|user|>", 0), ("hi", 0), ("there", 0), ("<|end|>", 0),
            ("<|assistant|>", 0), ("cat", 1), ("dog", 1), ("<|end|>", 1),
            ("<|user|>", 0), ("more", 0), ("<|end|>", 0),
            ("<|assistant|>", 0), ("red", 1), ("fox", 1), ("<|end|>", 1)]
    assert _tokens(tok, ids) == [t for t, _ in want]
    assert labels == [i if c else IGNORE for i, (_, c) in zip(ids, want)]
    # Exactly what the tokenizer's own template renders, nothing added.
    assert ids == tok.encode(tok.apply_chat_template(msgs, tokenize=False),
                             add_special_tokens=False)


@pytest.mark.parametrize("template", ["test", "default system prompt"])
def test_a_chat_opening_with_the_assistant_counts_its_text_not_the_header(template):
    """A chat whose first message is the assistant's had no rendered head (transformers
    renders no empty conversation), so the BOS, the assistant header and, with a
    template that adds a default system prompt (Qwen2.5's shape), that prompt were all
    trained on as the assistant's reply. Now only the reply and its turn end count."""
    tok = chat_tokenizer()
    if template != "test":
        tok.chat_template = ("{{ bos_token }}{% if messages[0]['role'] != 'system' %}"
                             "<|system|>\nthe big fox<|end|>\n{% endif %}" + CHAT_TEMPLATE[15:])
    msgs = [{"role": "assistant", "content": "cat dog"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "red fox"}]
    ids, labels = Tokens(tok).record({"messages": msgs}, FIELDS, "x:1")
    assert ids == tok.encode(tok.apply_chat_template(msgs, tokenize=False),
                             add_special_tokens=False)
    counted = [t for t, label in zip(_tokens(tok, ids), labels) if label != IGNORE]
    assert counted == ["cat", "dog", "<|end|>", "red", "fox", "<|end|>"]
    assert all(label == i for i, label in zip(ids, labels) if label != IGNORE)


def test_text_and_pairs_get_bos_when_the_tokenizer_adds_it():
    tok = chat_tokenizer()
    ids, labels = Tokens(tok).record({"text": "cat dog"}, FIELDS, "x:1")
    assert _tokens(tok, ids) == ["<s>", "cat", "dog", "<|end|>"]
    assert labels == [IGNORE] + ids[1:]                  # BOS is not a target
    ids, labels = Tokens(tok).record({"prompt": "reverse: cat", "completion": "dog"},
                                     FIELDS, "x:1")
    assert _tokens(tok, ids) == ["<s>", "reverse:", "cat", "dog", "<|end|>"]
    assert labels == [IGNORE] * 3 + ids[3:]
    # A tokenizer that adds no BOS (Qwen-like) gets none.
    tok.bos_token = None
    assert _tokens(tok, Tokens(tok).record({"text": "cat"}, FIELDS, "x:1")[0]) == \
        ["cat", "<|end|>"]


def test_chat_errors_name_the_record():
    tok = chat_tokenizer()
    t = Tokens(tok)
    with pytest.raises(InputError, match=r"x:3: no 'assistant' message"):
        t.record({"messages": [{"role": "user", "content": "hi"}]}, FIELDS, "x:3")
    with pytest.raises(InputError, match=r"x:4: messages\[0\]\['content'\] is missing"):
        t.record({"messages": [{"role": "user"}]}, FIELDS, "x:4")
    with pytest.raises(InputError, match=r"x:6: messages\[1\]\['content'\] is null: each "
                                         r"message is an object with a string \"role\""):
        t.record({"messages": [{"role": "user", "content": "hi"},
                               {"role": "assistant", "content": None}]}, FIELDS, "x:6")
    with pytest.raises(InputError, match=r"x:7: messages\[0\]\['role'\] is an int \(1\)"):
        t.record({"messages": [{"role": 1, "content": "hi"}]}, FIELDS, "x:7")
    with pytest.raises(InputError, match=r"x:8: 'messages' is an empty list: a chat needs its "
                                         r"messages, at least one of them the assistant's"):
        t.record({"messages": []}, FIELDS, "x:8")
    tok.chat_template = None
    with pytest.raises(ConfigError, match="has none"):
        t.record({"messages": [{"role": "assistant", "content": "a"}]}, FIELDS, "x:5")


def test_documents_packing_restarts_positions(tmp_path):
    tok = chat_tokenizer()
    data = text_jsonl(tmp_path / "t.jsonl", 40)
    s = PackedStream([data], tok, seq=64, seed=0, holdout=0.0, fields=FIELDS,
                     packing="documents")
    ids, labels, pos, mask = s.next_row()
    assert mask is None and len(pos) == 64
    starts = [i for i, p in enumerate(pos) if p == 0]
    assert starts[0] == 0 and len(starts) >= 2
    for a, b in zip(starts, starts[1:] + [64]):
        assert pos[a:b] == list(range(b - a))
        assert ids[a] == tok.bos_token_id            # every document starts with BOS
    # The next sequence continues the cut document with positions from 0.
    ids2, _, pos2, _ = s.next_row()
    assert pos2[0] == 0 and ids2[0] != tok.bos_token_id


def _pipe(model_dir, **kw):
    from rotapipe import PipeConfig
    from rotapipe.adapters import wrap_hf
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    wrapped = wrap_hf(model)
    return model, wrapped.pipe(PipeConfig(workers=2, microbatches=2, backend="emulated",
                                          **kw))


@pytest.mark.parametrize("packing", ["documents", "pad"])
def test_each_document_attends_only_to_itself(tmp_path, packing):
    """Logits of a packed (or padded) batch through the pipeline equal the model's own
    forward on each document alone, fp32."""
    tok = chat_tokenizer()
    model_dir = tiny_model_dir(tmp_path / "m", tok)
    data = chat_jsonl(tmp_path / "c.jsonl", 30)
    batches = TrainBatches([data], tok, batch=4, seq=48, seed=0, holdout=0.0,
                           fields=FIELDS, packing=packing)
    batch = batches.next()
    model, pipe = _pipe(model_dir)
    try:
        pipe.eval()
        logits = pipe(batch.inputs())                              # [4, 48, vocab]
    finally:
        pipe.close()
    checked = 0
    for r in range(4):
        if packing == "documents":
            pos = batch.position_ids[r].tolist()
            starts = [i for i, p in enumerate(pos) if p == 0] + [len(pos)]
            docs = list(zip(starts, starts[1:]))
        else:
            n = int(batch.attention_mask[r].sum())
            docs = [(0, n)]
        assert len(docs) >= (2 if packing == "documents" else 1)
        for a, b in docs:
            alone = model(batch.ids[r:r + 1, a:b]).logits[0]       # the document by itself
            torch.testing.assert_close(logits[r, a:b], alone, rtol=1e-5, atol=1e-5)
            checked += b - a
    # Packed across documents (no position ids), the later documents' logits differ.
    if packing == "documents":
        model2, pipe2 = _pipe(model_dir)
        try:
            pipe2.eval()
            mixed = pipe2({"input_ids": batch.ids})
        finally:
            pipe2.close()
        assert not torch.allclose(mixed, logits, atol=1e-4)
    assert checked >= 4 * (40 if packing == "documents" else 10)


def test_documents_packing_does_not_predict_a_document_from_the_one_before(tmp_path):
    """With a tokenizer that adds no BOS (Qwen), a packed document's first token was a
    target, predicted from the end of the document before it, which it does not attend
    to: 63 counted tokens where the two documents alone have 62 (loss 3.58187 against
    their 3.58368). Now the labels are transformers' DataCollatorWithFlattening's, and
    the loss of a packed row is the documents' own, each run alone, fp32."""
    import torch.nn.functional as F
    tok = chat_tokenizer()
    tok.bos_token = None                                  # Qwen-like: no BOS
    model_dir = tiny_model_dir(tmp_path / "m", tok)
    data = text_jsonl(tmp_path / "t.jsonl", 40)
    batch = TrainBatches([data], tok, batch=2, seq=64, seed=0, holdout=0.0,
                         fields=FIELDS, packing="documents").next()
    flatten = transformers.DataCollatorWithFlattening()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for r in range(2):
        pos = batch.position_ids[r].tolist()
        starts = [i for i, p in enumerate(pos) if p == 0] + [len(pos)]
        docs = [batch.ids[r, a:b].tolist() for a, b in zip(starts, starts[1:])]
        assert len(docs) >= 2
        want = flatten([{"input_ids": d} for d in docs])
        assert torch.equal(batch.labels[r], want["labels"][0])
        with torch.no_grad():
            logits = model(input_ids=batch.ids[r:r + 1], position_ids=batch.position_ids[r:r + 1],
                           use_cache=False).logits[0]
            packed = F.cross_entropy(logits[:-1], batch.labels[r, 1:], ignore_index=IGNORE,
                                     reduction="sum")
            alone = sum(F.cross_entropy(model(input_ids=torch.tensor([d])).logits[0, :-1],
                                        torch.tensor(d[1:]), reduction="sum") for d in docs)
        assert (batch.labels[r, 1:] != IGNORE).sum() == sum(len(d) - 1 for d in docs)
        torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-6)


def test_short_heldout_split_is_one_padded_sequence(tmp_path):
    tok = chat_tokenizer()
    data = sft_jsonl(tmp_path / "s.jsonl", 3)
    # n=4: one held-out lane (4 sequences a lane), so the 3 records share it.
    b = eval_set([data], tok, 4, seq=256, holdout=1.0, fields=FIELDS, packing="documents")
    assert b.ids.shape == (1, 256)
    real = (b.labels[0] != IGNORE).sum().item()
    assert 0 < real < 60 and (b.labels[0, -10:] == IGNORE).all()


def test_json_parquet_and_saved_dataset_give_the_same_records(tmp_path):
    rows = [json.loads(line) for line in sft_jsonl(tmp_path / "s.jsonl", 30)
            .read_text().splitlines()]
    (tmp_path / "s.json").write_text(json.dumps(rows))
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "s.parquet")
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    want = list(iter_records(tmp_path / "s.jsonl"))
    for name in ("s.json", "s.parquet", "ds"):
        (src,) = source_files(str(tmp_path / name))
        assert list(iter_records(src)) == want, name
        assert list(iter_records(src, 7)) == want[7:], name
    with pytest.raises(InputError, match="is a list of records"):
        (tmp_path / "bad.json").write_text('{"text": "a"}')
        list(iter_records(tmp_path / "bad.json"))


def test_template_that_rewrites_history_gives_one_document_per_turn(tmp_path):
    """Qwen3's template drops the thinking block of earlier assistant turns once later
    turns follow: such a chat becomes one document per assistant turn, its history as
    the template renders it when that turn is generated, only that turn counted."""
    tok = chat_tokenizer(words=list(train_words()) + ["<think>", "</think>"])
    tok.chat_template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n"
        "{% if m['role'] == 'assistant' and loop.last %}<think> </think> {% endif %}"
        "{{ m['content'] }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    msgs = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "cat dog"},
            {"role": "user", "content": "more"}, {"role": "assistant", "content": "red fox"}]
    docs = Tokens(tok).documents({"messages": msgs}, FIELDS, "x:1")
    want = [
        [("<s>", 0), ("<|user|>", 0), ("hi", 0), ("there", 0), ("<|end|>", 0),
         ("<|assistant|>", 0), ("<think>", 1), ("</think>", 1), ("cat", 1), ("dog", 1),
         ("<|end|>", 1)],
        [("<s>", 0), ("<|user|>", 0), ("hi", 0), ("there", 0), ("<|end|>", 0),
         ("<|assistant|>", 0), ("cat", 0), ("dog", 0), ("<|end|>", 0),
         ("<|user|>", 0), ("more", 0), ("<|end|>", 0),
         ("<|assistant|>", 0), ("<think>", 1), ("</think>", 1), ("red", 1), ("fox", 1),
         ("<|end|>", 1)]]
    assert len(docs) == 2
    for (ids, labels), w in zip(docs, want):
        assert _tokens(tok, ids) == [t for t, _ in w]
        assert labels == [i if c else IGNORE for i, (_, c) in zip(ids, w)]
    # Packed, each turn's document has its own positions; padded, each is its own row
    # (the second waits in the cursor, which a checkpoint keeps).
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"messages": msgs}) + "\n")
    s = PackedStream([path], tok, seq=40, seed=0, holdout=0.0, fields=FIELDS,
                     packing="documents")
    ids, _, pos, _ = s.next_row()
    assert pos[:29] == list(range(11)) + list(range(18))
    s = PackedStream([path], tok, seq=24, seed=0, holdout=0.0, fields=FIELDS, packing="pad")
    first = s.next_row()
    state = s.state_dict()
    again = PackedStream([path], tok, seq=24, seed=0, holdout=0.0, fields=FIELDS,
                         packing="pad")
    again.load_state_dict(state)
    second = again.next_row()
    assert sum(first[3]) == 11 and sum(second[3]) == 18
    assert second[0][:18] == docs[1][0]


def train_words():
    from train_util import WORDS
    return WORDS


def test_a_template_failing_on_a_late_record_fails_before_training(tmp_path):
    """Every chat record is rendered before step 0: a template that refuses record 2,900
    of 3,000 stops the run there, naming file:line, with no step taken."""
    from rotapipe.train import TrainConfig, train
    from train_util import CHAT_TEMPLATE
    tok = chat_tokenizer()
    tok.chat_template = ("{% for m in messages %}{% if m['content'] == 'boom' %}"
                         "{{ raise_exception('no booms') }}{% endif %}{% endfor %}"
                         + CHAT_TEMPLATE)
    model = tiny_model_dir(tmp_path / "model", tok)
    data = chat_jsonl(tmp_path / "c.jsonl", 3000)
    lines = data.read_text().splitlines()
    bad = {"messages": [{"role": "user", "content": "boom"},
                        {"role": "assistant", "content": "fox"}]}
    lines[2899] = json.dumps(bad)
    data.write_text("\n".join(lines) + "\n")
    out = tmp_path / "o"
    said = []
    with pytest.raises(InputError, match=r"c\.jsonl:2900: the chat template fails on this "
                                         r"conversation \(TemplateError: no booms\)"):
        train(TrainConfig(model=str(model), data=str(data), seq=48, batch=4, microbatches=2,
                          workers=2, backend="emulated", progress=False, steps=50,
                          holdout=0.0, out_dir=str(out)), echo=said.append)
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()
    assert not any(s.startswith(("model:", "step")) for s in said), said


SHAREGPT = [{"from": "system", "value": "the fox"}, {"from": "human", "value": "hi there"},
            {"from": "gpt", "value": "cat dog"}, {"from": "human", "value": "more"},
            {"from": "gpt", "value": "red fox"}]
"""ShareGPT's chat: ``from``/``value``, roles ``human``/``gpt``/``system``."""
ROLES = {"human": "user", "gpt": "assistant", "system": "system"}


@pytest.mark.parametrize("record", [
    {"conversations": SHAREGPT},
    {"messages": SHAREGPT},
    {"messages": [{"role": m["from"], "content": m["value"]} for m in SHAREGPT]},
], ids=["conversations", "from-value-in-messages", "human-gpt-roles"])
def test_sharegpt_chats_train_as_the_same_messages(record):
    """ShareGPT's records (``conversations`` of ``from``/``value`` with ``human``/``gpt``
    roles, or those names inside ``messages``) were refused with "no 'assistant'
    message"; they read as role/content chats, token for token the same."""
    tok = chat_tokenizer()
    want = Tokens(tok).record({"messages": [
        {"role": ROLES[m["from"]], "content": m["value"]} for m in SHAREGPT]}, FIELDS, "x:1")
    assert Tokens(tok).record(record, FIELDS, "x:1") == want
    assert sum(label != IGNORE for label in want[1]) == 6        # two turns + their ends


def test_a_sharegpt_file_passes_the_checks_and_packs_as_messages(tmp_path):
    """A ShareGPT JSONL file goes through the data checks, the template check and the
    packed stream as the same chats written as messages do."""
    from rotapipe.train.loop import check_data
    from rotapipe.train.tokens import check_chats
    tok = chat_tokenizer()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    plain = chat_jsonl(tmp_path / "a" / "c.jsonl", 20)
    share = tmp_path / "b" / "c.jsonl"           # the same name: the lanes hash the name
    back = {v: k for k, v in ROLES.items()}
    share.write_text("".join(
        json.dumps({"conversations": [{"from": back[m["role"]], "value": m["content"]}
                                      for m in json.loads(line)["messages"]]}) + "\n"
        for line in plain.read_text().splitlines()))
    assert check_data([share], FIELDS).records == 20
    assert check_chats([share], tok, FIELDS) == 20

    def rows(path):
        s = PackedStream([path], tok, seq=24, seed=0, holdout=0, fields=FIELDS)
        return [s.next_sequence() for _ in range(5)]
    assert rows(share) == rows(plain)


def test_a_chat_without_an_assistant_names_the_roles_found():
    tok = chat_tokenizer()
    with pytest.raises(InputError) as info:
        Tokens(tok).record({"messages": [{"role": "user", "content": "hi"},
                                         {"role": "bot", "content": "cat"}]}, FIELDS, "x:2")
    msg = str(info.value)
    assert msg.startswith("x:2: no 'assistant' message (the roles are 'user', 'bot'): "), msg
    assert "the roles are 'system', 'user' and 'assistant' (ShareGPT's 'human' and 'gpt' " \
           "are read as 'user' and 'assistant')" in msg
