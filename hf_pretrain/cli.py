"""`hf-pretrain` command line: thin wrappers over library functions that the tests call directly.

hf-pretrain doctor --config 0.9b --seq-len 2048 --dtype bf16 --packed
torchrun --nproc_per_node 2 -m hf_pretrain.cli doctor --distributed
hf-pretrain advise-restart --elapsed-hours 24 --remaining-hours 144 --speedup 20% --hours-since-checkpoint 1
hf-pretrain report runs/tiny
hf-pretrain trial --config gpt2-124m --recipes bf16,fp8,te-fp8,te-nvfp4 --steps 30 --warmup-steps 5
hf-pretrain data clean|filter|dedup|train-tokenizer|pack|prepare ...   (see hf_pretrain/data/cli.py)
hf-pretrain estimate-memory --preset llama2-7b --zero 3 --gpus 8 --seq 8192 --micro-batch 1 --device H100
hf-pretrain plan --device h100 --gpus 8 --hours 24 --data-tokens 20B   (see hf_pretrain/plan/)
hf-pretrain rehearse accelerate launch --config_file two_nodes.yaml examples/pretrain.py   (hf_pretrain/rehearse/)
hf-pretrain eval runs/tiny --tasks hellaswag,arc_easy,piqa --limit 500   (hf_pretrain/evaluation/downstream/)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

DTYPES = ("bf16", "fp16", "fp32")  # torch dtypes by name: the package imports torch only in the commands that run it


def doctor(argv: list[str]) -> int:
    if "--distributed" in argv:  # every rank of a launched job: versions, GPUs, rendezvous, links
        from .distributed.doctor import run_doctor

        parser = argparse.ArgumentParser(prog="hf-pretrain doctor --distributed")
        parser.add_argument("--distributed", action="store_true")
        parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the rendezvous")
        parser.add_argument("--megabytes", type=float, default=4.0, help="size of the timed all-reduce")
        args = parser.parse_args(argv)
        return run_doctor(args.timeout, args.megabytes)
    parser = argparse.ArgumentParser(
        prog="hf-pretrain doctor", description="Attention preflight for a config on this machine."
    )
    parser.add_argument("--config", required=True, help="preset name, saved model directory or config.json")
    parser.add_argument("--seq-len", type=int, default=None, help="context length (default: max_position_embeddings)")
    parser.add_argument(
        "--dtype", choices=DTYPES, default=None, help="compute dtype (default: bf16 on CUDA, else fp32)"
    )
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--packed", action="store_true", help="batches hold several documents per row")
    parser.add_argument("--inference", action="store_true", help="plan for inference instead of training")
    parser.add_argument("--attention-backend", default=None, help="override the config's attention_backend")
    parser.add_argument(
        "--capability",
        default=None,
        help="plan for a CUDA GPU of this compute capability (e.g. 9.0 for H100/H200), not this machine",
    )
    parser.add_argument(
        "--assume-kernels",
        default=None,
        help="with --capability: kernel packages to assume installed, e.g. flash_attn,flash_attn_interface",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    import torch

    from .modeling.attention import Environment
    from .preflight.attention import attention_preflight
    from .presets import load_config

    config = load_config(args.config)
    if args.attention_backend:
        config.attention_backend = args.attention_backend
    device = "cuda" if args.capability else args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
        args.dtype or ("bf16" if device == "cuda" else "fp32")
    ]
    env = Environment.detect(device, dtype, training=not args.inference)
    if args.capability:
        major, _, minor = args.capability.partition(".")
        assumed = set(filter(None, (args.assume_kernels or "").split(",")))
        kernels = {k: ("assumed" if k in assumed else v) for k, v in env.kernel_versions.items()}
        env = dataclasses.replace(env, capability=(int(major), int(minor or 0)), kernel_versions=kernels)
    elif device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA GPU here; pass --capability X.Y to plan for a target GPU.")
    report = attention_preflight(config, args.seq_len or config.max_position_embeddings, env, args.packed)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.table())
    return 1 if report.warnings else 0


def advise_restart_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="hf-pretrain advise-restart", description="Continue, restart or resume on a faster path?"
    )
    parser.add_argument("--elapsed-hours", type=float, required=True)
    parser.add_argument("--remaining-hours", type=float, required=True)
    parser.add_argument("--speedup", required=True, help="of the faster path: 20%%, 0.2 (20%% faster), 1.2x or 2x")
    parser.add_argument("--hours-since-checkpoint", type=float, default=0.0, help="work a resume repeats (default 0)")
    parser.add_argument("--overhead-hours", type=float, default=0.0, help="time to set up a restart")
    args = parser.parse_args(argv)
    from .plan.restart import advise_restart

    advice = advise_restart(
        args.elapsed_hours, args.remaining_hours, args.speedup, args.hours_since_checkpoint, args.overhead_hours
    )
    print(advice.table())
    return 0


def report(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="hf-pretrain report", description="PNG + HTML dashboard of a run's telemetry."
    )
    parser.add_argument("run_dir", help="the output_dir of a run (holds telemetry.jsonl)")
    parser.add_argument("--out", default=None, help="where to write report.png / report.html (default: run_dir)")
    args = parser.parse_args(argv)
    from .report import render_report

    try:
        png, page = render_report(args.run_dir, args.out)
    except FileNotFoundError as err:
        raise ValueError(str(err)) from err
    print(f"wrote {png} and {page}")
    from .report.dashboard import format_mixture
    from .report.goodput import goodput_summary
    from .report.summary import summary_table
    from .telemetry.jsonl import read_jsonl

    records = read_jsonl(args.run_dir)
    print(summary_table(Path(args.run_dir), records))  # the page's table: what the run measured, on the console
    if mixture := format_mixture(records):
        print(mixture)
    if summary := goodput_summary(records):
        print(summary)
    return 0


def trial(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="hf-pretrain trial", description="Short side-by-side run of precision recipes."
    )
    parser.add_argument("--config", required=True, help="preset name, saved model directory or config.json")
    parser.add_argument(
        "--recipes", default="bf16,fp8,te-fp8,te-nvfp4", help="comma-separated, the first is the baseline"
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--seq-len", type=int, default=None, help="default: the config's max_position_embeddings")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument(
        "--loss-tolerance", type=float, default=0.05, help="nats; recipes this close to the best loss qualify"
    )
    parser.add_argument(
        "--loss-window", type=int, default=5, help="the final loss is the mean of this many last logged losses"
    )
    parser.add_argument("--out", default="trial", help="output directory for trial.json / trial.md")
    parser.add_argument("--torch-compile", action="store_true", help="compile the model in every recipe")
    args = parser.parse_args(argv)
    from .trial import run_trial, to_markdown

    result = run_trial(
        args.config,
        [r.strip() for r in args.recipes.split(",") if r.strip()],
        args.steps,
        args.warmup_steps,
        args.seq_len,
        args.batch_size,
        args.out,
        args.loss_tolerance,
        torch_compile=args.torch_compile,
        loss_window=args.loss_window,
    )
    print(to_markdown(result))
    print(f"wrote {args.out}/trial.json and {args.out}/trial.md")
    return 0 if result["recommendation"] else 1


def plot_schedule_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hf-pretrain plot-schedule", description="PNG of a learning-rate schedule.")
    parser.add_argument("--type", choices=["cosine_restarts", "wsd"], default="cosine_restarts")
    parser.add_argument("--total-tokens", type=float, required=True, help="e.g. 100e9")
    parser.add_argument("--tokens-per-step", type=float, default=None, help="adds an optimizer-step axis")
    parser.add_argument("--warmup", type=float, default=0.008, help="fraction of the run (default 0.8 %%)")
    parser.add_argument("--peak-lr", type=float, default=3e-4)
    parser.add_argument("--floor", type=float, default=0.1, help="fraction of the peak at the end")
    parser.add_argument(
        "--restart", action="append", default=[], help="AT_TOKENS:REBOUND[:WARMUP_TOKENS], e.g. 30e9:0.3"
    )
    parser.add_argument("--decay-fraction", type=float, default=0.2, help="wsd: the decaying tail")
    parser.add_argument("--shape", default="1-sqrt", help="wsd decay: linear, cosine, 1-sqrt")
    parser.add_argument("--out", default="schedule.png")
    args = parser.parse_args(argv)
    from .training.schedules import Restart, cosine_restarts_factor, plot_schedule, wsd_factor

    total, warmup = args.total_tokens, args.warmup * args.total_tokens
    if args.type == "wsd":
        factor = lambda t: wsd_factor(t, total, warmup, args.decay_fraction, args.floor, args.shape)  # noqa: E731
    else:
        restarts = [Restart(*map(float, r.split(":"))) for r in args.restart]
        factor = lambda t: cosine_restarts_factor(t, total, warmup, args.floor, restarts)  # noqa: E731
    title = f"{args.type}: peak {args.peak_lr:g}, warmup {args.warmup:.1%}, floor {args.floor:.0%} of peak"
    title += f", restarts {', '.join(args.restart)}" if args.restart and args.type != "wsd" else ""
    title += f", decay {args.decay_fraction:.0%} {args.shape}" if args.type == "wsd" else ""
    print(f"wrote {plot_schedule(factor, total, args.peak_lr, args.out, args.tokens_per_step, title)}")
    return 0


def estimate_memory_cli(argv: list[str]) -> int:
    from .estimate_memory import cli

    return cli(argv)


def plan_cli(argv: list[str]) -> int:
    from .plan.cli import cli

    return cli(argv)


def rehearse_cli(argv: list[str]) -> int:
    from .rehearse.cli import cli

    return cli(argv)


def eval_cli(argv: list[str]) -> int:
    from .evaluation.downstream.cli import cli
    from .evaluation.downstream.data import MissingTaskData

    try:
        return cli(argv)
    except MissingTaskData as err:  # a FileNotFoundError whose message names the install command: one error line
        raise ValueError(str(err)) from err


def data_cli(argv: list[str]) -> int:
    from .data.cli import main as data_main

    return data_main(argv)


AFTER_INTERRUPT = {  # what a relaunch of the command does with the work done so far
    "data": "run the same command again: it reuses every task that completed.",
    "trial": "run it again: each recipe runs anew.",
    "eval": "run it again: the scores are computed anew.",
}
COMMANDS = {
    "doctor": doctor,
    "advise-restart": advise_restart_cli,
    "report": report,
    "trial": trial,
    "plot-schedule": plot_schedule_cli,
    "data": data_cli,
    "estimate-memory": estimate_memory_cli,
    "plan": plan_cli,
    "rehearse": rehearse_cli,
    "eval": eval_cli,
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    usage = f"usage: hf-pretrain {{{','.join(COMMANDS)}}} [options]   (hf-pretrain COMMAND --help)"
    if argv[:1] in (["--help"], ["-h"]):
        print(usage + "\n\n" + __doc__.split("\n\n", 1)[1].split('"""')[0].strip())
        return 0
    if not argv or argv[0] not in COMMANDS:
        print(usage, file=sys.stderr)
        return 2
    try:
        return COMMANDS[argv[0]](argv[1:])
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback; 130 as a shell reports SIGINT
        print(
            f"interrupted: hf-pretrain {argv[0]} stopped by Ctrl-C; {AFTER_INTERRUPT.get(argv[0], '')}", file=sys.stderr
        )
        return 130


if __name__ == "__main__":
    sys.exit(main())
