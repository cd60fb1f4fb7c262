"""DeepSpeed AutoTP (TP=2) against none on 2 CPU ranks (gloo) under ZeRO-1: model states and activation memory per
rank, measured from live tensors, beside the memory estimator's figures (`estimate_memory(..., tp=...)`).

Both runs are 2 ranks of `PretrainTrainer` under `ds_configs/zero1_autotp.json` (fp32), one row of `--seq` tokens
per rank and step: TP=1 drops its `tensor_parallel` block (ZeRO-1 data parallelism over the 2 ranks), TP=2 keeps
it (one TP group: both ranks train the same row, each with half of every attention and MLP linear, ZeRO-1 over a
data-parallel group of 1). Counted on each rank with `live_bytes` (hf_pretrain/distributed/live_tensors.py):
- model states: every tensor alive right after the engine's backward and when the optimizer's step begins (a
  global step pre-hook), the activations freed at both, less what was alive before the model was built: weights,
  gradients, Adam's states and DeepSpeed's buffers; the larger of the two points, as `tests/distributed/
  ds_inventory.py` counts them. Priced as `parameters + gradients + optimizer_states` (fp32: no separate fp32
  gradient partition). The last step's (Adam's states exist from the second).
- activations: `ActivationPeaks` of benchmarks/sequence_parallel.py (the decoder stack's forward peak, parameters
  left out, the loss priced apart), steps after the first; priced as `activations`.
The larger rank of each. Printed with the ratios estimate / measured and TP=2 / TP=1.

    python benchmarks/tensor_parallel.py [--seq 1024] [--layers 4] [--steps 2]

Counting live tensors at every module boundary is slow (a gc walk each): the step times mean nothing here.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the checkout's benchmarks package (and hf_pretrain) first
    sys.path.insert(0, str(ROOT))

from benchmarks.sequence_parallel import ActivationPeaks, config_of, run_ranks  # noqa: E402

MiB = 1024**2


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--seq", type=int, default=1024, help="tokens per row")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2, help="the first is left out of the activation peak")
    parser.add_argument("--tp", type=int, default=None, help=argparse.SUPPRESS)  # a launched rank's TP degree
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # a launched rank's output folder
    return parser.parse_args(argv)


def deepspeed_config(tp: int) -> dict:
    """ds_configs/zero1_autotp.json with `autotp_size` = tp (TP=1: without its `tensor_parallel` block)."""
    config = json.loads((ROOT / "ds_configs" / "zero1_autotp.json").read_text())
    if tp == 1:
        del config["tensor_parallel"]
    else:
        config["tensor_parallel"]["autotp_size"] = tp
    return config


def worker(args: argparse.Namespace) -> None:
    """One launched rank: train `steps` steps counting live tensors; write rank-<r>.json."""
    import torch
    from datasets import Dataset
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    from transformers import TrainerCallback

    from hf_pretrain import PretrainForCausalLM, PretrainingArguments, PretrainTrainer
    from hf_pretrain.distributed.live_tensors import live_bytes
    from hf_pretrain.training.tensor_parallel import tensor_parallel_size

    torch.manual_seed(0)
    config = config_of(args)
    data = torch.randint(3, config.vocab_size, (2 * args.steps, args.seq), generator=torch.Generator().manual_seed(1))
    dataset = Dataset.from_dict({"input_ids": data.tolist(), "labels": data.tolist()})
    training = PretrainingArguments(
        output_dir=args.worker,
        max_steps=args.steps,
        per_device_train_batch_size=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=args.steps,
        telemetry=False,
        measure_peak_tflops=False,
        memory_preflight="ignore",
        seed=0,
        deepspeed=deepspeed_config(args.tp),
    )
    baseline = live_bytes()
    model = PretrainForCausalLM(config)
    backward, step = [], []
    register_optimizer_step_pre_hook(lambda *_: step.append(live_bytes() - baseline))
    measure = ActivationPeaks(model)

    class AfterBackward(TrainerCallback):
        def on_train_begin(self, *_, **__):  # the engine's backward (accelerate calls its step right after)
            engine = trainer.accelerator.deepspeed_engine_wrapped.engine
            inner = engine.backward

            def counted(*a, **k):
                out = inner(*a, **k)
                backward.append(live_bytes() - baseline)
                return out

            engine.backward = counted

    trainer = PretrainTrainer(model=model, args=training, train_dataset=dataset, callbacks=[measure, AfterBackward()])
    trainer.train()
    states = [max(b, s) for b, s in zip(backward, step)]  # the larger of the two points of each step
    record = {"peaks": measure.peaks, "states": states, "backward": backward, "step": step}
    record["tp"] = tensor_parallel_size(trainer)
    record["parameters"] = sum(p.numel() for p in model.parameters())
    Path(args.worker, f"rank-{training.process_index}.json").write_text(json.dumps(record))


def measured(tp: int, argv: list[str], out: Path) -> dict:
    ranks = run_ranks(__file__, f"TP={tp}", [*argv, "--tp", str(tp)], out)
    assert len(ranks) == 2 and all(r["tp"] == tp for r in ranks), ranks
    return {
        "states": max(r["states"][-1] for r in ranks),
        "backward": max(r["backward"][-1] for r in ranks),
        "step": max(r["step"][-1] for r in ranks),
        "activations": max(max(r["peaks"][1:] or r["peaks"]) for r in ranks),  # after the first step
        "parameters": max(r["parameters"] for r in ranks),
    }


def estimated(args: argparse.Namespace, tp: int) -> dict:
    from hf_pretrain.distributed import estimate_memory
    from hf_pretrain.distributed.memory import tp_parameters

    e = estimate_memory(config_of(args), 1, 2, "fp32", args.seq, 1, tp=tp)
    states = e.parameters + e.gradients + e.optimizer_states
    return {"states": states, "activations": e.activations, "parameters": tp_parameters(config_of(args), tp)}


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse(argv)
    if args.worker:
        worker(args)
        return {}
    argv = list(argv if argv is not None else sys.argv[1:])
    with tempfile.TemporaryDirectory() as tmp:
        runs = {tp: measured(tp, argv, Path(tmp) / f"tp{tp}") for tp in (1, 2)}
    estimates = {tp: estimated(args, tp) for tp in runs}
    print(
        f"{args.preset}, {args.layers} layers: 2 CPU ranks (gloo), DeepSpeed ZeRO-1, fp32, one row of {args.seq} "
        f"tokens per rank and step; per rank (the larger), live tensors"
    )
    print(f"{'':<26}{'measured MiB':>14}{'estimated MiB':>15}{'estimate/measured':>19}")
    results = {}
    for key, what in (("states", "model states (peak)"), ("activations", "activations (peak)")):
        for tp in runs:
            m, e = runs[tp][key], estimates[tp][key]
            print(f"{f'TP={tp} {what}':<26}{m / MiB:>14.2f}{e / MiB:>15.2f}{e / m:>19.3f}")
            results[f"{key}_estimate_over_measured_tp{tp}"] = e / m
        m, e = runs[2][key] / runs[1][key], estimates[2][key] / estimates[1][key]
        print(f"{f'TP=2/TP=1 {what}':<26}{m:>14.3f}{e:>15.3f}")
        results[f"{key}_measured_ratio"], results[f"{key}_estimated_ratio"] = m, e
    for tp, run in runs.items():
        print(
            f"TP={tp} model states after backward / in the step: {run['backward'] / MiB:.2f} / {run['step'] / MiB:.2f} MiB"
        )
    counted = [(runs[tp]["parameters"], estimates[tp]["parameters"]) for tp in runs]
    print(
        "parameters per rank (model / tp_parameters): "
        + ", ".join(f"TP={tp}: {m:,} / {e:,}" for tp, (m, e) in zip(runs, counted))
    )
    return results


if __name__ == "__main__":
    main()
