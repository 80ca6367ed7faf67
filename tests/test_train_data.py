"""Training data: packing, prompt masking, held-out split, deterministic order, cursor."""

from __future__ import annotations

import pytest
import torch

from rotapipe.errors import ConfigError, InputError
from rotapipe.train.data import (IGNORE, PackedStream, TextFields, TrainBatches, eval_batch,
                                 source_files, stdlib_files, train_tokenizer)
from train_util import sft_jsonl, text_jsonl

FIELDS = TextFields()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    text_jsonl(d / "a.jsonl", 120, seed=1)
    text_jsonl(d / "b.jsonl", 120, seed=2)
    (d / "notes.txt").write_text("plain text file\n" * 50)
    sft = sft_jsonl(d / "sft.jsonl.data", 50)          # not picked up by the directory
    tok = train_tokenizer(source_files(str(d)), 300, 50_000, FIELDS, 0.15)
    return d, sft, tok


def batches(d, tok, seed=0, n=5, **kw):
    b = TrainBatches(source_files(str(d)), tok, batch=4, seq=16, seed=seed, holdout=0.15,
                     fields=FIELDS, **kw)
    return [b.next_batch() for _ in range(n)], b


def test_directory_and_stdlib_files(corpus):
    d, _, _ = corpus
    # A directory is read as its most common kind of file (records here), as
    # datasets.load_dataset reads it; notes.txt is named in a warning, and read when
    # listed.
    assert [p.name for p in source_files(str(d))] == ["a.jsonl", "b.jsonl"]
    assert [p.name for p in source_files(f"{d},{d / 'notes.txt'}")] == \
        ["a.jsonl", "b.jsonl", "notes.txt"]
    assert len(stdlib_files()) > 100 and all(p.suffix == ".py" for p in stdlib_files()[:50])


def test_packing_shapes_and_same_order_from_same_seed(corpus):
    d, _, tok = corpus
    a, _ = batches(d, tok, seed=3)
    b, _ = batches(d, tok, seed=3)
    c, _ = batches(d, tok, seed=4)
    assert all(x.shape == (4, 16) and torch.equal(x, y) for (x, _), (y, _) in zip(a, b))
    assert not all(torch.equal(x, y) for (x, _), (y, _) in zip(a, c))
    assert (a[0][0] == tok.eos_token_id).any() or any((x == tok.eos_token_id).any()
                                                     for x, _ in a)


def test_cursor_resumes_exactly(corpus):
    d, _, tok = corpus
    want, _ = batches(d, tok, n=12)
    _, first = batches(d, tok, n=7)
    state = first.state_dict()
    again = TrainBatches(source_files(str(d)), tok, batch=4, seq=16, seed=0, holdout=0.15,
                         fields=FIELDS)
    again.load_state_dict(state)
    for ids, labels in want[7:]:
        got = again.next_batch()
        assert torch.equal(got[0], ids) and torch.equal(got[1], labels)


def test_epochs_advance_and_heldout_is_disjoint(corpus):
    d, _, tok = corpus
    _, b = batches(d, tok, n=1000)
    assert b.epoch >= 1
    files = source_files(str(d))
    counts = []
    for _ in range(2):
        held = PackedStream(files, tok, seq=16, seed=0, holdout=0.15, fields=FIELDS,
                            heldout=True)
        n = 0
        while held.next_sequence() is not None and n < 5000:
            n += 1
        counts.append(n)
    # One pass, then the stream ends: the same finite count each time (how many depends
    # on the path-hashed split of the temporary files, about 150-210 here).
    assert 0 < counts[0] == counts[1] < 1000
    ids, _ = eval_batch(files, tok, 8, seq=16, holdout=0.15, fields=FIELDS)
    again, _ = eval_batch(files, tok, 8, seq=16, holdout=0.15, fields=FIELDS, seed=9)
    assert ids.shape == (8, 16)
    assert torch.equal(ids, again)                 # the split does not depend on the seed


