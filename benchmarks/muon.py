"""Muon against AdamW on the embedded default run: held-out loss at equal steps and at equal wall-clock.

Two measurements in one run:
1. Step time. A training step (forward, backward, optimizer step) of the `tiny` preset at the run's
   batch shape, AdamW and Muon alternating (`--repeats` each, medians), each optimizer made by
   `PretrainTrainer.create_optimizer` as in training. Alternating steps in one process keep the
   ratio honest on a shared machine, where a whole run's wall-clock moves with the neighbours' load.
2. Held-out loss. `examples/pretrain.py` (embedded corpus, `tiny` preset, its defaults: lr 3e-3,
   cosine, weight decay 0.1, batch 16) with AdamW, then with `--optim muon` (Muon for the hidden
   matrices at the same lr with the RMS-matching rule, AdamW for the rest), same data and seed; when
   Muon's step is slower, a third run gives Muon the steps that fit in AdamW's time
   (steps / step-time ratio; same warmup, its schedule over those steps).
Prints the step-time ratio, each run's held-out loss, and Muon - AdamW in nats/token.

    python benchmarks/muon.py                       # the default: 300 steps at seq 256
    python benchmarks/muon.py --steps 150 --seq-len 64 --muon-flags --muon_adjust_lr original --muon_lr 0.02
    python benchmarks/muon.py --steps 4 --seq-len 32 --repeats 2   # a smoke run (tests/test_benchmarks.py)
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from hf_pretrain import PretrainForCausalLM, PretrainingArguments, PretrainTrainer, get_preset

ROOT = Path(__file__).resolve().parents[1]


def example_module():
    spec = importlib.util.spec_from_file_location("pretrain_example", ROOT / "examples" / "pretrain.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def step_seconds(workdir: Path, batch: int, seq_len: int, repeats: int) -> dict[str, float]:
    """Median seconds of a training step with each optimizer, the two alternating."""
    torch.manual_seed(0)
    ids = torch.randint(0, 4096, (batch, seq_len))
    steppers = {}
    for name in ("adamw", "muon"):
        args = PretrainingArguments(
            output_dir=str(workdir / f"step-{name}"),
            optim=name if name == "muon" else "adamw_torch",
            report_to="none",
            learning_rate=3e-3,
        )
        model = PretrainForCausalLM(get_preset("tiny"))
        steppers[name] = (model, PretrainTrainer(model=model, args=args).create_optimizer())
    times = {name: [] for name in steppers}
    for i in range(repeats + 1):  # the first round warms up
        for name, (model, optimizer) in steppers.items():
            start = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if i:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


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
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=10, help="Timed steps per optimizer.")
    parser.add_argument("--workdir", default=None, help="Default: a temporary folder.")
    parser.add_argument("--muon-flags", nargs=argparse.REMAINDER, default=[], help="Extra flags of the Muon runs.")
    args = parser.parse_args(argv)
    example = example_module()
    common = ["--max_steps", str(args.steps), "--seq_len", str(args.seq_len), "--per_device_train_batch_size"]
    common += [str(args.batch), "--logging_steps", str(max(args.steps // 6, 1)), "--measure_peak_tflops", "False"]
    common += ["--warmup_steps", str(max(args.steps // 10, 1))]
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(args.workdir or tmp)
        seconds = step_seconds(workdir, args.batch, args.seq_len, args.repeats)
        ratio = seconds["muon"] / seconds["adamw"]
        print(f"[step] AdamW {seconds['adamw']:.3f} s, Muon {seconds['muon']:.3f} s: Muon / AdamW {ratio:.3f}x")
        adamw = run(example, workdir, "adamw", common)
        muon = run(example, workdir, "muon", [*common, "--optim", "muon", *args.muon_flags])
        equal_time, steps = muon, args.steps
        if ratio > 1.0:
            steps = max(int(args.steps / ratio), 1)
            flags = [*common, "--max_steps", str(steps), "--optim", "muon", *args.muon_flags]
            equal_time = run(example, workdir, f"muon-{steps}-steps", flags)
    result = {
        "step_time_ratio": ratio,
        "equal_steps_difference": muon["heldout_loss"] - adamw["heldout_loss"],
        "equal_time_difference": equal_time["heldout_loss"] - adamw["heldout_loss"],
    }
    print(
        f"held-out loss, Muon - AdamW, equal steps ({args.steps}):        {result['equal_steps_difference']:+.4f} nats/token\n"
        f"held-out loss, Muon - AdamW, equal wall-clock ({steps} vs {args.steps}): "
        f"{result['equal_time_difference']:+.4f} nats/token"
    )
    return result


if __name__ == "__main__":
    main()
