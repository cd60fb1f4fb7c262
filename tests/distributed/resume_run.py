"""Launched by test_multiprocess_resume.py under `accelerate launch`: a run whose epoch does not divide evenly.

Usage: python tests/distributed/resume_run.py OUTPUT_DIR PER_DEVICE_BATCH [kill:STEP | resume]
44 rows at a global micro-batch of 12: every epoch ends with a short batch that accelerate (even_batches)
completes with the epoch's first samples. Checkpoints every 3 steps, 15 steps, one dataloader worker,
spawned once per run (forked by a rank it can hang: hf_pretrain/training/processes.py).
`kill:STEP` SIGKILLs rank 1 at the end of STEP (a lost node); `resume` continues from the newest
checkpoint. Writes OUTPUT_DIR/losses-<run>-rank<r>.json with the loss of every step.
"""

import json
import os
import signal
import sys
from pathlib import Path

import torch
from datasets import Dataset
from transformers import TrainerCallback

from hf_pretrain import PretrainForCausalLM, PretrainTrainer, get_preset
from tests.conftest import quick_args

ROWS, SEQ, STEPS = 44, 32, 15


class Record(TrainerCallback):
    def __init__(self, path: Path, kill_at: int | None):
        self.path, self.kill_at, self.losses = path, kill_at, {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses[state.global_step] = logs["loss"]
            self.path.write_text(json.dumps(self.losses))

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.kill_at and args.process_index == 1:
            os.kill(os.getpid(), signal.SIGKILL)


def main(output_dir: str, per_device: int, mode: str = "") -> None:
    torch.manual_seed(0)
    data = torch.randint(3, 500, (ROWS, SEQ), generator=torch.Generator().manual_seed(1))
    args = quick_args(
        output_dir,
        max_steps=STEPS,
        per_device_train_batch_size=per_device,
        learning_rate=3e-3,
        measure_peak_tflops=False,
        telemetry=False,
        seed=0,
        save_strategy="steps",
        save_steps=3,
        dataloader_num_workers=1,
        dataloader_multiprocessing_context="spawn",
        dataloader_persistent_workers=True,
    )
    model = PretrainForCausalLM(get_preset("tiny", vocab_size=512, num_hidden_layers=2))
    run = "resumed" if mode == "resume" else "killed" if mode.startswith("kill") else "straight"
    kill_at = int(mode.split(":")[1]) if mode.startswith("kill") else None
    record = Record(Path(output_dir) / f"losses-{run}-rank{args.process_index}.json", kill_at)
    dataset = Dataset.from_dict({"input_ids": data.tolist(), "labels": data.tolist()})
    trainer = PretrainTrainer(model=model, args=args, train_dataset=dataset, callbacks=[record])
    trainer.train(resume_from_checkpoint=True if mode == "resume" else None)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "")
