"""Launched by test_attempts_launch.py under `accelerate launch` (2 gloo ranks, no restarts): rank RANK is SIGKILLed
at the end of optimizer step STEP, as the OOM killer or a lost node would end it; nothing is relaunched.

Usage: python tests/training/killed_rank.py OUTPUT_DIR RANK STEP
"""

import os
import signal
import sys

import torch
from datasets import Dataset
from transformers import TrainerCallback

from hf_pretrain import PretrainForCausalLM, PretrainTrainer, get_preset
from tests.conftest import quick_args


class Kill(TrainerCallback):
    def __init__(self, rank: int, step: int):
        self.rank, self.step = rank, step

    def on_step_end(self, args, state, control, **kwargs):
        if args.process_index == self.rank and state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def main(output_dir: str, rank: int, step: int) -> None:
    torch.manual_seed(0)
    data = torch.randint(3, 500, (64, 16), generator=torch.Generator().manual_seed(1)).tolist()
    args = quick_args(output_dir, max_steps=step + 5, per_device_train_batch_size=2, measure_peak_tflops=False)
    model = PretrainForCausalLM(get_preset("tiny", vocab_size=512, num_hidden_layers=1))
    dataset = Dataset.from_dict({"input_ids": data, "labels": data})
    trainer = PretrainTrainer(model=model, args=args, train_dataset=dataset, callbacks=[Kill(rank, step)])
    trainer.train()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
