"""Muon against AdamW on the embedded default run: held-out loss at equal steps and at equal wall-clock.

Runs `examples/pretrain.py` (the `tiny` preset on the embedded corpus, its defaults: 300 steps,
lr 3e-3, cosine, weight decay 0.1) with AdamW, then with `--optim muon` (Muon for the hidden
matrices at the same lr with the RMS-matching rule, AdamW for the rest), all in this process on the
same cached data and seed. When Muon's training took longer than AdamW's, a third run gives Muon the
steps that fit in AdamW's wall-clock (same warmup, its schedule over those steps). Prints each run's
held-out loss and training seconds, Muon - AdamW in nats/token and the time ratio.

    python benchmarks/muon.py                       # the default: about 3 x 4 min on 2 CPU cores
    python benchmarks/muon.py --muon-flags --muon_adjust_lr original --muon_lr 0.02
    python benchmarks/muon.py --steps 4 --seq-len 64   # a smoke run (tests/test_benchmarks.py)
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def example_module():
    spec = importlib.util.spec_from_file_location("pretrain_example", ROOT / "examples" / "pretrain.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def run(example, workdir: Path, name: str, flags: list[str]) -> dict:
    summary = example.main(["--output_dir", str(workdir / name), "--data_cache_dir", str(workdir / "data"), *flags])
    print(
        f"[{name}] held-out loss {summary['heldout_loss']:.4f} nats/token, trained in {summary['train_seconds']:.1f} s"
    )
    return summary


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--workdir", default=None, help="Default: a temporary folder.")
    parser.add_argument("--muon-flags", nargs=argparse.REMAINDER, default=[], help="Extra flags of the Muon runs.")
    args = parser.parse_args(argv)
    example = example_module()
    common = [
        "--max_steps",
        str(args.steps),
        "--seq_len",
        str(args.seq_len),
        "--logging_steps",
        str(max(args.steps // 6, 1)),
    ]
    common += ["--warmup_steps", str(max(args.steps // 10, 1)), "--measure_peak_tflops", "False"]
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(args.workdir or tmp)
        adamw = run(example, workdir, "adamw", common)
        muon = run(example, workdir, "muon", [*common, "--optim", "muon", *args.muon_flags])
        time_ratio = muon["train_seconds"] / adamw["train_seconds"]
        equal_time = muon
        if time_ratio > 1.0:
            steps = max(int(args.steps / time_ratio), 1)
            flags = [*common, "--max_steps", str(steps), "--optim", "muon", *args.muon_flags]
            equal_time = run(example, workdir, f"muon-{steps}-steps", flags)
    result = {
        "time_ratio": time_ratio,
        "equal_steps_difference": muon["heldout_loss"] - adamw["heldout_loss"],
        "equal_time_difference": equal_time["heldout_loss"] - adamw["heldout_loss"],
        "equal_time_seconds_ratio": equal_time["train_seconds"] / adamw["train_seconds"],
    }
    print(
        f"Muon / AdamW training time at {args.steps} steps: {time_ratio:.3f}x\n"
        f"held-out loss, Muon - AdamW, equal steps:      {result['equal_steps_difference']:+.4f} nats/token\n"
        f"held-out loss, Muon - AdamW, equal wall-clock: {result['equal_time_difference']:+.4f} nats/token "
        f"(Muon's run {result['equal_time_seconds_ratio']:.3f}x AdamW's time)"
    )
    return result


if __name__ == "__main__":
    main()
