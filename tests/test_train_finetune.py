"""Fine-tuning a pretrained model directory the way Hugging Face users do: a chat SFT run
(its first loss equals plain transformers' on assistant tokens only), fine-tuning
defaults and epochs as the schedule length, a separate evaluation file with no held-out
split, a hub id resolved offline from a Hugging Face cache, TensorBoard event files,
continuing a LoRA adapter."""

from __future__ import annotations

import json
import math
import pathlib

import pytest
import torch

from rotapipe.errors import ConfigError
from rotapipe.train import TrainConfig, train
from rotapipe.train.data import IGNORE, TextFields, TrainBatches, count_split
from train_util import chat_jsonl, chat_tokenizer, run, sft_jsonl, tiny_model_dir

transformers = pytest.importorskip("transformers")

# Runtime settings of a tiny fine-tuning run (the model's sizes come from its directory).
RUN = dict(seq=48, batch=4, microbatches=2, eval_sequences=4, workers=2,
           backend="emulated", progress=False, log_every=1000)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("model") / "tiny", chat_tokenizer())


def _metrics(out: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_chat_sft_first_loss_is_transformers_loss_on_assistant_tokens(tmp_path, model_dir):
    data = chat_jsonl(tmp_path / "chat.jsonl", 200)
    cfg = TrainConfig(**RUN, model=str(model_dir), data=str(data), holdout=0.1,
                      out_dir=str(tmp_path / "o"), steps=12, eval_interval=6, lr=3e-3,
                      warmup=1, sample_prompt="cat dog", sample_tokens=6)
    lines = []
    result = train(cfg, echo=lines.append)
    # The first batch, rebuilt with the data module, through plain transformers: its
    # labels count exactly the assistant turns (checked token by token in
    # test_train_chat.py), and the documents attend only to themselves.
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    batch = TrainBatches([data], tok, batch=4, seq=48, seed=0, holdout=0.1,
                         fields=TextFields(), packing="documents").next()
    assert ((batch.labels != IGNORE).sum(1) > 0).all()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # use_cache=False: with a cache, transformers' mask helpers do not split packed
    # documents by their position ids (a training forward has none).
    want = model(input_ids=batch.ids, position_ids=batch.position_ids, labels=batch.labels,
                 use_cache=False).loss.item()
    rows = [r for r in _metrics(tmp_path / "o") if "loss" in r]
    assert rows[0]["loss"] == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert result.eval_last < result.eval_first, lines
    # The sample is the reply to a chat prompt, special tokens hidden.
    assert result.sample is not None and "<|" not in result.sample and "<s>" not in result.sample
    assert (tmp_path / "o" / "loss.png").stat().st_size > 10_000


def test_pretrained_defaults_and_epochs_set_the_schedule(tmp_path, model_dir):
    data = sft_jsonl(tmp_path / "s.jsonl", 120)
    lines = []
    cfg = TrainConfig(**RUN, model=str(model_dir), data=str(data), holdout=0.1,
                      out_dir=str(tmp_path / "o"), epochs=2, eval_interval=0,
                      save_interval=0)
    assert cfg.lr is None and cfg.steps is None        # chosen for the run
    result = train(cfg, echo=lines.append)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    _, tokens = count_split([data], tok, holdout=0.1, fields=TextFields())
    steps = math.ceil(2 * math.ceil(tokens / 48) / 4)
    assert result.step == steps
    settings = next(line for line in lines if line.startswith("settings:"))
    warmup = max(1, round(0.03 * steps))
    assert settings.startswith(f"settings: lr 2e-05, warmup {warmup}, weight decay 0, "
                               f"{steps} steps (2 epochs)"), settings
    assert "pretrained-model defaults: lr, warmup, weight decay, steps" in settings
    rows = [r for r in _metrics(tmp_path / "o") if "lr" in r]
    assert rows[0]["lr"] == pytest.approx(2e-5 / warmup)
    assert rows[-1]["lr"] == pytest.approx(2e-5 * 0.1)     # the floor, at the last step
    # From scratch the demo's values stay.
    scratch = TrainConfig().effective()
    assert (scratch.lr, scratch.weight_decay, scratch.steps, scratch.warmup) == \
        (4e-3, 0.1, 400, 20)
    assert TrainConfig(model="m", lora=True).effective().lr == 2e-4


def test_holdout_0_with_eval_data_trains_on_3000_records(tmp_path, model_dir, capsys):
    data = sft_jsonl(tmp_path / "train.jsonl", 3000, seed=1)
    other = sft_jsonl(tmp_path / "other.jsonl", 20, seed=2)
    out = tmp_path / "o"
    p = run(["--model", str(model_dir), "--data", str(data), "--holdout", "0",
             "--eval-data", str(other), "--steps", "4", "--eval-interval", "2",
             "--out-dir", str(out), "--seq", "48", "--batch", "4", "--microbatches", "2",
             "--workers", "2", "--backend", "emulated", "--log-every", "2"], timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "evaluation on" in p.stdout and "eval loss" in p.stdout
    # Not a terminal: no progress bar frames, ours or transformers' (weight loading and
    # saving), only the log_every lines.
    assert "\r" not in p.stdout + p.stderr and "it/s]" not in p.stdout + p.stderr
    assert "step     2  loss" in p.stdout and "step     4  loss" in p.stdout
    evals = [r["eval_loss"] for r in _metrics(out) if "eval_loss" in r]
    assert len(evals) == 3 and all(math.isfinite(e) for e in evals)
    # No held-out split: every record trains (3000 records, none held out).
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert count_split([data], tok, holdout=0.0, fields=TextFields())[0] == 3000
    # holdout 0 and no eval_data: trains without evaluating (in this process).
    from rotapipe.cli import main
    capsys.readouterr()
    rc = main(["train", "--model", str(model_dir), "--data", str(data), "--holdout", "0",
               "--steps", "2", "--out-dir", str(tmp_path / "o2"), "--seq", "48",
               "--batch", "4", "--microbatches", "2", "--backend", "emulated",
               "--no-progress"])
    got = capsys.readouterr()
    assert rc == 0 and "no evaluation" in got.out, got.out + got.err


def _hub_cache(root: pathlib.Path, repo: str, model_dir: pathlib.Path,
               kind: str = "models") -> pathlib.Path:
    """A Hugging Face hub cache holding ``repo`` as huggingface_hub lays it out:
    ``models--org--name/{refs/main, snapshots/<commit>/...}`` (``datasets--`` for a
    dataset repository)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = root / (f"{kind}--" + repo.replace("/", "--"))
    snap = repo_dir / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in model_dir.rglob("*"):
        if f.is_file():
            (snap / f.relative_to(model_dir)).parent.mkdir(parents=True, exist_ok=True)
            (snap / f.relative_to(model_dir)).write_bytes(f.read_bytes())
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    return root


def test_hub_id_resolves_offline_from_the_cache(tmp_path, model_dir, monkeypatch):
    cache = _hub_cache(tmp_path / "hub", "tiny-org/tiny-chat", model_dir)
    data = sft_jsonl(tmp_path / "s.jsonl", 100)
    base = ["--data", str(data), "--steps", "1", "--seq", "48", "--batch", "4",
            "--microbatches", "2", "--backend", "emulated", "--no-progress"]
    # The run is a subprocess: huggingface_hub reads HF_HUB_CACHE when it is imported.
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    p = run(["--model", "tiny-org/tiny-chat", "--out-dir", str(tmp_path / "o"), *base])
    assert p.returncode == 0, p.stdout + p.stderr
    assert "model: tiny-org/tiny-chat" in p.stdout
    p = run(["--model", "tiny-org/not-cached", "--out-dir", str(tmp_path / "o2"), *base])
    assert p.returncode == 2
    assert "'tiny-org/not-cached' is not in the Hugging Face cache and HF_HUB_OFFLINE " \
           "is set" in p.stderr and "Traceback" not in p.stderr


def test_tensorboard_event_files_hold_the_logged_scalars(tmp_path, model_dir):
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator")
    data = sft_jsonl(tmp_path / "s.jsonl", 100)
    out = tmp_path / "o"
    train(TrainConfig(**RUN, model=str(model_dir), data=str(data), holdout=0.1,
                      out_dir=str(out), steps=4, eval_interval=2, report_to="tensorboard"),
          echo=lambda s: None)
    acc = event_accumulator.EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    rows = _metrics(out)
    loss = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert loss == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in rows if "loss" in r]
    evals = [(e.step, e.value) for e in acc.Scalars("eval/eval_loss")]
    assert [s for s, _ in evals] == [0, 2, 4]
    assert [v for _, v in evals] == [pytest.approx(r["eval_loss"], rel=1e-6)
                                     for r in rows if "eval_loss" in r]
    assert {"train/lr", "train/grad_norm", "train/tokens_per_s"} <= \
        set(acc.Tags()["scalars"])


def test_resume_from_adapter_continues_the_lora(tmp_path, model_dir):
    pytest.importorskip("peft")
    data = sft_jsonl(tmp_path / "s.jsonl", 150)
    common = dict(**RUN, model=str(model_dir), data=str(data), holdout=0.1,
                  eval_interval=3, lr=1e-2, warmup=1)
    first = train(TrainConfig(**common, out_dir=str(tmp_path / "a"), steps=3, lora=True,
                              lora_rank=4), echo=lambda s: None)
    adapter = tmp_path / "a" / "final"
    lines = []
    second = train(TrainConfig(**common, out_dir=str(tmp_path / "b"), steps=3,
                               resume_from_adapter=str(adapter)), echo=lines.append)
    # The second run starts where the first ended: same weights, same held-out loss.
    assert second.eval_first == pytest.approx(first.eval_last, rel=1e-6)
    # ... and trains the adapter further (every LoRA weight it exports has moved).
    from safetensors.torch import load_file
    before = load_file(str(adapter / "adapter_model.safetensors"))
    after = load_file(str(tmp_path / "b" / "final" / "adapter_model.safetensors"))
    assert before.keys() == after.keys() and before
    assert all(not torch.equal(before[k], after[k]) for k in before)
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    again = json.loads((tmp_path / "b" / "final" / "adapter_config.json").read_text())
    assert again["r"] == cfg["r"] == 4
    assert any("+ adapter" in line and "(LoRA)" in line for line in lines)
    with pytest.raises(ConfigError, match="no adapter_config.json"):
        train(TrainConfig(**common, out_dir=str(tmp_path / "c"), steps=1,
                          resume_from_adapter=str(tmp_path)), echo=lambda s: None)


def _wandb_records(run_file: pathlib.Path) -> list[bytes]:
    """The serialized ``wandb_internal_pb2.Record``s of a W&B ``.wandb`` file: a
    LevelDB-style log (a 7-byte file header, 32 KiB blocks, each record chunk behind a
    7-byte header: crc32, length, kind 1 full / 2 first / 3 middle / 4 last)."""
    import struct

    data, block, pos, chunks, buf = run_file.read_bytes(), 32768, 7, [], b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        if kind == 0 and n == 0:
            pos += left - 7
            continue
        buf += data[pos:pos + n]
        pos += n
        if kind in (1, 4):
            chunks.append(buf)
            buf = b""
    return chunks


def _wandb_history(run_file: pathlib.Path) -> list[dict]:
    """The history records (the logged rows) of a W&B ``.wandb`` file."""
    from wandb.proto import wandb_internal_pb2 as pb

    rows = []
    for record in map(pb.Record.FromString, _wandb_records(run_file)):
        if record.WhichOneof("record_type") == "history":
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                         for i in record.history.item})
    return rows


def test_wandb_offline_run_holds_the_logged_scalars(tmp_path, model_dir, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    data = sft_jsonl(tmp_path / "s.jsonl", 100)
    out = tmp_path / "o"
    train(TrainConfig(**RUN, model=str(model_dir), data=str(data), holdout=0.1,
                      out_dir=str(out), steps=3, eval_interval=3, report_to="wandb"),
          echo=lambda s: None)
    (run_file,) = out.glob("wandb/offline-run-*/run-*.wandb")
    history = _wandb_history(run_file)
    logged = [(h["_step"], h["train/loss"]) for h in history if "train/loss" in h]
    rows = _metrics(out)
    assert logged == [(r["step"], pytest.approx(r["loss"], rel=1e-9)) for r in rows
                      if "loss" in r]
    assert [h["_step"] for h in history if "eval/eval_loss" in h] == [0, 3]


def _wandb_run_id(run_file: pathlib.Path) -> str:
    """The run id in a ``.wandb`` log's ``run`` record."""
    from wandb.proto import wandb_internal_pb2 as pb
    return next(r.run.run_id for r in map(pb.Record.FromString, _wandb_records(run_file))
                if r.WhichOneof("record_type") == "run")


def test_wandb_resume_continues_the_same_run(tmp_path, model_dir, monkeypatch):
    """--resume logs to the W&B run of the run it resumes (its id kept in out_dir), from
    the checkpoint's step on."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    data = sft_jsonl(tmp_path / "s.jsonl", 100)
    out = tmp_path / "o"
    cfg = TrainConfig(**RUN, model=str(model_dir), data=str(data), holdout=0.1,
                      out_dir=str(out), steps=3, eval_interval=3, report_to="wandb")
    train(cfg, echo=lambda s: None)
    train(cfg.replace(steps=5, resume=True), echo=lambda s: None)
    first, second = sorted(out.glob("wandb/offline-run-*/run-*.wandb"),
                           key=lambda f: f.stat().st_mtime)
    run_id = (out / "wandb-run-id").read_text().strip()
    assert _wandb_run_id(first) == _wandb_run_id(second) == run_id
    assert first.name == second.name == f"run-{run_id}.wandb" and first != second
    steps = [h["_step"] for h in _wandb_history(second) if "train/loss" in h]
    assert steps == [4, 5]
    # A new run in the same out_dir (no --resume) is a new W&B run.
    import shutil
    shutil.rmtree(out / "checkpoints")
    train(cfg.replace(steps=1, eval_interval=0), echo=lambda s: None)
    assert (out / "wandb-run-id").read_text().strip() != run_id


def _dataset_repo(root: pathlib.Path) -> pathlib.Path:
    """A dataset repository with two builder configs declared in its card, as the hub
    has them: ``chat`` (train 120 and test 10 chats) and ``sft`` (train 40 and test 7
    prompt/response pairs)."""
    for config, make, sizes in (("chat", chat_jsonl, (120, 10)), ("sft", sft_jsonl, (40, 7))):
        (root / config).mkdir(parents=True)
        for split, n in zip(("train", "test"), sizes):
            make(root / config / f"{split}.jsonl", n, seed=n)
    card = ["---", "configs:"]
    for config in ("chat", "sft"):
        card += [f"- config_name: {config}", "  data_files:"]
        card += [f"  - split: {s}\n    path: {config}/{s}.jsonl" for s in ("train", "test")]
    (root / "README.md").write_text("\n".join(card + ["---", "# tiny mixed data", ""]))
    return root


def test_hub_dataset_configs_and_splits_load_by_name(tmp_path, model_dir, monkeypatch):
    """data and eval_data as dataset names, loaded with datasets.load_dataset from a
    snapshot in the hub cache with no request: the builder config and split chosen by
    data_config / data_split / org/name:split, and errors that name what exists."""
    datasets = pytest.importorskip("datasets")
    import huggingface_hub.constants
    cache = _hub_cache(tmp_path / "hub", "tiny-org/mixed", _dataset_repo(tmp_path / "repo"),
                       kind="datasets")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "prepared")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from rotapipe.train.data import iter_records, source_files
    from rotapipe.train.records import describe_sources
    for spec, config, split, file, rows in (
            ("tiny-org/mixed", "chat", None, "chat/train.jsonl", 120),
            ("tiny-org/mixed:test", "sft", None, "sft/test.jsonl", 7),
            ("tiny-org/mixed", "sft", "train[:5]", "sft/train.jsonl", 5)):
        (src,) = source_files(spec, config, split)
        lines = (tmp_path / "repo" / file).read_text().splitlines()
        assert [r for _, r in iter_records(src)] == [json.loads(x) for x in lines[:rows]]
        assert describe_sources([src]) == f"dataset split {src} ({rows:,} rows)"
    with pytest.raises(ConfigError, match="has the configs chat, sft: choose one with "
                                          "--data-config"):
        source_files("tiny-org/mixed")
    with pytest.raises(ConfigError, match="has no 'validation' split \\(it has train, "
                                          "test\\): name one with --data-split"):
        source_files("tiny-org/mixed", "chat", "validation")
    with pytest.raises(ConfigError, match="'tiny-org/other' is not in the Hugging Face "
                                          "cache .* download it first on a connected "
                                          "machine .* or pass a local path"):
        source_files("tiny-org/other")
    # Without a hub snapshot: a dataset the datasets library prepared on this HF_HOME
    # before (load_dataset("tiny-org/prepared", "sft") online leaves it in the layout
    # datasets 5 writes: org___name/config/version/hash/name-split.arrow).
    loaded = datasets.load_dataset(str(tmp_path / "repo"), "sft", split="test",
                                   cache_dir=str(tmp_path / "elsewhere"))
    built = pathlib.Path(loaded.cache_files[0]["filename"]).parent
    prepared = tmp_path / "prepared" / "tiny-org___prepared" / "sft" / built.parent.name / \
        built.name
    prepared.parent.mkdir(parents=True)
    prepared.mkdir()
    (prepared / "dataset_info.json").write_bytes((built / "dataset_info.json").read_bytes())
    for f in built.glob("*.arrow"):
        (prepared / ("prepared-" + f.name.rsplit("-", 1)[1])).write_bytes(f.read_bytes())
    (src,) = source_files("tiny-org/prepared:test", "sft")
    lines = (tmp_path / "repo" / "sft" / "test.jsonl").read_text().splitlines()
    assert [r for _, r in iter_records(src)] == [json.loads(x) for x in lines]
    with pytest.raises(ConfigError, match="'tiny-org/prepared' is not in the Hugging Face "
                                          "cache .* with config 'chat'"):
        source_files("tiny-org/prepared", "chat")


def test_train_from_a_dataset_name_offline_in_a_fresh_hf_home(tmp_path, model_dir,
                                                                monkeypatch):
    """The command line, offline, with HF_HOME holding only the hub cache: trains on a
    named dataset's config and split, evaluates on its test split; an uncached name is
    a one-line error (exit 2) that says how to get it."""
    pytest.importorskip("datasets")
    home = tmp_path / "hf"
    _hub_cache(home / "hub", "tiny-org/mixed", _dataset_repo(tmp_path / "repo"),
               kind="datasets")
    base = ["--model", str(model_dir), "--data-config", "chat", "--holdout", "0",
            "--steps", "2", "--eval-interval", "2", "--seq", "48", "--batch", "4",
            "--microbatches", "2", "--backend", "emulated", "--no-progress"]
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name in ("HF_HUB_CACHE", "HF_DATASETS_CACHE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    p = run(["--data", "tiny-org/mixed", "--data-split", "train",
             "--eval-data", "tiny-org/mixed", "--out-dir", str(tmp_path / "o"), *base],
            timeout=300)
    q = run(["--data", "tiny-org/absent", "--out-dir", str(tmp_path / "o2"), *base])
    assert p.returncode == 0, p.stdout + p.stderr
    assert "evaluation on tiny-org/mixed" in p.stdout and "Generating" not in p.stderr
    # The summary names the split it read and its rows (not "1 files"), and the
    # optimizer's state precision.
    assert "data: tiny-org/mixed (dataset split tiny-org/mixed[chat]:train (120 rows))" \
        in p.stdout, p.stdout
    assert "optimizer adamw (fp32 state)" in p.stdout
    assert (home / "datasets").is_dir()          # datasets prepared it in HF_HOME's cache
    assert q.returncode == 2 and "Traceback" not in q.stderr
    assert "'tiny-org/absent' is not in the Hugging Face cache" in q.stderr, q.stderr


def test_an_empty_heldout_split_trains_without_evaluation(tmp_path, model_dir, caplog):
    data = sft_jsonl(tmp_path / "s.jsonl", 40)
    lines = []
    result = train(TrainConfig(**RUN, model=str(model_dir), data=str(data), holdout=1e-9,
                               steps=1, out_dir=str(tmp_path / "o")), echo=lines.append)
    assert result.step == 1 and result.eval_first is None
    assert any("no evaluation (the held-out split is empty)" in line for line in lines)
    assert "holds no tokens that count" in caplog.text


def test_recipe_then_flags_on_the_command_line(tmp_path, model_dir, capsys):
    from rotapipe.cli import main
    data = sft_jsonl(tmp_path / "s.jsonl", 60)
    rc = main(["train", "--recipe", "lora", "--model", str(model_dir), "--data", str(data),
               "--seq", "48", "--batch", "4", "--microbatches", "2", "--dtype", "fp32",
               "--steps", "2", "--backend", "emulated", "--no-progress",
               "--out-dir", str(tmp_path / "o")])
    out = capsys.readouterr().out
    assert rc == 0, out
    # The recipe's LoRA settings and learning rate, the flags' sizes and steps.
    assert "(LoRA)" in out and "settings: lr 0.0002, warmup 1, weight decay 0, 2 steps, " \
        "batch 4 x 48 tokens" in out, out
    adapter = json.loads((tmp_path / "o" / "final" / "adapter_config.json").read_text())
    assert adapter["r"] == 16 and adapter["lora_alpha"] == 32


def test_lora_base_loads_in_the_compute_dtype(tmp_path, model_dir):
    """The frozen base never exists in fp32 in host memory (what rotapipe plan counts);
    the adapter's weights, which train, are fp32."""
    from rotapipe.train.model import build_model
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = build_model(TrainConfig(model=str(model_dir), lora=True, dtype="bf16")
                        .effective(), tok)
    frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
    trained = {p.dtype for p in model.parameters() if p.requires_grad}
    assert frozen == {torch.bfloat16} and trained == {torch.float32}
    full = build_model(TrainConfig(model=str(model_dir), dtype="bf16").effective(), tok)
    assert {p.dtype for p in full.parameters()} == {torch.float32}     # the masters
    data = sft_jsonl(tmp_path / "s.jsonl", 60)
    result = train(TrainConfig(**{**RUN, "eval_sequences": 2}, model=str(model_dir),
                               data=str(data), lora=True, dtype="bf16", steps=2,
                               eval_interval=2, holdout=0.2, out_dir=str(tmp_path / "o")),
                   echo=lambda s: None)
    assert result.step == 2 and math.isfinite(result.eval_last)


def test_lora_on_fused_experts_is_named_in_the_summary(tmp_path):
    """PEFT's all-linear adapts Qwen3-MoE's fused expert stacks by folding B·A into each
    whole stack per forward (work the planner does not price): the run's summary says
    so and names the targets that leave the experts frozen; with those, no expert
    trains and the note is gone."""
    from rotapipe.train.model import build_model, folded_expert_note
    tok = chat_tokenizer()
    config = transformers.Qwen3MoeConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=64, moe_intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
        tie_word_embeddings=False, eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(tmp_path / "moe")
    tok.save_pretrained(tmp_path / "moe")
    data = sft_jsonl(tmp_path / "s.jsonl", 60)
    lines = []
    train(TrainConfig(**RUN, model=str(tmp_path / "moe"), data=str(data), lora=True,
                      holdout=0, steps=1, out_dir=str(tmp_path / "o")), echo=lines.append)
    notes = [l for l in lines if l.startswith("note: LoRA adapts")]
    # 2 blocks x (gate_up_proj, down_proj); a block's stacks: 4 experts x 3 x 256 x 64
    # weights in the compute dtype (fp32 here) = 786,432 bytes.
    assert len(notes) == 1 and "4 fused expert stacks" in notes[0], lines
    assert "at least 0.8 MB per block" in notes[0], notes[0]
    assert "--lora-targets k_proj,o_proj,q_proj,v_proj adapts those layers alone" in notes[0]
    cfg = TrainConfig(model=str(tmp_path / "moe"), lora=True,
                      lora_targets="k_proj,o_proj,q_proj,v_proj").effective()
    model = build_model(cfg, tok)
    assert folded_expert_note(model) is None
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and not [n for n in trained if "expert" in n or ".gate." in n], trained


def test_missing_paths_are_path_errors_not_hub_lookups(tmp_path, monkeypatch):
    from rotapipe.train.data import source_files
    from rotapipe.train.model import resolve_model
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    with pytest.raises(ConfigError, match="data file 'corpus/train.jsonl' does not exist"):
        source_files("corpus/train.jsonl")
    with pytest.raises(ConfigError, match="model directory 'models/Qwen3' does not exist"):
        resolve_model("models/Qwen3")


def test_samples_at_an_interval_from_a_prompt_file_leave_training_alone(tmp_path,
                                                                         model_dir):
    data = chat_jsonl(tmp_path / "c.jsonl", 80)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("red fox\n\nbig tree hill\n")
    common = dict(**RUN, model=str(model_dir), data=str(data), holdout=0.1, steps=4,
                  eval_interval=0, lr=3e-3, warmup=1, sample_tokens=4)
    train(TrainConfig(**common, out_dir=str(tmp_path / "plain")), echo=lambda s: None)
    lines = []
    result = train(TrainConfig(**common, out_dir=str(tmp_path / "s"), sample_prompt="cat dog",
                               sample_file=str(prompts), sample_interval=2,
                               temperature=0.8, top_p=0.9), echo=lines.append)
    rows = [json.loads(line) for line in
            (tmp_path / "s" / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["prompt"]) for r in rows] == [
        (s, p) for s in (2, 4) for p in ("cat dog", "red fox", "big tree hill")]
    assert result.sample == rows[3]["sample"]
    assert sum("sample at step 2 (temperature 0.8, top-p 0.9" in line for line in lines) == 3
    # Sampling mid-run (seeded, on its own random stream, the model put back in training
    # mode) changes nothing in training: the same losses as the run without samples.
    assert [r["loss"] for r in _metrics(tmp_path / "s") if "loss" in r] == \
        [r["loss"] for r in _metrics(tmp_path / "plain") if "loss" in r]
    with pytest.raises(ConfigError, match="sample_file .* cannot be read"):
        train(TrainConfig(**common, out_dir=str(tmp_path / "x"),
                          sample_file=str(tmp_path / "nope.txt")), echo=lambda s: None)


def test_every_step_trains_in_train_mode(tmp_path, model_dir, monkeypatch):
    """``from_pretrained`` leaves the model in eval mode (dropout off). Before, only the
    step-0 evaluation switched the pipeline to training, so a run without evaluation
    (or a resumed one) trained with dropout silently off. Every training call now
    runs with each module of the wrapped model in training mode."""
    from rotapipe.pipe import RoundPipe
    seen = []
    step = RoundPipe.train_step

    def train_step(self, inputs, labels):
        seen.append(all(m.training for layer in self.layerset.layers
                        for m in layer.modules()))
        return step(self, inputs, labels)
    monkeypatch.setattr(RoundPipe, "train_step", train_step)
    data = chat_jsonl(tmp_path / "chat.jsonl", 60)
    train(TrainConfig(**RUN, model=str(model_dir), data=str(data), holdout=0.0,
                      out_dir=str(tmp_path / "o"), steps=2, sample_tokens=0),
          echo=lambda *a: None)
    assert seen == [True, True]


def test_sequences_with_no_label_to_learn_are_skipped(tmp_path, model_dir):
    """Prompt/completion records whose prompt is longer than ``seq`` leave sequences with
    every label ignored; a batch of only those used to stop the run mid-way ("are all
    labels ignored?"). They are skipped (and counted); data with no label at all
    within ``seq`` is refused."""
    words = ["cat", "dog", "sun", "red"]
    with open(tmp_path / "pc.jsonl", "w") as f:
        for i in range(40):
            n = 60 if i % 3 else 3                   # two of three prompts too long
            f.write(json.dumps({"prompt": " ".join(words[(i + k) % 4] for k in range(n)),
                                "completion": "cat dog"}) + "\n")
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    for packing in ("pad", "documents"):
        stream = TrainBatches([tmp_path / "pc.jsonl"], tok, batch=2, seq=16, seed=0,
                              holdout=0.0, fields=TextFields(), packing=packing)
        for _ in range(12):
            batch = stream.next()
            assert ((batch.labels[:, 1:] != IGNORE).sum(1) > 0).all(), packing
        assert sum(s.skipped for s in stream.lanes) > 0, packing
    lines = []
    result = train(TrainConfig(**RUN | dict(seq=16, batch=2), model=str(model_dir),
                               data=str(tmp_path / "pc.jsonl"), holdout=0.0, packing="pad",
                               out_dir=str(tmp_path / "o"), steps=6, sample_tokens=0),
                   echo=lines.append)
    assert result.step == 6
    assert any(line.startswith("skipped ") for line in lines), lines
    with open(tmp_path / "long.jsonl", "w") as f:
        for i in range(8):
            f.write(json.dumps({"prompt": " ".join(words * 20), "completion": "cat"}) + "\n")
    stream = TrainBatches([tmp_path / "long.jsonl"], tok, batch=1, seq=16, seed=0,
                          holdout=0.0, fields=TextFields(), packing="pad")
    with pytest.raises(ConfigError, match="no sequence of the training split has a label"):
        stream.next()


def test_a_resumed_adapter_is_priced_with_its_own_rank(tmp_path, model_dir):
    """The host-RAM check prices ``--resume-from-adapter`` with the adapter's own rank
    and targets (its adapter_config.json), not the run's default ``lora_rank`` of 8: a
    rank-64 adapter was priced at a sixth of its state (0.2 MB for 1.2 MB here)."""
    peft = pytest.importorskip("peft")
    from rotapipe.train.model import host_state

    base = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir))
    peft.get_peft_model(base, peft.LoraConfig(r=64, lora_alpha=16, target_modules=[
        "q_proj", "v_proj", "up_proj"])).save_pretrained(str(tmp_path / "adapter"))
    common = dict(model=str(model_dir), data="x.jsonl", lr=1e-3, steps=1)
    resumed = host_state(TrainConfig(**common, resume_from_adapter=str(tmp_path /
                                                                       "adapter")), None)
    fresh = host_state(TrainConfig(**common, lora=True, lora_rank=64,
                                   lora_targets="q_proj,v_proj,up_proj"), None)
    default = host_state(TrainConfig(**common, lora=True, lora_targets="q_proj,v_proj,"
                                     "up_proj"), None)
    assert resumed.state == fresh.state > default.state
    assert resumed.masters == fresh.masters
