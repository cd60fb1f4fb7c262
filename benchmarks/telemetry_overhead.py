"""Step time with all of hf_pretrain's callbacks against none, on the CPU default (tiny preset).

Rounds alternate ABBA between `PretrainTrainer` with extras and telemetry on (throughput/MFU,
sensors, under-clock, straggler, JSONL; logging every 10 steps) and with `pretrain_extras=False`
(plain Trainer behaviour), on the same model shape and data; prints the median step times, the
overhead ratio (goal: <= 1.01) and its spread: the ratio of each round's two runs, min to max (on a
shared machine the spread says how far one ratio can be trusted). On a CPU it also prints the ratio
of the process's CPU time per step (`time.process_time`): the callbacks' cost is CPU work, and CPU
time is what a machine shared with other jobs does not inflate. benchmarks/gpu/telemetry_overhead.py
runs the same on a GPU (wall time of synchronised steps).

    OMP_NUM_THREADS=1 python benchmarks/telemetry_overhead.py [--rounds 4] [--steps 30]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from transformers import PrinterCallback, TrainerCallback

from hf_pretrain import PretrainForCausalLM, PretrainingArguments, PretrainTrainer, get_preset
from hf_pretrain.data import PackedDocumentCollator


class StepTimer(TrainerCallback):
    """Time from one step's start to the next one's: the other callbacks' step-end work, logging and
    the JSONL writes of the previous step all fall inside it (the first interval is warm-up). On a GPU
    the step is synchronised first, so that the interval is the device's work, not the host's enqueue."""

    def __init__(self):
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self._start = None

    def on_step_begin(self, args, state, control, **kwargs):
        if args.device.type == "cuda":
            torch.cuda.synchronize(args.device)
        now = (time.perf_counter(), time.process_time())
        if self._start is not None and state.global_step > 1:
            self.times.append(now[0] - self._start[0])
            self.cpu_times.append(now[1] - self._start[1])
        self._start = now


def time_steps(extras: bool, data, steps: int, preset: str = "tiny", batch: int = 8, **arguments) -> dict:
    """Seconds of each of `steps` optimizer steps of `preset` on `data` (rows of token ids), extras on or off:
    {"wall": wall-clock seconds, "cpu": the process's CPU seconds}."""
    torch.manual_seed(0)
    timer = StepTimer()
    with tempfile.TemporaryDirectory() as out:
        args = PretrainingArguments(
            output_dir=out,
            max_steps=steps + 1,
            per_device_train_batch_size=batch,
            logging_steps=10,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            pretrain_extras=extras,
            attn_fallback="ignore",
            **arguments,
        )
        trainer = PretrainTrainer(
            model=PretrainForCausalLM(get_preset(preset)),
            args=args,
            train_dataset=data,
            data_collator=PackedDocumentCollator(2),
            callbacks=[timer],
        )
        trainer.remove_callback(PrinterCallback)
        trainer.train()
    return {"wall": timer.times, "cpu": timer.cpu_times}


def overhead(rounds: int, run) -> dict:
    """`run(extras)` -> {clock: step times}, alternated ABBA over `rounds`; per clock: median step times, their
    ratio, and the spread of the per-round ratios (each round's median with callbacks / its median without)."""
    times: dict = {}
    for round_index in range(rounds):
        medians: dict = {}
        for extras in (True, False) if round_index % 2 == 0 else (False, True):
            for clock, steps in run(extras).items():
                times.setdefault(clock, {True: [], False: [], "ratios": []})[extras] += steps
                medians.setdefault(clock, {})[extras] = statistics.median(steps)
        for clock, pair in medians.items():
            times[clock]["ratios"].append(pair[True] / pair[False])
    result = {}
    for clock, t in times.items():
        on, off = statistics.median(t[True]), statistics.median(t[False])
        result[clock] = {"on": on, "off": off, "ratio": on / off, "round_ratios": t["ratios"], "steps": len(t[True])}
    return result


def describe(result: dict, clock: str = "wall") -> str:
    spread = result["round_ratios"]
    return (
        f"{clock}: with callbacks {result['on'] * 1e3:.1f} ms/step, without {result['off'] * 1e3:.1f} ms/step, "
        f"overhead ratio {result['ratio']:.3f} (rounds {min(spread):.3f}-{max(spread):.3f}; "
        f"{result['steps']} steps each)"
    )


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    a = parser.parse_args(argv)
    ids = torch.randint(3, 4096, (8 * (a.steps + 1), 256))
    data = [{"input_ids": row} for row in ids.tolist()]
    result = overhead(a.rounds, lambda extras: time_steps(extras, data, a.steps))
    for clock in ("wall", "cpu"):
        print(f"tiny, seq 256, batch 8, CPU fp32, {describe(result[clock], clock)}")
    return result["wall"]["ratio"]


if __name__ == "__main__":
    main()
