"""`hf-pretrain rehearse`: argument parsing only; the runs are `run.rehearse`, the checklist `report`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .launch import PROGRESS_S, Interrupted, interrupted_by_signals, parse_launch, read_launch_file
from .report import checklist, write_markdown
from .run import RehearsalRequest, rehearse


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="hf-pretrain rehearse",
        allow_abbrev=False,
        description="Dress-rehearse a multi-node launch on this CPU: rendezvous, data sharding, checkpoint, kill -9, "
        "resume exactness, consolidated save and export, unattended recovery from a killed and a hung rank "
        "(docs/rehearse.md).",
        usage="hf-pretrain rehearse [options] (--launch-file launch.sh | accelerate launch --config_file C SCRIPT ARGS)",
    )
    parser.add_argument("--launch-file", default=None, help="a shell script holding the `accelerate launch` line")
    parser.add_argument("--out", default="rehearsal", help="output directory (default rehearsal)")
    parser.add_argument("--steps", type=int, default=12, help="steps of each run (default 12)")
    parser.add_argument("--save-steps", type=int, default=4, help="checkpoint interval (default 4)")
    parser.add_argument(
        "--kill-at", type=int, default=10, help="the step in which the last rank is killed (default 10)"
    )
    parser.add_argument("--seq-len", type=int, default=64, help="sequence length of the tiny model (default 64)")
    parser.add_argument(
        "--keep-model", action="store_true", help="run the script's model as is (no --preset/--seq_len)"
    )
    parser.add_argument("--dataset-path", default=None, help="data to rehearse on instead of the launch's")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds allowed to each run (default 300)")
    parser.add_argument(
        "--no-recovery", action="store_true", help="skip the two runs with restarts (killed, hung rank): ~2 min less"
    )
    parser.add_argument(
        "--progress-seconds",
        type=float,
        default=PROGRESS_S,
        help=f"seconds between two lines of a run's progress (default {PROGRESS_S:g})",
    )
    at = next((i for i in range(len(argv)) if argv[i : i + 2] == ["accelerate", "launch"]), len(argv))
    args, launch = parser.parse_args(argv[:at]), argv[at:]  # the launch's own flags never reach this parser
    if args.launch_file:
        if launch:
            raise ValueError("give the launch either as --launch-file or as the command, not both.")
        launch = read_launch_file(args.launch_file)
    if not launch:
        raise ValueError("no launch given: append `accelerate launch --config_file C SCRIPT ARGS` or --launch-file.")
    request = RehearsalRequest(
        launch=parse_launch(launch),
        out=Path(args.out),
        steps=args.steps,
        save_steps=args.save_steps,
        kill_at=args.kill_at,
        seq_len=args.seq_len,
        keep_model=args.keep_model,
        dataset_path=args.dataset_path,
        timeout_s=args.timeout,
        recovery=not args.no_recovery,
        progress_s=args.progress_seconds,
    )
    try:
        with interrupted_by_signals():  # SIGTERM / SIGINT / SIGHUP: the launch's whole tree ends with the rehearsal
            rehearsal = rehearse(request)
    except Interrupted as stop:
        print(f"hf-pretrain rehearse: stopped by {stop}; no process of the launch is left running.", file=sys.stderr)
        return 128 + stop.signum
    write_markdown(rehearsal)
    print(checklist(rehearsal))
    return 0 if rehearsal.passed else 1
