"""Step time with all of hf_pretrain's callbacks against none, on the CPU default (tiny preset).

Rounds alternate ABBA between `PretrainTrainer` with extras and telemetry on (throughput/MFU,
sensors, under-clock, straggler, JSONL) and with `pretrain_extras=False` (plain Trainer behaviour),
on the same model shape and data; prints the mean step times, the overhead ratio (goal: <= 1.01)
and its spread: the ratio of each round's two runs, min to max (on a shared machine the spread
says how far one ratio can be trusted). On a CPU it also prints the ratio of the process's CPU time
per step (`time.process_time`): the callbacks' cost is CPU work, and CPU time is what a machine
shared with other jobs does not inflate. benchmarks/gpu/telemetry_overhead.py runs the same on a
GPU (wall time of synchronised steps).

Why the mean over whole windows, not the median step: the callbacks put most of their cost on a
few steps on purpose. The straggler callback times its linears on the last 3 steps of each
`--straggler-every` window only and exchanges at its end; the JSONL, sensor and console work runs
at each `--logging-steps` step. A median step is one of the others, so it hides exactly the costs
being judged. Each run therefore times `--steps` steps after `--warmup`, a whole number of
straggler windows and of logging intervals (checked), and the per-step figure is their total time
divided by their number: every sampled and logging step is counted as often as a long run has it.

    OMP_NUM_THREADS=1 python benchmarks/telemetry_overhead.py [--rounds 4] [--steps 40]
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time

import torch
from transformers import PrinterCallback, TrainerCallback

from hf_pretrain import PretrainForCausalLM, PretrainingArguments, PretrainTrainer, get_preset
from hf_pretrain.data import PackedDocumentCollator


class StepTimer(TrainerCallback):
    """Time from one step's start to the next one's, for the steps after the first `warmup`: the other callbacks'
    step-end work, logging and the JSONL writes of the step all fall inside its interval. On a GPU the step is
    synchronised first, so that the interval is the device's work, not the host's enqueue."""

    def __init__(self, warmup: int = 1):
        self.warmup = warmup
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self._start = None

    def on_step_begin(self, args, state, control, **kwargs):
        if args.device.type == "cuda":
            torch.cuda.synchronize(args.device)
        now = (time.perf_counter(), time.process_time())
        if self._start is not None and state.global_step > self.warmup:  # the interval of step `global_step`
            self.times.append(now[0] - self._start[0])
            self.cpu_times.append(now[1] - self._start[1])
        self._start = now


def check_whole_windows(steps: int, straggler_every: int, logging_steps: int) -> None:
    """Refuse a step count that is not a whole number of straggler windows and logging intervals: a mean over part
    of a window over- or under-counts the steps that carry the sampled costs."""
    period = math.lcm(straggler_every, logging_steps)
    if steps <= 0 or steps % period:
        raise ValueError(
            f"--steps {steps} is not a whole number of straggler windows ({straggler_every}) and logging intervals "
            f"({logging_steps}): use a multiple of {period}"
        )


def time_steps(
    extras: bool,
    data,
    steps: int,
    preset: str = "tiny",
    batch: int = 8,
    straggler_every: int = 20,
    logging_steps: int = 10,
    warmup: int = 1,
    **arguments,
) -> dict:
    """Seconds of each of `steps` optimizer steps of `preset` on `data` (rows of token ids) after `warmup` steps,
    extras on or off: {"wall": wall-clock seconds, "cpu": the process's CPU seconds}. `steps` is a whole number of
    straggler windows and logging intervals (`check_whole_windows`); one more step runs to end the last interval."""
    check_whole_windows(steps, straggler_every, logging_steps)
    torch.manual_seed(0)
    timer = StepTimer(warmup)
    with tempfile.TemporaryDirectory() as out:
        args = PretrainingArguments(
            output_dir=out,
            max_steps=warmup + steps + 1,
            per_device_train_batch_size=batch,
            logging_steps=logging_steps,
            straggler_every=straggler_every,
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
    assert len(timer.times) == steps, (len(timer.times), steps)  # exactly the whole windows, no partial one
    return {"wall": timer.times, "cpu": timer.cpu_times}


def rows_needed(steps: int, batch: int, warmup: int = 1) -> int:
    """Rows of data for one `time_steps` run: one epoch, so no data loader restarts inside the timed steps."""
    return batch * (warmup + steps + 1)


def overhead(rounds: int, run) -> dict:
    """`run(extras)` -> {clock: step times of whole windows}, alternated ABBA over `rounds`; per clock: the mean step
    times (total time / steps), their ratio, and the spread of the per-round ratios (each round's mean with
    callbacks / its mean without)."""
    times: dict = {}
    for round_index in range(rounds):
        means: dict = {}
        for extras in (True, False) if round_index % 2 == 0 else (False, True):
            for clock, steps in run(extras).items():
                times.setdefault(clock, {True: [], False: [], "ratios": []})[extras] += steps
                means.setdefault(clock, {})[extras] = statistics.fmean(steps)
        for clock, pair in means.items():
            times[clock]["ratios"].append(pair[True] / pair[False])
    result = {}
    for clock, t in times.items():
        on, off = statistics.fmean(t[True]), statistics.fmean(t[False])
        result[clock] = {"on": on, "off": off, "ratio": on / off, "round_ratios": t["ratios"], "steps": len(t[True])}
    return result


def describe(result: dict, clock: str = "wall") -> str:
    spread = result["round_ratios"]
    return (
        f"{clock}: with callbacks {result['on'] * 1e3:.1f} ms/step, without {result['off'] * 1e3:.1f} ms/step "
        f"(means over whole windows), overhead ratio {result['ratio']:.3f} (rounds {min(spread):.3f}-"
        f"{max(spread):.3f}; {result['steps']} steps each)"
    )


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40, help="timed steps per run: whole windows (default 40)")
    parser.add_argument("--straggler-every", type=int, default=20, help="straggler window (the library's default)")
    parser.add_argument("--logging-steps", type=int, default=10)
    a = parser.parse_args(argv)
    check_whole_windows(a.steps, a.straggler_every, a.logging_steps)
    ids = torch.randint(3, 4096, (rows_needed(a.steps, 8), 256))
    data = [{"input_ids": row} for row in ids.tolist()]
    windows = dict(straggler_every=a.straggler_every, logging_steps=a.logging_steps)
    result = overhead(a.rounds, lambda extras: time_steps(extras, data, a.steps, **windows))
    setting = f"tiny, seq 256, batch 8, CPU fp32, straggler every {a.straggler_every}, logging every {a.logging_steps}"
    for clock in ("wall", "cpu"):
        print(f"{setting}, {describe(result[clock], clock)}")
    return result["wall"]["ratio"]


if __name__ == "__main__":
    main()
