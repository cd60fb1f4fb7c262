"""DDP against FSDP2 on 2 CPU ranks (gloo): step time and per-rank memory, measured in one run.

Each strategy trains the same model on the same random batches under `PretrainTrainer`, launched with
`accelerate launch --config_file examples/accelerate_configs/cpu_2proc.yaml` (DDP) or `cpu_2proc_fsdp2.yaml`
(FSDP2, `fully_shard` per decoder layer), one after the other. Per rank it records the median step time
(steps after the first two), the model-state bytes this rank holds when the optimizer has just stepped
(its parameters, gradients and AdamW states: a DTensor counts its local shard) and the growth of the peak RSS
from before the model was built. Prints both and the ratios FSDP2 / DDP.

    python benchmarks/fsdp2.py [--preset tiny] [--hidden 256] [--layers 4] [--vocab 8192] [--seq 128]
                               [--batch 4] [--steps 12]

On a CPU the all-gathers and reduce-scatters go through gloo on loopback: the time ratio measures FSDP2's
communication against DDP's one all-reduce, not a GPU's overlap.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"DDP": "cpu_2proc.yaml", "FSDP2": "cpu_2proc_fsdp2.yaml"}


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # output folder of a launched rank
    return parser.parse_args(argv)


def local_bytes(tensor) -> int:
    tensor = getattr(tensor, "_local_tensor", tensor)  # a DTensor: this rank's shard
    return tensor.numel() * tensor.element_size()


def worker(args: argparse.Namespace) -> None:
    """One launched rank: train, then write rank-<r>.json into the output folder."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback

    from hf_pretrain import PretrainForCausalLM, PretrainingArguments, PretrainTrainer, get_preset

    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    torch.manual_seed(0)
    rows = 2 * args.batch * args.steps
    data = torch.randint(0, args.vocab, (rows, args.seq), generator=torch.Generator().manual_seed(1)).tolist()
    config = get_preset(
        args.preset,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers,
        vocab_size=args.vocab,
        max_position_embeddings=args.seq,
    )
    seen: dict = {"times": []}

    class Measure(TrainerCallback):
        def on_step_begin(self, *_, **__):
            seen["start"] = time.perf_counter()

        def on_optimizer_step(self, state_args, state, control, model=None, optimizer=None, **kwargs):
            params = list(model.parameters())
            states = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
            grads = [p.grad for p in params if p.grad is not None]
            seen["model_state_bytes"] = sum(local_bytes(t) for t in params + grads + states)

        def on_step_end(self, *_, **__):
            seen["times"].append(time.perf_counter() - seen["start"])

    training = PretrainingArguments(
        output_dir=args.worker,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=args.steps,
        telemetry=False,
        measure_peak_tflops=False,
        seed=0,
    )
    trainer = PretrainTrainer(
        model=PretrainForCausalLM(config),
        args=training,
        train_dataset=Dataset.from_dict({"input_ids": data, "labels": data}),
        callbacks=[Measure()],
    )
    trainer.train()
    record = {
        "step_s": statistics.median(seen["times"][2:]),
        "model_state_bytes": seen["model_state_bytes"],
        "rss_growth_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before,
        "parameters": sum(p.numel() for p in PretrainForCausalLM(config).parameters()),
    }
    Path(args.worker, f"rank-{training.process_index}.json").write_text(json.dumps(record))


def launch(name: str, argv: list[str], out: Path) -> dict:
    config = ROOT / "examples" / "accelerate_configs" / CONFIGS[name]
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    command += ["--main_process_port", str(29500 + os.getpid() % 1000), __file__, *argv, "--worker", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise RuntimeError(f"{name} run failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))]
    return {key: max(r[key] for r in ranks) for key in ranks[0]}  # the slowest / largest rank


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse(argv)
    if args.worker:
        worker(args)
        return {}
    argv = list(argv if argv is not None else sys.argv[1:])
    with tempfile.TemporaryDirectory() as tmp:
        runs = {name: launch(name, argv, Path(tmp) / name) for name in CONFIGS}
    MiB = 1024**2
    print(
        f"{args.preset}: h {args.hidden}, {args.layers} layers, vocab {args.vocab}, "
        f"{runs['DDP']['parameters'] / 1e6:.2f} M parameters; 2 CPU ranks (gloo), fp32, seq {args.seq} x batch "
        f"{args.batch} per rank, {args.steps} steps"
    )
    print(f"{'':<18}{'step ms (median)':>18}{'model states MiB/rank':>24}{'peak RSS growth MiB/rank':>27}")
    for name, run in runs.items():
        print(
            f"{name:<18}{run['step_s'] * 1e3:>18.1f}{run['model_state_bytes'] / MiB:>24.2f}"
            f"{run['rss_growth_bytes'] / MiB:>27.1f}"
        )
    ratios = {key: runs["FSDP2"][key] / runs["DDP"][key] for key in ("step_s", "model_state_bytes", "rss_growth_bytes")}
    print(
        f"{'ratio FSDP2/DDP':<18}{ratios['step_s']:>18.3f}{ratios['model_state_bytes']:>24.3f}"
        f"{ratios['rss_growth_bytes']:>27.3f}"
    )
    return ratios


if __name__ == "__main__":
    main()
