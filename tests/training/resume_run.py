"""Run by test_resume.py in its own process (so it can be killed mid-save): a short run with checkpoints.

Usage: [SLOW_SAVE=STEP:SECONDS] python -m tests.training.resume_run OUTPUT_DIR MAX_STEPS EXTRAS(0|1) [RESUME(0|1)]
Writes OUTPUT_DIR/losses-<n>.json: {step: loss} of this process.
"""

import json
import os
import sys
from pathlib import Path

import torch
from transformers import TrainerCallback

from hf_pretrain import PretrainForCausalLM, PretrainTrainer
from tests.conftest import quick_args, small_config
from tests.training.faults import SlowSaveTrainer
from tests.training.test_trainer import dataset


class StepLosses(TrainerCallback):
    def __init__(self):
        self.losses = {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses[state.global_step] = logs["loss"]


def main(output_dir: str, max_steps: int, extras: bool, resume: bool = False) -> dict:
    torch.manual_seed(0)
    args = quick_args(
        output_dir,
        max_steps=max_steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        save_strategy="steps",
        save_steps=5,
        save_total_limit=1,
        measure_peak_tflops=False,
        pretrain_extras=extras,
        seed=3,
    )
    losses = StepLosses()
    step, _, seconds = os.environ.get("SLOW_SAVE", "").partition(":")  # set by the test that kills a save
    args.async_checkpoint = not step  # the killed save is a synchronous one (test_async_checkpoint: the others)
    model, data = PretrainForCausalLM(small_config()), dataset()
    if step:
        trainer = SlowSaveTrainer(model=model, args=args, train_dataset=data, slow_save=(int(step), float(seconds)))
    else:
        trainer = PretrainTrainer(model=model, args=args, train_dataset=data)
    trainer.add_callback(losses)
    trainer.train(resume_from_checkpoint=True if resume else None)
    runs = len(list(Path(output_dir).glob("losses-*.json")))
    Path(output_dir, f"losses-{runs}.json").write_text(json.dumps(losses.losses))
    return losses.losses


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", len(sys.argv) > 4 and sys.argv[4] == "1")
