"""`hf-pretrain estimate-memory`: the memory estimator (`distributed/memory.py`) on the command line.

An application, like `trial.py` and `plan/`: it reads the presets and the estimator, nothing below imports it.
"""

from __future__ import annotations

import argparse
import json

from .chips import known_chips
from .distributed.memory import PRECISIONS, check_tp, estimate_memory
from .distributed.memory_format import format_estimate


def cli(argv: list[str]) -> int:
    """`hf-pretrain estimate-memory`: prints the table (or JSON); exit status 1 when it does not fit the device."""
    from .presets import PRESETS, load_config

    parser = argparse.ArgumentParser(
        prog="hf-pretrain estimate-memory",
        description="Per-GPU memory of training a preset under ZeRO 0-3 (formulas: docs/memory.md).",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", choices=sorted(PRESETS), help="a size preset")
    source.add_argument("--config", help="a preset name, saved model directory or config.json")
    parser.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0, help="ZeRO stage (default 0: DDP)")
    parser.add_argument("--gpus", type=int, default=1, help="data-parallel GPUs the states are partitioned over")
    parser.add_argument("--precision", choices=PRECISIONS, default="bf16")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default: max_position_embeddings)")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per GPU per forward")
    parser.add_argument("--offload", action="store_true", help="DeepSpeed CPU offload (optimizer; ZeRO-3: weights)")
    parser.add_argument(
        "--fsdp2", action="store_true", help="FSDP2 (fully_shard) instead of DeepSpeed: implies --zero 3"
    )
    parser.add_argument(
        "--checkpointing",
        type=int,
        nargs="?",
        const=1,
        default=0,
        metavar="K",
        help="activation checkpointing of every layer, or of every K-th layer (transformers' every_n_layers)",
    )
    parser.add_argument(
        "--no-flash-attention", action="store_true", help="a kernel that keeps the s x s softmax (eager)"
    )
    parser.add_argument(
        "--sp", type=int, default=1, help="Ulysses sequence-parallel degree: 1/SP of each sequence per GPU (default 1)"
    )
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        help="DeepSpeed AutoTP degree: 1/TP of the attention and MLP linears per GPU, ZeRO over GPUS/TP (default 1)",
    )
    parser.add_argument("--device", default=None, help=f"GPU name, one of {known_chips('memory')}")
    parser.add_argument("--device-memory-gb", type=float, default=None, help="device memory in GiB (overrides)")
    parser.add_argument("--json", action="store_true", help="print the estimate as JSON (bytes)")
    args = parser.parse_args(argv)
    if args.fsdp2 and args.zero not in (0, 3):
        parser.error(f"--fsdp2 shards everything, like ZeRO-3: drop --zero {args.zero}")
    name = args.preset or args.config
    seq = args.seq or load_config(name).max_position_embeddings
    if args.sp < 1 or args.gpus % args.sp or seq % args.sp:
        parser.error(f"--sp {args.sp} must divide --gpus {args.gpus} and the sequence length {seq}")
    try:
        check_tp(args.tp, args.gpus, 3 if args.fsdp2 else args.zero, args.fsdp2, args.sp)
    except ValueError as error:
        flags = str(error)  # the estimator's argument names as the command's flags
        for name in ("tp", "sp", "gpus", "zero"):
            flags = flags.replace(f"{name}=", f"--{name} ")
        parser.error(flags)
    estimate = estimate_memory(
        load_config(name),
        3 if args.fsdp2 else args.zero,
        args.gpus,
        args.precision,
        args.seq,
        args.micro_batch,
        args.offload,
        {0: False, 1: True}.get(args.checkpointing, args.checkpointing),
        not args.no_flash_attention,
        device=args.device,
        device_memory_gb=args.device_memory_gb,
        model=name,
        fsdp2=args.fsdp2,
        sp=args.sp,
        tp=args.tp,
    )
    print(json.dumps(estimate.to_dict(), indent=2) if args.json else format_estimate(estimate))
    return 1 if estimate.fits is False else 0
