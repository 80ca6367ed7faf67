"""TrainConfig: every setting of a training job, one frozen dataclass, from a file or flags.

    cfg = TrainConfig(data="corpus/", steps=500)          # Python
    cfg = load_config("run.toml", {"lr": 1e-3})           # a file + overrides (settings.py)
    rotapipe train --config run.toml --lr 1e-3            # the same on the command line

The defaults are the demo: a small Qwen3 trained from scratch on the Python standard
library's own source files (``data="stdlib"``) on 2 emulated workers. Settings left at
``None`` take a value that depends on the run (:meth:`TrainConfig.effective`): a
pretrained ``model`` gets fine-tuning defaults (:data:`PRETRAINED`), a model from
scratch the demo's (:data:`FROM_SCRATCH`). Each component reads its own part
(:meth:`TrainConfig.pipe_config`), never the whole object.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, fields

# No torch at import (`rotapipe train --help`): the pipeline's config classes are
# imported where a TrainConfig is built.
from .._enums import BackendKind, NonFinite, OptimizerMode, RecomputeGrain, ShardMode

if typing.TYPE_CHECKING:
    from ..config import PipeConfig
from .. import _validate as check
from ..errors import ConfigError

__all__ = ["TrainConfig", "FROM_SCRATCH", "PRETRAINED", "REPORT_TO", "CHOICES", "OTHER_NAMES",
           "OTHER_MEANING", "LARGEST", "INT_LIMIT"]

FROM_SCRATCH = {"lr": 4e-3, "warmup": 20, "weight_decay": 0.1, "steps": 400,
                "sample_prompt": "def "}
"""Defaults of a model trained from scratch (the demo): a high learning rate, a fixed
number of steps (``steps`` is derived from ``epochs`` when that is set instead)."""
PRETRAINED = {"lr": 2e-5, "lora_lr": 2e-4, "warmup_fraction": 0.03, "weight_decay": 0.0,
              "epochs": 1}
"""Defaults with a pretrained ``model``: learning rate 2e-5 (LoRA: 2e-4), warmup over 3%
of the steps, no weight decay, one epoch over the training data (the schedule length
is counted from the data), no sample unless ``sample_prompt`` is given."""
REPORT_TO = ("none", "tensorboard", "wandb")
"""Metric sinks besides ``metrics.jsonl``."""
CHOICES = {"dtype": ("fp32", "bf16", "fp16"), "optimizer": ("adamw", "sgd"),
           "optimizer_state": ("fp32", "bf16", "int8"),
           "optimizer_mode": ("sync", "overlap", "stale"), "backend": ("auto", "cuda",
                                                                       "emulated"),
           "grain": ("stage", "layer"), "packing": ("documents", "concat", "pad"),
           "shard": ("none", "optimizer", "gradients"), "grad_dtype": ("float32", "bfloat16")}
"""The allowed values of the settings that are closed sets (listed in ``--help``)."""
OTHER_NAMES = {"max_steps": "steps", "num_train_epochs": "epochs", "learning_rate": "lr",
               "output_dir": "out_dir", "max_seq_length": "seq", "max_length": "seq",
               "warmup_steps": "warmup", "eval_steps": "eval_interval",
               "save_steps": "save_interval", "logging_steps": "log_every",
               "save_total_limit": "keep", "model_name_or_path": "model",
               "dataset_name": "data", "max_grad_norm": "grad_clip",
               "per_device_train_batch_size": "batch", "train_batch_size": "batch",
               "gradient_accumulation_steps": "microbatches"}
"""transformers' TrainingArguments (and TRL's) names of our settings: an unknown name
is answered with ours (:func:`_check_names`, ``rotapipe train``'s flags)."""
OTHER_MEANING = {"batch": " (sequences per optimizer step: the global batch, not per "
                          "device)",
                 "microbatches": " (--batch, the sequences of a step, is split into that "
                                 "many pieces)"}
"""What differs in the settings whose other names mean something else."""


@dataclass(frozen=True)
class TrainConfig:
    """All settings of ``rotapipe train``; validated at construction."""

    # -- model -----------------------------------------------------------------------
    model: str | None = None
    """Hugging Face model to fine-tune: a local directory, or a hub id (org/name)
    resolved through the Hugging Face cache (downloaded into it unless HF_HUB_OFFLINE is
    set); None: a Qwen3-architecture model trained from scratch with the sizes below and
    a byte-level BPE tokenizer trained on the data."""
    layers: int = 4
    """From scratch: decoder layers."""
    dim: int = 128
    """From scratch: hidden size."""
    heads: int = 4
    """From scratch: attention heads (head size ``dim / heads``)."""
    kv_heads: int | None = None
    """From scratch: key/value heads (grouped-query attention); ``None``: ``heads``."""
    ffn: int | None = None
    """From scratch: MLP width; ``None``: ``3 * dim``."""
    vocab: int = 2048
    """From scratch: vocabulary size of the BPE tokenizer trained on the data."""
    tokenizer_bytes: int = 3_000_000
    """From scratch: bytes of training text the tokenizer is trained on."""
    lora: bool = False
    """Train a LoRA adapter (peft) instead of every weight; export writes the adapter.
    Needs a pretrained ``model``: from scratch the base would stay random."""
    qlora: bool = False
    """QLoRA: a LoRA adapter (as ``lora``, implied) on a frozen base kept in host memory
    as 4-bit NormalFloat, uploaded packed and dequantized on the workers
    (``wrap_hf(quantize="nf4")``, bitsandbytes; docs/memory.md)."""
    lora_rank: int = 8
    """LoRA rank ``r``."""
    lora_alpha: float = 16.0
    """LoRA scaling ``alpha`` (the update is scaled by ``alpha / r``)."""
    lora_targets: str = "all-linear"
    """Comma-separated module names LoRA wraps, or all-linear."""
    resume_from_adapter: str | None = None
    """A LoRA adapter directory (PEFT format, e.g. a previous run's final/) to continue
    training; implies lora (its rank and targets are the adapter's)."""
    verify: bool = False
    """Before training, check the whole model's logits on a few tokens against its own
    Hugging Face forward (``wrap_hf(verify="full")``): the way to trust a new
    architecture."""
    # -- data ------------------------------------------------------------------------
    data: str = "stdlib"
    """Comma-separated data files (.jsonl, .json, .parquet, or text: .txt .md .py .rst),
    directories of them, saved Hugging Face dataset directories, or Hugging Face
    datasets by name (org/name, or org/name:split), loaded with datasets.load_dataset
    from the Hugging Face cache (offline with HF_HUB_OFFLINE) or the hub; stdlib: the
    Python standard library's .py files."""
    eval_data: str | None = None
    """Evaluation files (same forms as data; a dataset name's default split is test),
    every record of them held out (each evaluation runs on up to eval_sequences
    sequences); None: the held-out split of data (see holdout)."""
    data_config: str | None = None
    """The builder config (subset) of the datasets named in data and eval_data, as
    load_dataset(name, data_config) takes it (TRL's dataset_config); None: the
    dataset's only or default one."""
    data_split: str | None = None
    """The split of the datasets named in data (org/name:split names one per dataset);
    any split load_dataset takes, e.g. train[:1000]; None: train."""
    messages_field: str = "messages"
    """The field holding a chat: a list of {"role", "content"} rendered with the
    tokenizer's chat template, the loss on assistant turns only (ShareGPT's
    conversations field, from/value keys and human/gpt roles are read too)."""
    text_field: str = "text"
    """Records: the field holding a document's text."""
    prompt_field: str = "prompt"
    """Records: the prompt of a prompt/response pair (masked out of the loss)."""
    response_field: str = "response"
    """Records: the response of a prompt/response pair (the loss is on these tokens; a
    completion field is accepted too)."""
    seq: int = 128
    """Tokens per training sequence (at least 2)."""
    packing: str = "documents"
    """documents: records concatenated into sequences, each attending only to itself
    (position ids restart); concat: attending across records; pad: one record per
    sequence, cut at seq and padded."""
    holdout: float = 0.02
    """Fraction of records held out for evaluation (chosen by a hash of the file path
    and record index, so the split never changes with the seed or the file order); 0:
    none (evaluate on eval_data, or not at all)."""
    eval_sequences: int = 64
    """Held-out sequences each evaluation runs on (the same ones every time)."""
    # -- batch and precision ---------------------------------------------------------
    batch: int = 16
    """Sequences per optimizer step (the global batch)."""
    microbatches: int = 4
    """Microbatches the batch is split into inside the pipeline."""
    dtype: str = "fp32"
    """Compute dtype of the workers: fp32, bf16 or fp16 (fp32 masters always)."""
    # -- optimizer and schedule ------------------------------------------------------
    optimizer: str = "adamw"
    """The optimizer algorithm: ``adamw`` (torch fused AdamW on the CPU masters) or
    ``sgd``."""
    optimizer_state: str = "fp32"
    """How the optimizer state is kept between steps (``PipeConfig.optimizer_state_dtype``,
    docs/optimizer.md): ``fp32`` (exact), ``bf16`` (half the bytes, an approximation) or
    ``int8`` (bitsandbytes' 8-bit AdamW / SGD, about a quarter; an approximation)."""
    optimizer_mode: OptimizerMode | str = OptimizerMode.SYNC
    """When it steps (:class:`rotapipe.OptimizerMode`, the pipeline's
    ``PipeConfig.optimizer_mode``): ``sync`` (after the call), ``overlap`` (exact; each
    stage stepped as its gradients land, and the next call starts while this one
    drains) or ``stale`` (the authors' one-step-stale step, calls overlapping); see
    docs/optimizer.md."""
    lr: float | None = None
    """Peak learning rate; None: 4e-3 from scratch, 2e-5 for a pretrained model, 2e-4
    with LoRA."""
    min_lr_ratio: float = 0.1
    """The cosine decays to ``lr * min_lr_ratio``, reached at the last step."""
    warmup: int | None = None
    """Linear warmup steps from lr / warmup up to lr; None: 20 from scratch, 3% of the
    steps for a pretrained model."""
    weight_decay: float | None = None
    """Decoupled weight decay (AdamW); None: 0.1 from scratch, 0 for a pretrained
    model."""
    beta1: float = 0.9
    """AdamW beta1 (SGD: momentum)."""
    beta2: float = 0.95
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (``0``: no clipping)."""
    nonfinite: NonFinite | str = NonFinite.SKIP
    """A non-finite loss or gradient: ``skip`` the step and count it (the run stops
    after ``max_skipped_steps`` skipped steps in a row) or ``raise`` (stop at once);
    :class:`rotapipe.NonFinite`. A checkpoint is never written with non-finite
    weights."""
    max_skipped_steps: int = 20
    """Stop the run after this many optimizer steps in a row were skipped (non-finite
    loss or gradients, or fp16 overflows)."""
    steps: int | None = None
    """Optimizer steps (the cosine schedule's length); None: counted from epochs, or 400
    from scratch. With epochs too, the run (and its schedule) ends at the first of the
    two limits."""
    epochs: int | None = None
    """Passes over the training data: sets steps when steps is None, or when fewer than
    steps (and stops the run after that many passes, with a last evaluation); None: 1
    for a pretrained model, no limit from scratch."""
    time_limit: float | None = None
    """Stop (and save) after this many seconds of training (``None``: no limit)."""
    # -- evaluation, checkpoints, output --------------------------------------------
    eval_interval: int = 25
    """Evaluate held-out loss and perplexity every this many steps (and at 0 and end;
    0: never)."""
    report_to: str = "none"
    """Also log the metrics to: none, tensorboard (event files in out_dir/tensorboard),
    wandb (when installed; WANDB_MODE=offline works), or both, comma-separated."""
    out_dir: str = "runs/train"
    """Output directory: metrics.jsonl, checkpoints/, final/ (the exported model)."""
    save_interval: int = 100
    """Checkpoint every this many steps (and at the end; ``0``: only at the end)."""
    keep: int = 3
    """Checkpoints kept (the oldest are deleted after a new one is complete)."""
    trace: bool = False
    """Write ``trace.json`` (Chrome/Perfetto) and ``timeline.png`` of one real step (the
    third, after warm-up, or the last of a shorter run) to ``out_dir``."""
    resume: bool | str = False
    """Continue from the latest complete checkpoint in ``out_dir`` (``True``; an error
    when there is none); ``"auto"``: continue it if there is one, else start at step 0;
    ``False``: start at step 0 (an ``out_dir`` holding checkpoints is refused)."""
    export: bool = True
    """Write the final model (or LoRA adapter) with ``save_pretrained`` to out_dir/final."""
    sample_tokens: int = 60
    """Most new tokens of the sample generated at the end (it stops at the end-of-text
    token; 0: none)."""
    sample_prompt: str | None = None
    """Prompt of the sample (a chat model: the user's message, rendered with the chat
    template); None: 'def ' from scratch, no sample for a pretrained model."""
    sample_file: str | None = None
    """A text file of further sample prompts, one per line."""
    sample_interval: int = 0
    """Also sample every this many steps (0: only at the end); samples are printed and
    kept in out_dir/samples.jsonl."""
    temperature: float = 0.0
    """Sampling temperature of the sample (0: greedy)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches
    top_p (1: all)."""
    # -- runtime ---------------------------------------------------------------------
    workers: int | None = None
    """Workers; ``None``: every CUDA GPU, else 2 emulated CPU workers."""
    backend: str = "auto"
    """``auto`` (CUDA GPUs when present), ``cuda`` or ``emulated``."""
    grain: str = "stage"
    """Backward recompute grain: ``stage`` (fast) or ``layer`` (least device memory)."""
    seed: int = 0
    """Seed of the initial weights, the data order and the dropout streams."""
    host_ram_check: bool = True
    """Refuse a run whose model state (weights, masters, optimizer state, gradients,
    ``overlap``'s undo snapshots, counted from the model built on the meta device) is
    more than the RAM available, before any weight is loaded, naming settings that fit;
    and, once the pipeline is built, one whose whole count on its plan (checkpoints and
    buffers too) does not fit, before its first step (docs/training.md, "Host RAM").
    ``False``: run anyway (swap, or memory that frees up)."""
    log_every: int = 50
    """Print a line every this many steps."""
    progress: bool = True
    """Show a tqdm progress bar (loss, tokens/s, lr, device memory) when stderr is a
    terminal; False also silences the progress bars of transformers and
    huggingface_hub."""
    dist_timeout: float = 300.0
    """Under ``torchrun`` (``WORLD_SIZE`` > 1): seconds a rank waits for a dead or hung
    peer in any collective before failing with an error naming it."""
    shard: ShardMode | str = ShardMode.NONE
    """Under ``torchrun``: what the data-parallel ranks split (:class:`rotapipe.ShardMode`):
    ``none`` (every rank holds the whole fp32 masters and optimizer state), ``optimizer``
    (each rank 1/W of them, ZeRO-1) or ``gradients`` (the accumulated gradients too,
    ZeRO-2). Checkpoints then hold one shard per rank plus the consolidated fp32
    weights; ``--resume`` works on any world size (docs/distributed.md)."""
    grad_dtype: str = "float32"
    """Under ``torchrun`` with ``shard``: the dtype gradients travel in, ``float32``
    (exact) or ``bfloat16`` (half the bytes; summed and stepped in fp32 on the owner,
    an approximation: docs/distributed.md)."""

    def __post_init__(self):
        for n in ("layers", "dim", "heads", "vocab", "seq", "eval_sequences", "batch",
                  "microbatches", "keep", "lora_rank", "tokenizer_bytes", "log_every",
                  "max_skipped_steps"):
            _integer(n, getattr(self, n))
        for n in ("kv_heads", "ffn", "epochs", "steps"):
            _integer(n, getattr(self, n), optional=True)
        for n in ("eval_interval", "save_interval", "sample_tokens", "sample_interval",
                  "seed"):
            _integer(n, getattr(self, n), minimum=0)
        _integer("warmup", self.warmup, minimum=0, optional=True)
        if self.seq < 2:
            # Else the data setup runs, and every label is ignored.
            raise ConfigError(f"seq={self.seq}: a sequence needs at least 2 tokens (one to "
                              "predict from, one to predict): use --seq 2 or more")
        check.text("model", self.model, optional=True,
                   allowed="a Hugging Face model directory or hub id")
        for n in ("resume_from_adapter", "eval_data", "sample_file", "data_config",
                  "data_split"):
            check.text(n, getattr(self, n), optional=True)
        for n in ("data", "lora_targets", "text_field", "prompt_field", "response_field",
                  "messages_field", "out_dir"):
            check.text(n, getattr(self, n))
        if self.sample_prompt is not None:
            check.text("sample_prompt", self.sample_prompt, empty=not self.sample_tokens,
                       allowed="a non-empty prompt (or sample_tokens=0)")
        sinks = [t.strip().lower() for t in str(self.report_to).split(",") if t.strip()]
        bad = [t for t in sinks if t not in REPORT_TO]
        if not isinstance(self.report_to, str) or bad or not sinks:
            raise ConfigError(f"report_to={self.report_to!r}: use {', '.join(REPORT_TO)} "
                              "or a comma-separated list (tensorboard,wandb)")
        object.__setattr__(self, "report_to", ",".join(sinks))
        if self.resume_from_adapter is not None and not self.model:
            raise ConfigError("resume_from_adapter needs model: the base model the adapter "
                              "was trained on (--model DIR --resume-from-adapter ADAPTER)")
        for n in ("lora", "qlora", "trace", "export", "progress", "host_ram_check"):
            check.boolean(n, getattr(self, n))
        if self.resume not in (True, False, "auto"):
            raise ConfigError(f"resume={self.resume!r}: use True (continue the latest "
                              "checkpoint, which must exist), 'auto' (continue it if there "
                              "is one, else start) or False")
        positive = dict(low=0, low_open=True)
        check.number("lr", self.lr, optional=True, **positive)
        check.number("temperature", self.temperature, low=0)
        check.number("top_p", self.top_p, low=0, high=1, low_open=True)
        check.number("lora_alpha", self.lora_alpha, **positive)
        check.number("holdout", self.holdout, low=0, high=1, high_open=True,
                     allowed="a fraction in [0, 1)")
        check.number("min_lr_ratio", self.min_lr_ratio, low=0, high=1)
        check.number("weight_decay", self.weight_decay, low=0, optional=True)
        check.number("beta1", self.beta1, low=0, high=1, high_open=True)
        check.number("beta2", self.beta2, low=0, high=1, high_open=True)
        check.number("grad_clip", self.grad_clip, low=0,
                     allowed="a finite norm > 0, or 0 for no clipping")
        check.number("time_limit", self.time_limit, unit="seconds", optional=True,
                     **positive)
        check.number("dist_timeout", self.dist_timeout, unit="seconds", **positive)
        if self.model is None and self.dim % self.heads:
            raise ConfigError(f"dim={self.dim} is not a multiple of heads={self.heads}")
        if self.model is None and self.kv_heads is not None and self.heads % self.kv_heads:
            raise ConfigError(f"heads={self.heads} is not a multiple of kv_heads="
                              f"{self.kv_heads}: each key/value head serves the same number "
                              "of query heads")
        if self.vocab < 260:
            raise ConfigError(f"vocab={self.vocab}: a byte-level BPE needs at least 260 "
                              "tokens (256 bytes + specials)")
        if self.batch % self.microbatches:
            fits = [m for m in range(1, self.batch + 1) if not self.batch % m]  # divisors
            k = sum(m < self.microbatches for m in fits)     # the nearest: below, above
            more = -(-self.batch // self.microbatches) * self.microbatches
            raise ConfigError(f"batch={self.batch} is not a multiple of microbatches="
                              f"{self.microbatches}: every microbatch gets the same "
                              f"number of sequences (at least one): use --microbatches "
                              f"{' or '.join(map(str, fits[max(k - 1, 0):k + 1]))}, or --batch {more}")
        for n, allowed in (("optimizer", CHOICES["optimizer"]),
                           ("optimizer_state", CHOICES["optimizer_state"]),
                           ("packing", CHOICES["packing"])):
            value = getattr(self, n)
            key = value.strip().lower() if isinstance(value, str) else value
            if key not in allowed:
                raise ConfigError(f"{n}={value!r}: use " + " or ".join(map(repr, allowed)))
            object.__setattr__(self, n, key)
        for n, kind in (("backend", BackendKind), ("grain", RecomputeGrain)):
            check.choice(kind, n, getattr(self, n))
        object.__setattr__(self, "optimizer_mode",
                           check.choice(OptimizerMode, "optimizer_mode", self.optimizer_mode))
        object.__setattr__(self, "nonfinite",
                           check.choice(NonFinite, "nonfinite", self.nonfinite))
        object.__setattr__(self, "shard", check.choice(ShardMode, "shard", self.shard))
        grad = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16",
                "bf16": "bfloat16"}.get(str(self.grad_dtype).strip().lower())
        if grad is None:
            raise ConfigError(f"grad_dtype={self.grad_dtype!r}: use 'float32' (exact) or "
                              "'bfloat16' (half the bytes, with --shard)")
        if grad == "bfloat16" and self.shard is ShardMode.NONE:
            raise ConfigError("grad_dtype='bfloat16' needs a sharded mode (the owner sums "
                              "the bf16 contributions in fp32): add --shard optimizer (or "
                              "gradients), or drop --grad-dtype")
        object.__setattr__(self, "grad_dtype", grad)
        from ..config import resolve_dtype
        try:
            resolve_dtype(self.dtype)
        except ConfigError:
            close = difflib.get_close_matches(str(self.dtype).lower(), CHOICES["dtype"], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"dtype={self.dtype!r}: use 'fp32', 'bf16' or 'fp16'"
                              f"{hint}") from None
        self.pipe_config()          # workers and the rest checked there

    # -- values that depend on the run --------------------------------------------------
    @property
    def pretrained(self) -> bool:
        """Fine-tuning a pretrained ``model`` (not training one from scratch)."""
        return self.model is not None

    @property
    def uses_lora(self) -> bool:
        return self.lora or self.resume_from_adapter is not None

    def effective(self) -> TrainConfig:
        """This config with the settings left at ``None`` filled in for the run: the
        demo's values from scratch (:data:`FROM_SCRATCH`), fine-tuning values for a
        pretrained model (:data:`PRETRAINED`). ``steps`` stays ``None`` when it is to be
        counted from ``epochs`` and the data (:meth:`with_steps`).

        LoRA without a pretrained ``model`` is refused here, where a run starts (not at
        construction: a config is also built to price ``--lora`` as a fix)."""
        if (self.lora or self.qlora) and not self.pretrained:
            name, what = ("qlora", "QLoRA") if self.qlora else ("lora", "LoRA")
            raise ConfigError(f"{name} needs model: {what} trains adapters on pretrained "
                              "base weights (--model PATH), and from scratch the base stays "
                              "random, so the exported adapter is useless without it: pass "
                              f"--model DIR (or ORG/NAME), or drop --{name} to train every "
                              "weight")
        if self.pretrained:
            fill = {"lr": PRETRAINED["lora_lr" if self.uses_lora else "lr"],
                    "weight_decay": PRETRAINED["weight_decay"]}
            if self.steps is None and self.epochs is None:
                fill["epochs"] = PRETRAINED["epochs"]
        else:
            fill = {k: FROM_SCRATCH[k] for k in ("lr", "weight_decay", "sample_prompt")}
            if self.epochs is None:
                fill["steps"] = FROM_SCRATCH["steps"]
        changes = {k: v for k, v in fill.items() if getattr(self, k) is None}
        if self.uses_lora and not self.lora:
            changes["lora"] = True
        out = dataclasses.replace(self, **changes)
        return out.with_steps(out.steps) if out.steps is not None else out

    def with_steps(self, steps: int) -> TrainConfig:
        """The config with the schedule length ``steps`` and, if unset, its warmup."""
        warmup = self.warmup
        if warmup is None:
            warmup = FROM_SCRATCH["warmup"] if not self.pretrained else \
                max(1, round(PRETRAINED["warmup_fraction"] * steps))
        return dataclasses.replace(self, steps=steps, warmup=warmup)

    # -- each component's part ---------------------------------------------------------
    def pipe_config(self) -> PipeConfig:
        """The pipeline's part: workers, microbatches, recompute grain, precision."""
        from ..config import DataParallelConfig, PipeConfig, PrecisionConfig
        return PipeConfig(workers=self.workers, microbatches=self.microbatches,
                          grain=self.grain, backend=self.backend, seed=self.seed,
                          precision=PrecisionConfig(compute_dtype=self.dtype),
                          optimizer_mode=self.optimizer_mode,
                          optimizer_state_dtype=self.optimizer_state,
                          clip_grad_norm=self.grad_clip or None,
                          nonfinite=self.nonfinite,
                          data_parallel=DataParallelConfig(timeout_s=self.dist_timeout,
                                                           shard=self.shard,
                                                           grad_dtype=self.grad_dtype))

    def replace(self, **changes) -> TrainConfig:
        """A copy with ``changes`` (validated; unknown names get a suggestion)."""
        _check_names(changes)
        return dataclasses.replace(self, **changes)


LARGEST = {"layers": 1024, "dim": 65536, "heads": 1024, "kv_heads": 1024, "ffn": 2**20,
           "vocab": 2**22, "seq": 2**20, "batch": 2**20, "microbatches": 2**20,
           "eval_sequences": 2**20, "lora_rank": 65536, "sample_tokens": 2**20,
           "tokenizer_bytes": 2**40, "epochs": 2**20}
"""The largest value of the int settings that are sizes: far beyond any real run (a
1M-token sequence, a 4M-token vocabulary, a million epochs), so that a typo fails here,
naming the field, and not in torch as an overflow or an allocation of exabytes. Every
other int setting (``steps``, ``seed``, intervals) is at most :data:`INT_LIMIT`."""
INT_LIMIT = 2**63 - 1
"""The largest int torch takes as a 64-bit signed integer (a seed, a step count)."""


def _integer(name: str, value, *, minimum: int = 1, optional: bool = False) -> None:
    """An int setting from ``minimum`` up to its :data:`LARGEST` value."""
    check.integer(name, value, minimum=minimum, optional=optional)
    largest = LARGEST.get(name, INT_LIMIT)
    if value is not None and value > largest:
        raise ConfigError(f"{name}={value}: use an int in [{minimum}, {largest:,}]")


_FLAGS_ONLY = {"recipe": "pass --recipe NAME with --config FILE on the command line (the "
                        "file's settings and the flags override the recipe's)",
               "config": "a config file does not include another; pass one --config FILE",
               "demo": "pass --demo on the command line (or no settings at all)"}


def _check_names(values: dict, where: str = "") -> None:
    names = [f.name for f in fields(TrainConfig)]
    for key in values:
        if key in _FLAGS_ONLY:                         # flags of the command, not fields
            raise ConfigError(f"{key!r}{where} is a flag of rotapipe train (--{key}), not a "
                              f"config field: {_FLAGS_ONLY[key]}")
        if key not in names:
            close = [OTHER_NAMES[key]] if key in OTHER_NAMES else \
                difflib.get_close_matches(key, names, n=1, cutoff=0.5)
            hint = f": did you mean {close[0]!r}{OTHER_MEANING.get(close[0], '')}?" \
                if close else ": see `rotapipe train --help` for the fields"
            raise ConfigError(f"unknown config field {key!r}{where}{hint}")