def test_prompt_is_masked(corpus, tmp_path):
    _, sft, tok = corpus
    path = tmp_path / "sft.jsonl"
    path.write_text(sft.read_text())
    s = PackedStream([path], tok, seq=64, seed=0, holdout=0.01, fields=FIELDS)
    ids, labels = s.next_sequence()
    masked = [i for i, l in zip(ids, labels) if l == IGNORE]
    counted = [l for l in labels if l != IGNORE]
    assert masked and counted
    assert "reverse:" in tok.decode(masked) and "reverse" not in tok.decode(counted)
    assert all(l == i for i, l in zip(ids, labels) if l != IGNORE)


def test_bad_line_and_missing_fields_name_the_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"text": "ok"}\n{"text": \n')
    from rotapipe.train.loop import check_data
    with pytest.raises(InputError, match=r"bad.jsonl:2: not valid JSON"):
        check_data([p], FIELDS)
    p.write_text('{"body": "x"}\n')
    with pytest.raises(InputError, match=r"bad.jsonl:1: .*'text' field"):
        check_data([p], FIELDS)
    with pytest.raises(ConfigError, match="does not exist"):
        source_files(str(tmp_path / "nope.txt"))


def test_a_json_file_of_json_lines_reads_as_jsonl(tmp_path):
    """JSON Lines saved as ``.json`` (datasets' json loader reads both forms) was
    refused as "d.json:2: not valid JSON (Extra data)", though every line is valid."""
    from rotapipe.train.loop import check_data
    from rotapipe.train.records import iter_records
    lines = sft_jsonl(tmp_path / "d.jsonl", 30).read_text()
    (tmp_path / "d.json").write_text(lines.replace("\n", "\n\n", 3))   # blank lines too
    (src,) = source_files(str(tmp_path / "d.json"))
    jsonl = [rec for _, rec in iter_records(tmp_path / "d.jsonl")]
    assert [rec for _, rec in iter_records(src)] == jsonl
    assert [rec for _, rec in iter_records(src, 12)] == jsonl[9:]    # indexes are lines
    assert check_data([src], FIELDS).records == 30
    # A bad line of it is named as a .jsonl line is; a list and a lone object as before.
    (tmp_path / "d.json").write_text(lines.replace("\n", "\n{\"text\": \n", 1))
    with pytest.raises(InputError, match=r"d.json:2: not valid JSON .*fix or remove"):
        check_data([tmp_path / "d.json"], FIELDS)
    (tmp_path / "d.json").write_text('{"text": "a"}')
    with pytest.raises(InputError, match="holds a JSON dict"):
        list(iter_records(tmp_path / "d.json"))
    # Not UTF-8: the line is named (it was the file alone, and the byte after a BOM).
    (tmp_path / "d.json").write_bytes(b'\xef\xbb\xbf[{"text": "a"},\n{"text": "caf\xe9"}]')
    with pytest.raises(InputError, match=r"d.json:2: not UTF-8 text \(byte 32 of the file\)"):
        list(iter_records(tmp_path / "d.json"))


@pytest.mark.parametrize("record, fragment", [
    ({"text": None}, "'text' is null: expected a string"),
    ({"text": 5}, "'text' is an int (5): expected a string"),
    ({"text": ["a", "b"]}, "'text' is a list (['a', 'b']): expected a string"),
    ({"prompt": "What is 2+2?", "response": None}, "'response' is null: expected a string"),
    ({"prompt": None, "completion": "4"}, "'prompt' is null: expected a string"),
    ({"prompt": "q", "response": None, "text": "t"}, "'response' is null"),
    ({"messages": None}, "'messages' is null: use a list of"),
])
def test_null_or_non_string_fields_are_refused_not_trained_on(tmp_path, record, fragment):
    """str() of them trained on the words "None" or "['a', 'b']", silently."""
    import json
    from rotapipe.train.loop import check_data
    p = tmp_path / "bad.jsonl"
    p.write_text('{"text": "ok"}\n' + json.dumps(record) + "\n")
    with pytest.raises(InputError) as info:
        check_data([p], FIELDS)
    assert str(info.value).startswith(f"{p}:2: {fragment}"), str(info.value)


def test_a_null_column_of_another_form_does_not_hide_the_record():
    """Parquet and dataset rows hold every column: a text row of a table that also has
    prompt and response columns has them null, and is a text record."""
    from rotapipe.train.records import record_parts
    row = {"prompt": None, "response": None, "text": "t", "messages": None}
    assert record_parts(row, FIELDS, "x:1") == ("text", "t")
    assert record_parts({"prompt": "q", "response": None, "completion": "c"}, FIELDS,
                        "x:1") == ("pair", ("q", "c"))


def test_the_run_summary_counts_files_and_saved_datasets(tmp_path):
    from rotapipe.train.records import describe_sources
    d = tmp_path / "d"
    d.mkdir()
    (d / "a.txt").write_text("one\n")
    (d / "b.txt").write_text("two\n")
    saved = tmp_path / "ds"            # what datasets.Dataset.save_to_disk writes
    saved.mkdir()
    (saved / "state.json").write_text("{}")
    (saved / "dataset_info.json").write_text("{}")
    assert describe_sources(source_files(str(d / "a.txt"))) == "1 file"
    assert describe_sources(source_files(f"{d},{saved}")) == "2 files, 1 saved dataset"


def test_a_text_line_longer_than_a_chunk_is_cut_into_records(tmp_path):
    """A text file's line longer than a chunk (a book on one line, minified code) was
    one record: a 24 MB line packed into one lane, and the run failed with "lane 1 of
    the training split is empty ... add data". Now cut at spaces into chunks."""
    from rotapipe.train.records import CHUNK_CHARS, iter_records
    line = " ".join(f"w{i}" for i in range(CHUNK_CHARS)) + "\n"        # ~6 chunks
    p = tmp_path / "one_line.txt"
    p.write_text("head\n" + line + "tail\n")
    records = [r for _, r in iter_records(p)]
    assert "".join(records) == "head\n" + line + "tail\n"
    # a chunk: pieces of at most CHUNK_CHARS until it holds CHUNK_CHARS, as whole lines
    assert len(records) >= 3 and all(len(r) < 2 * CHUNK_CHARS for r in records)
    assert not any(r.startswith(" ") for r in records)
    # a word longer than a chunk has no space to cut at: cut at the chunk's length
    p.write_text("x" * (2 * CHUNK_CHARS + 1))
    assert [len(r) for _, r in iter_records(p)] == [CHUNK_CHARS, CHUNK_CHARS, 1]


def test_a_text_file_is_one_document_across_its_chunks(tmp_path):
    """Every 32 KiB chunk of a text file got the end-of-text token (and a BOS when the
    tokenizer adds one): 480 end-of-text targets in the middle of the demo's 1,790
    files. Now the file's tokens, packed across records, are the tokenizer's own of the
    whole file: one BOS first, one end-of-text last."""
    from rotapipe.train.records import CHUNK_CHARS, iter_records
    from train_util import WORDS, chat_tokenizer
    tok = chat_tokenizer()                                 # adds <s>; words as tokens
    line = " ".join(WORDS) + "\n"
    text = line * (3 * CHUNK_CHARS // len(line) + 5)       # three chunks and a bit
    p = tmp_path / "book.txt"
    p.write_text(text)
    assert len(list(iter_records(p))) == 4
    want = tok.encode(text) + [tok.eos_token_id]           # [<s>, ..., <|end|>]
    s = PackedStream([p], tok, seq=1024, seed=0, holdout=0.0, fields=FIELDS,
                     packing="concat")
    ids, labels = [], []
    while s.epoch == 0:
        row = s.next_sequence()
        ids, labels = ids + row[0], labels + row[1]
    assert ids[:len(want)] == want and labels[:len(want)] == [IGNORE] + want[1:]
    # A blank last chunk still ends the file (it is not an empty record).
    p.write_text("x" * CHUNK_CHARS + "\n\n")
    from rotapipe.train.records import is_empty, record_parts
    last = list(iter_records(p))[-1][1]
    assert last == "\n\n" and not is_empty(*record_parts(last, FIELDS, ""))


@pytest.mark.parametrize("name, body", [
    ("bom.jsonl", '{"text": "a b"}\n{"text": "c"}\n'),
    ("bom.json", '[{"text": "a b"}, {"text": "c"}]'),
    ("bom.txt", "a b\nc\n"),
])
def test_a_byte_order_mark_opening_a_file_is_not_data(tmp_path, name, body):
    """UTF-8 files saved by Notepad or PowerShell open with a byte-order mark: a JSONL
    file failed with "bom.jsonl:1: not valid JSON (Unexpected UTF-8 BOM ...): fix or
    remove the line", and a text file trained on the mark as a character."""
    from rotapipe.train.loop import check_data
    from rotapipe.train.records import iter_records
    p = tmp_path / name
    p.write_bytes(b"\xef\xbb\xbf" + body.encode())
    check_data([p], FIELDS)
    first = next(iter_records(p))[1]
    assert (first if isinstance(first, str) else first["text"]).startswith("a b")


@pytest.mark.parametrize("record, fields", [
    ({"text": "t", "prompt": "q", "response": "r"}, "'prompt' and 'response' and 'text'"),
    ({"text": "t", "prompt": "q", "completion": "r"}, "'prompt' and 'completion' and 'text'"),
    ({"text": "t", "messages": [{"role": "assistant", "content": "a"}]},
     "'messages' and 'text'"),
    ({"prompt": "q", "response": "r", "messages": [{"role": "assistant", "content": "a"}]},
     "'messages' and 'prompt' and 'response'"),
])
def test_a_record_of_two_forms_is_refused_naming_its_fields(tmp_path, record, fields):
    """A record with both a text and a prompt/response pair (or a chat) trained as the
    pair (the chat) silently, the text dropped; now refused at load time, before any
    work, naming the file, the line, the fields and the fix."""
    import json
    from rotapipe.train.loop import check_data
    p = tmp_path / "both.jsonl"
    p.write_text('{"text": "ok"}\n' + json.dumps(record) + "\n")
    with pytest.raises(InputError) as info:
        check_data([p], FIELDS)
    msg = str(info.value)
    assert msg.startswith(f"{p}:2: the record holds {fields}: "), msg
    assert "ambiguous; keep one form's fields in each record" in msg and "text_field" in msg


def test_empty_records_are_skipped_and_counted(corpus, tmp_path):
    """A record with a blank text (or a blank response) trained on its begin and end
    tokens alone, silently: now it makes no document, the stream packs what it would
    without it, and check_data counts it; data of nothing but empty records is
    refused before any work."""
    import json
    from rotapipe.train.loop import check_data
    _, _, tok = corpus
    texts = ["the cat sat", "", "a dog ran", "  \n", "on the mat"]
    full, clean = tmp_path / "full.jsonl", tmp_path / "clean.jsonl"
    full.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts)
                    + json.dumps({"prompt": "q", "response": " "}) + "\n")
    clean.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts if t.strip()))

    def rows(path):
        s = PackedStream([path], tok, seq=8, seed=0, holdout=0, fields=FIELDS)
        return [s.next_sequence() for _ in range(4)]
    assert rows(full) == rows(clean)
    survey = check_data([full], FIELDS)
    assert (survey.records, survey.empty, survey.first_empty) == (6, 3, f"{full}:2")
    only = tmp_path / "empty.jsonl"
    only.write_text('{"text": ""}\n{"text": " "}\n')
    with pytest.raises(InputError, match=rf"every record of data is empty \(2 of them, the "
                                         rf"first at {only}:1: .*nothing to learn"):
        check_data([only], FIELDS)


def test_a_split_smaller_than_the_batch_trains_and_an_empty_one_is_refused(tmp_path):
    """Each batch row packed its own hash-chosen share of the records, so 6 records and
    a batch of 16 left rows empty (refused). The rows now draw from one shared order:
    6 records fill a batch of 16 (repeating, as epochs do), and only a split with no
    training record is refused, from the records alone."""
    from rotapipe.train.survey import check_lanes
    p = text_jsonl(tmp_path / "few.jsonl", 6)
    check_lanes([p], FIELDS, batch=16, microbatches=4, holdout=0)
    with pytest.raises(ConfigError, match=r"the training split is empty: each of the 6 "
                                          r"records of the data is held out \(holdout=0.999\)"):
        check_lanes([p], FIELDS, batch=16, microbatches=4, holdout=0.999)
