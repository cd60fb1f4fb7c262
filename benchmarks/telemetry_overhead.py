"""Step time with all of hf_pretrain's callbacks against none, on the CPU default (tiny preset).

Rounds alternate ABBA between `PretrainTrainer` with extras and telemetry on (throughput/MFU,
sensors, under-clock, straggler, JSONL; logging every 10 steps) and with `pretrain_extras=False`
(plain Trainer behaviour), on the same model shape and data; prints the median step times and
the overhead ratio (goal: <= 1.01).

    python benchmarks/telemetry_overhead.py [--rounds 4] [--steps 30]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from datasets import Dataset
from transformers import PrinterCallback, TrainerCallback

from hf_pretrain import PretrainForCausalLM, PretrainingArguments, PretrainTrainer, get_preset
from hf_pretrain.data import PackedDocumentCollator


class StepTimer(TrainerCallback):
    """Time from one step's start to the next one's: the other callbacks' step-end work, logging and
    the JSONL writes of the previous step all fall inside it (the first interval is warm-up)."""

    def __init__(self):
        self.times: list[float] = []
        self._start = None

    def on_step_begin(self, args, state, control, **kwargs):
        now = time.perf_counter()
        if self._start is not None and state.global_step > 1:
            self.times.append(now - self._start)
        self._start = now


def time_steps(extras: bool, data, steps: int) -> list[float]:
    torch.manual_seed(0)
    timer = StepTimer()
    with tempfile.TemporaryDirectory() as out:
        args = PretrainingArguments(
            output_dir=out,
            max_steps=steps + 1,
            per_device_train_batch_size=8,
            logging_steps=10,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            pretrain_extras=extras,
            attn_fallback="ignore",
        )
        trainer = PretrainTrainer(
            model=PretrainForCausalLM(get_preset("tiny")),
            args=args,
            train_dataset=data,
            data_collator=PackedDocumentCollator(2),
            callbacks=[timer],
        )
        trainer.remove_callback(PrinterCallback)
        trainer.train()
    return timer.times


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    a = parser.parse_args(argv)
    ids = torch.randint(3, 4096, (8 * (a.steps + 1), 256))
    data = Dataset.from_dict({"input_ids": ids.tolist()})
    times = {True: [], False: []}
    for round_index in range(a.rounds):
        for extras in (True, False) if round_index % 2 == 0 else (False, True):
            times[extras] += time_steps(extras, data, a.steps)
    on, off = statistics.median(times[True]), statistics.median(times[False])
    print(
        f"tiny, seq 256, batch 8, CPU fp32: with callbacks {on * 1e3:.1f} ms/step, without {off * 1e3:.1f} ms/step, "
        f"overhead ratio {on / off:.3f} ({len(times[True])} steps each)"
    )
    return on / off


if __name__ == "__main__":
    main()
