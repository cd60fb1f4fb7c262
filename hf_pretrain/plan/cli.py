"""`hf-pretrain plan`: argument parsing only; the logic is `planner.make_plan` and `output.write_plan`."""

from __future__ import annotations

import argparse
import re

from .hardware import PLANNED_RECIPES
from .output import table, write_plan
from .planner import DEFAULT_MARGIN, PlanRequest, make_plan

SUFFIXES = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def amount(text: str) -> float:
    """A positive number with an optional k / M / B (G) / T suffix: 1e9, 1.5B, 300M, 2T."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?\d+)?)\s*([kmbgt]?)\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (e.g. 2e9, 1.5B, 300M, 2T)")
    return float(match.group(1)) * SUFFIXES[match.group(2)]


class OneLineErrors(argparse.ArgumentParser):
    """A bad flag ends as one line naming it (`error: argument --network-gbps: invalid float value: 'x'`), as the
    planner's own refusals do: `hf_pretrain.cli.main` prints a ValueError as one line, exit status 2."""

    def error(self, message: str):
        raise ValueError(f"{message} (hf-pretrain plan --help)")


def cli(argv: list[str]) -> int:
    parser = OneLineErrors(
        prog="hf-pretrain plan",
        description="Budget and hardware in; a compute-optimal run that fits memory out (docs/plan.md).",
    )
    hardware = parser.add_argument_group("hardware")
    hardware.add_argument("--device", required=True, help="chip name: h100, h200, a100, gb10, b200, ... (chips.py)")
    hardware.add_argument("--gpus", type=int, default=1, help="GPUs per node (default 1)")
    hardware.add_argument("--nodes", type=int, default=1, help="machines (default 1)")
    hardware.add_argument("--trial", default=None, help="trial.json of `hf-pretrain trial` on this chip: measured MFU")
    hardware.add_argument("--mfu", type=float, default=None, help="MFU to assume (default: per chip, source printed)")
    hardware.add_argument("--peak-tflops", type=float, default=None, help="dense peak per GPU, for unknown chips")
    hardware.add_argument("--device-memory-gb", type=float, default=None, help="memory per GPU in GiB (overrides)")
    hardware.add_argument(
        "--link-gbps", type=float, default=None, help="GB/s each way from a GPU to its node (overrides chips.py)"
    )
    hardware.add_argument(
        "--network-gbps",
        type=float,
        default=None,
        help="GB/s each way per GPU between nodes (a node's NICs / its GPUs; 8 x 400 Gb/s NDR for 8 GPUs: 50); "
        "default: unknown, and traffic across nodes is not weighed",
    )
    budget = parser.add_argument_group("budget (exactly one)").add_mutually_exclusive_group(required=True)
    budget.add_argument("--hours", type=float, default=None, help="wall-clock hours on all the GPUs")
    budget.add_argument("--tokens", type=amount, default=None, help="tokens to train, e.g. 20B")
    budget.add_argument("--flops", type=amount, default=None, help="training FLOPs, e.g. 1e21")
    model = parser.add_argument_group("model and data")
    model.add_argument("--data-tokens", type=amount, default=None, help="unique tokens of data available, e.g. 10B")
    model.add_argument("--params", type=amount, default=None, help="fix the model size, e.g. 1.5B")
    model.add_argument("--seq-len", type=int, default=2048)
    model.add_argument("--tokens-per-param", type=float, default=20.0, help="Chinchilla's ~20 (default)")
    model.add_argument("--vocab-size", type=int, default=65536)
    model.add_argument("--window-pattern", default="L", help="e.g. SSSL (sliding-window layers), default L (none)")
    model.add_argument("--sliding-window", type=int, default=None, help="window of S layers, in tokens")
    run = parser.add_argument_group("run")
    run.add_argument("--precision", choices=PLANNED_RECIPES, default=None, help="default: the trial's pick, else bf16")
    run.add_argument("--sharding", choices=("deepspeed", "fsdp2"), default="deepspeed", help="when DDP does not fit")
    run.add_argument("--schedule", choices=("cosine_restarts", "wsd"), default="cosine_restarts")
    run.add_argument("--margin", type=float, default=DEFAULT_MARGIN, help="memory kept free, fraction of the device")
    run.add_argument(
        "--checkpoint-seconds", type=float, default=None, help="one save's stall (default: estimated, async save)"
    )
    run.add_argument(
        "--mtbf-hours", type=float, default=None, help="the job's mean time between failures (default: Llama 3's rate)"
    )
    run.add_argument(
        "--goodput-from", default=None, metavar="RUN", help="a run dir: its measured save stall and failure rate"
    )
    run.add_argument("--out", default="plan", help="directory for plan.json and the launch files (default plan)")
    run.add_argument("--dataset-path", default="DATA_PATH", help="the data the launch command trains on")
    run.add_argument("--run-dir", default="runs/plan", help="the launch command's --output_dir")
    args = parser.parse_args(argv)
    request = PlanRequest(
        device=args.device,
        gpus=args.gpus,
        nodes=args.nodes,
        hours=args.hours,
        tokens=args.tokens,
        flops=args.flops,
        data_tokens=args.data_tokens,
        params=args.params,
        seq_len=args.seq_len,
        tokens_per_param=args.tokens_per_param,
        mfu=args.mfu,
        trial=args.trial,
        precision=args.precision,
        vocab_size=args.vocab_size,
        window_pattern=args.window_pattern,
        sliding_window=args.sliding_window,
        sharding=args.sharding,
        schedule=args.schedule,
        margin=args.margin,
        peak_tflops=args.peak_tflops,
        device_memory_gb=args.device_memory_gb,
        link_gbps=args.link_gbps,
        network_gbps=args.network_gbps,
        checkpoint_seconds=args.checkpoint_seconds,
        mtbf_hours=args.mtbf_hours,
        goodput_from=args.goodput_from,
    )
    plan = make_plan(request)
    files = write_plan(plan, args.out, args.dataset_path, args.run_dir)
    print(table(plan))
    print(f"files      {', '.join(str(path) for path in files.values())}")
    print(f"launch     {files['launch'].read_text().splitlines()[-1]}")
    return 0
