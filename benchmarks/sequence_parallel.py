"""Ulysses sequence parallelism (SP=2) against none on 2 CPU ranks (gloo): activation memory per rank, measured
from live tensors, beside the memory estimator's figure.

Both runs are the same world, 2 ranks under DeepSpeed ZeRO-3 (`ds_configs/zero3.json`, fp32), `PretrainTrainer`,
one long sequence per micro-batch: SP=1 is plain ZeRO-3 data parallelism (each rank a whole row), SP=2 cuts each
row in halves, one per rank (`ParallelismConfig(sp_size=2)`). A CPU has no `max_memory_allocated`, so, as the
estimator's tests do (hf_pretrain/distributed/live_tensors.py), each rank counts every tensor alive (gc, deduplicated by
storage), here leaving out the model's parameters (ZeRO-3 gathers and frees them around every module: the same in
both runs, priced apart as `zero3_gathered`). It counts at the entry and exit of every decoder layer, at the entry
of each attention's output projection (where Ulysses' exchanged q, k, v and this rank's own are alive together)
and at the exit of the final norm: the activation peak of a step is the largest count minus the count at the
model's entry, what the decoder stack saved for backward (the loss, priced apart, is left out). Steps after the
first; the larger rank. Printed beside `estimate_memory(..., sp=...).activations`, and the ratio SP=2 / SP=1.

    python benchmarks/sequence_parallel.py [--seq 2048] [--layers 4] [--steps 2]

Counting live tensors at every module boundary is slow (a gc walk each): the step times mean nothing here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from transformers import TrainerCallback

from hf_pretrain.distributed.live_tensors import live_bytes

ROOT = Path(__file__).resolve().parents[1]
MiB = 1024**2


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per row (the whole sequence)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2, help="the first is left out of the peak")
    parser.add_argument("--sp", type=int, default=None, help=argparse.SUPPRESS)  # a launched rank's SP degree
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # a launched rank's output folder
    return parser.parse_args(argv)


def config_of(args: argparse.Namespace):
    from hf_pretrain import get_preset

    return get_preset(args.preset, num_hidden_layers=args.layers, max_position_embeddings=args.seq)


class ActivationPeaks(TrainerCallback):
    """Each step's forward activation peak (`peaks`): live bytes less the parameters' storages (gathered,
    partitioned or split), sampled at the module boundaries of the module docstring, less the count at the
    model's entry."""

    def __init__(self, model):
        self.model, self.entry, self.peak, self.peaks = model, 0, 0, []

    def activations(self) -> int:
        held = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        held |= {p.ds_tensor.untyped_storage().data_ptr() for p in self.model.parameters() if hasattr(p, "ds_tensor")}
        return live_bytes(exclude=held)

    def at_entry(self, *_):
        self.entry = self.peak = self.activations()

    def sample(self, *_):
        self.peak = max(self.peak, self.activations())

    def on_train_begin(self, *_, **__):  # after DeepSpeed replaced any linears (AutoTP): hook the live modules
        model = self.model
        model.register_forward_pre_hook(self.at_entry)
        for layer in model.model.layers:
            layer.register_forward_pre_hook(self.sample)
            layer.register_forward_hook(self.sample)
            layer.self_attn.o_proj.register_forward_pre_hook(self.sample)
        model.model.norm.register_forward_hook(self.sample)

    def on_step_end(self, *_, **__):
        self.peaks.append(self.peak - self.entry)


def worker(args: argparse.Namespace) -> None:
    """One launched rank: train `steps` steps, counting live tensors around every module; write rank-<r>.json."""
    import torch
    from accelerate import ParallelismConfig
    from datasets import Dataset

    from hf_pretrain import PretrainForCausalLM, PretrainingArguments, PretrainTrainer

    torch.manual_seed(0)
    config = config_of(args)
    rows = 2 * args.steps  # every rank a row per step: SP=1 two rows a step, SP=2 one row a step, cut in two
    data = torch.randint(3, config.vocab_size, (rows, args.seq), generator=torch.Generator().manual_seed(1)).tolist()
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
        deepspeed=str(ROOT / "ds_configs" / "zero3.json"),
        parallelism_config=ParallelismConfig(sp_size=args.sp) if args.sp > 1 else None,
    )
    model = PretrainForCausalLM(config)
    measure = ActivationPeaks(model)
    trainer = PretrainTrainer(
        model=model,
        args=training,
        train_dataset=Dataset.from_dict({"input_ids": data, "labels": data}),
        callbacks=[measure],
    )
    trainer.train()
    record = {"peaks": measure.peaks, "sp": trainer.get_sp_size(), "world": training.world_size}
    Path(args.worker, f"rank-{training.process_index}.json").write_text(json.dumps(record))


def run_ranks(script: str, label: str, argv: list[str], out: Path) -> list[dict]:
    """`script` launched on 2 ranks (torchrun) with `argv` and `--worker out`: the rank-<r>.json records."""
    out.mkdir(parents=True)
    port = 29500 + (os.getpid() + hash(label)) % 1000
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port)]
    command += [script, *argv, "--worker", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    print(f"{label}: training on 2 ranks ...", flush=True)
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"{label} run failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))]


def launch(sp: int, argv: list[str], out: Path) -> dict:
    ranks = run_ranks(__file__, f"SP={sp}", [*argv, "--sp", str(sp)], out)
    assert all(r["sp"] == sp and r["world"] == 2 for r in ranks), ranks
    return {"peak": max(max(r["peaks"][1:] or r["peaks"]) for r in ranks)}  # after the first step, the larger rank


def estimated(args: argparse.Namespace, sp: int) -> int:
    """What the estimator prices for the same forward: the decoder stack's activations per rank."""
    from hf_pretrain.distributed import estimate_memory

    return estimate_memory(config_of(args), 3, 2, "fp32", args.seq, 1, sp=sp).activations


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse(argv)
    if args.worker:
        worker(args)
        return {}
    argv = list(argv if argv is not None else sys.argv[1:])
    with tempfile.TemporaryDirectory() as tmp:
        runs = {sp: launch(sp, argv, Path(tmp) / f"sp{sp}") for sp in (1, 2)}
    for sp, run in runs.items():
        run["estimate"] = estimated(args, sp)
    print(
        f"{args.preset}, {args.layers} layers: 2 CPU ranks (gloo), DeepSpeed ZeRO-3, fp32, one row of {args.seq} "
        f"tokens per micro-batch; activation peak per rank (live tensors, parameters left out), steps 2..{args.steps}"
    )
    print(f"{'':<10}{'measured MiB':>14}{'estimated MiB':>15}{'estimate/measured':>19}")
    for sp, run in runs.items():
        print(
            f"{f'SP={sp}':<10}{run['peak'] / MiB:>14.2f}{run['estimate'] / MiB:>15.2f}{run['estimate'] / run['peak']:>19.3f}"
        )
    results = {
        "measured_ratio": runs[2]["peak"] / runs[1]["peak"],
        "estimated_ratio": runs[2]["estimate"] / runs[1]["estimate"],
        "estimate_over_measured_sp1": runs[1]["estimate"] / runs[1]["peak"],
        "estimate_over_measured_sp2": runs[2]["estimate"] / runs[2]["peak"],
    }
    print(f"{'SP=2/SP=1':<10}{results['measured_ratio']:>14.3f}{results['estimated_ratio']:>15.3f}")
    return results


if __name__ == "__main__":
    main()
