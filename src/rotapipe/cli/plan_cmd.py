"""``rotapipe plan``: whether a run fits a machine (device and host memory), with which
partition and how fast (:mod:`rotapipe.planner.advise`); exit code 3 when it does not."""

from __future__ import annotations

import argparse

from .._validate import PLAN_LIMITS, real_flag as _real
from ..errors import ConfigError
from .exits import EXIT_NO_FIT, EXIT_OK
from .flags import _hardware, _lora, _model_name

MAX_HOST_RAM_GB = PLAN_LIMITS["host_ram"].high / 1e9
"""``plan --host-ram`` above this (a petabyte per server) is a typo, not a machine; below
1 GB neither (and under a byte it read as no value: the default RAM)."""


def _limit(name: str):
    """The flag type of the planner input ``name`` (:data:`~rotapipe._validate.PLAN_LIMITS`:
    ``rotapipe plan`` and :func:`rotapipe.planner.analyze` accept the same values)."""
    return PLAN_LIMITS[name].flag_type()


def _plan_arguments(p: argparse.ArgumentParser) -> None:
    from ..plan.hardware import MIN_EFFICIENCY

    a = p.add_argument
    what = ("config.json path, a Hugging Face model folder, or a known name (qwen3-1.7b, "
            "llama-3.1-8b, qwen3-32b, qwen3-235b-a22b)")
    a("model", nargs="?", default=None, help=what + "; the same as --model")
    a("--model", dest="model_flag", metavar="MODEL", default=None,
      help="the model, as in train and simulate")
    a("--hardware", default="rtx4090x8",
      help="DEVICExN: rtx4090, a100, a800, h100-pcie (default: rtx4090x8)")
    a("--seq", type=_limit("seq"), default=2048, help="tokens per sequence (default: 2048)")
    a("--global-batch", type=_limit("global_batch"), default=16, help="sequences per step (default: 16)")
    a("--microbatches", type=_limit("microbatches"), default=None,
      help="microbatches per step (default: the planner tries every divisor of the "
           "global batch up to 64)")
    a("--lora", action="store_true", help="LoRA fine-tuning instead of full fine-tuning")
    a("--lora-rank", type=_limit("lora_rank"), default=None,
      help="LoRA rank, with --lora or --qlora (default: 8, as train)")
    a("--qlora", action="store_true",
      help="QLoRA: LoRA on a frozen base held and uploaded as NF4 (implies --lora)")
    a("--layout", choices=("sync", "overlap", "lean", "stale"), default=None,
      help="host layout of the optimizer side (docs/memory.md; default: stale with "
           "--stale, else the first of sync and lean that fits the host RAM)")
    a("--prefetch", type=_limit("prefetch"), default=1,
      help="PipeConfig.prefetch: stages whose weights are uploaded ahead, counted "
           "in device memory beside each stage and in the lean layout's gradient "
           "count (default: 1)")
    a("--optimizer-state", choices=("fp32", "bf16", "int8"), default="fp32",
      help="how the optimizer state is kept (PipeConfig.optimizer_state_dtype, "
           "docs/optimizer.md; default: fp32)")
    a("--host-ram", type=_real(1.0, MAX_HOST_RAM_GB, low_open=False, unit="GB"),
      default=None, help="host RAM in GB, in [1, 1e6] (default: 64 GB per device, at "
      "least 128)")
    a("--stale", action="store_true",
      help="plan for the one-step-stale optimizer (overlapping steps)")
    a("--optimizer-rate", type=_limit("optimizer_rate"), default=None,
      help="host optimizer throughput in parameters per second, in [1e6, 1e15], for each "
           "optimizer mode's step (default: 5e9, fused CPU AdamW on a server)")
    a("--modes", action="store_true",
      help="also simulate the steady state of pipelined overlap and stale calls on the "
           "plan (sync is always priced)")
    a("--clip", action="store_true",
      help="price the optimizer modes with a global-norm clip (clip_grad_norm: the "
           "whole step at the last hand-off)")
    a("--efficiency", type=_real(MIN_EFFICIENCY, 1.0, low_open=False), default=None,
      help="fraction of peak TFLOPS layers reach, in [0.01, 1] (default: 0.6)")
    a("--fp16-accumulate", action="store_true",
      help="fp16 math with fp16 accumulation (2x on GeForce cards)")
    a("--memory-fraction", type=_limit("memory_fraction"), default=0.9,
      help="share of device memory the plan may use, in [0.01, 1] (default: 0.9)")
    a("--pin", choices=("copy", "register", "off"), default="register",
      help="host memory mode of the weights, as PipeConfig.pin: page-locked by a copy, "
           "page-locked in place, or pageable behind bounce buffers (default: register, "
           "the CUDA default)")
    a("--copy-chunk-mb", type=_limit("chunk_mb"), default=32.0,
      help="bounce-buffer chunk in MiB with --pin off, as PipeConfig.copy_chunk_mb, in "
           "[0.01, 65536] (default: 32)")
    a("--nodes", type=_limit("nodes"), default=1,
      help="data-parallel servers (default: 1); host RAM is then per server, for each "
           "DataParallelConfig.shard mode")
    a("--network-gbps", type=_limit("network_gbps"), default=25.0,
      help="link rate between servers in Gb/s, in [0.01, 1e5], for the communication "
           "time per step (default: 25)")
    a("--inflight-mb", type=_limit("inflight_mb"), default=100.0,
      help="with --nodes: MiB of gradient buffers each server keeps in flight before "
           "the backward waits, as DataParallelConfig.inflight_mb, in [0.01, 1e6] "
           "(default: 100, 4 x bucket_mb)")
    a("--grad-dtype", choices=("float32", "bfloat16"), default="float32",
      help="with --nodes: dtype the sharded modes send gradients in, as "
           "DataParallelConfig.grad_dtype (default: float32)")
    a("--json", action="store_true", help="print one JSON object instead of text")


def plan(args: argparse.Namespace) -> int:
    """Plan a model on a hardware profile; print the verdict, partition and prediction.
    Exit code 0 when it fits, :data:`EXIT_NO_FIT` (3) when it does not."""
    import json

    from ..plan.hostmem import GB
    from ..planner.advise import analyze

    if (args.model is None) == (args.model_flag is None):
        raise ConfigError("give the model once: rotapipe plan --model MODEL (or rotapipe "
                          "plan MODEL)" + (", not both" if args.model else ""))
    model = _model_name(args.model or args.model_flag)
    lora = _lora(args)
    hw = _hardware(args)
    result = analyze(model, hw, seq=args.seq, global_batch=args.global_batch,
                     lora_rank=args.lora_rank if lora else None,
                     qlora=args.qlora, layout=args.layout, prefetch=args.prefetch,
                     optimizer_state=args.optimizer_state,
                     host_ram=int(args.host_ram * GB) if args.host_ram is not None else None,
                     microbatches=args.microbatches, stale=args.stale,
                     memory_fraction=args.memory_fraction, pin=args.pin,
                     chunk_mb=args.copy_chunk_mb, nodes=args.nodes,
                     network_gbps=args.network_gbps, inflight_mb=args.inflight_mb,
                     grad_dtype=args.grad_dtype, modes=args.modes, clip=args.clip,
                     **({} if args.optimizer_rate is None else
                        {"optimizer_rate": args.optimizer_rate}))
    print(json.dumps(result.as_dict(), indent=2) if args.json else result.to_text())
    return EXIT_OK if result.fits else EXIT_NO_FIT
