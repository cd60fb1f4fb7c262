"""Run by test_trainer.py: one DeepSpeed process (ZeRO-2, or the config given) started without a launcher, then a
resume. Prints the bytes the last save copied into host memory beside the estimate that admitted it.

Usage: python -m tests.training.deepspeed_one_process OUTPUT_DIR MAX_STEPS [resume] [--config ds_configs/zero3.json]
"""

import sys

import torch
from transformers import default_data_collator

from hf_pretrain import PretrainForCausalLM, PretrainTrainer
from tests.conftest import quick_args, small_config
from tests.training.test_trainer import dataset

if __name__ == "__main__":
    config = sys.argv.pop(sys.argv.index("--config") + 1) if "--config" in sys.argv else "ds_configs/zero2.json"
    sys.argv = [a for a in sys.argv if a != "--config"]
    torch.manual_seed(0)
    args = quick_args(
        sys.argv[1],
        max_steps=int(sys.argv[2]),
        per_device_train_batch_size=4,
        measure_peak_tflops=False,
        telemetry=False,
        deepspeed=config,
        save_strategy="steps",
        save_steps=2,
    )
    model = PretrainForCausalLM(small_config())
    trainer = PretrainTrainer(model=model, args=args, train_dataset=dataset(), data_collator=default_data_collator)
    trainer.train(resume_from_checkpoint=len(sys.argv) > 3)
    print(f"trained to step {trainer.state.global_step}")
    saves = trainer.checkpointing
    print(f"staged {saves.background.staged_total} estimated {saves.staged_estimate}")
