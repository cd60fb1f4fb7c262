"""Launched by test_downstream_training.py under `accelerate launch` (2 gloo ranks): 2 training steps of the tiny
model with the downstream suite at the end, then the model saved.

Usage: downstream_run.py OUTPUT_DIR [DEEPSPEED_CONFIG]
Writes OUTPUT_DIR/rank-<r>.json: the figures this rank ended with, its evaluation forwards, its share of the batches,
whether the weights were sharded; saves the full model to OUTPUT_DIR/model.
"""

import json
import sys

from transformers import default_data_collator

from hf_pretrain import PretrainTrainer
from hf_pretrain.evaluation.downstream.callback import DownstreamEvalCallback
from hf_pretrain.evaluation.generation_probe import is_sharded
from tests.conftest import quick_args
from tests.evaluation.downstream_models import bpe_tokenizer, tiny_model, training_rows


def main(out: str, deepspeed: str | None = None) -> None:
    tokenizer = bpe_tokenizer()
    args = quick_args(
        out, max_steps=2, per_device_train_batch_size=2, measure_peak_tflops=False, telemetry=False, deepspeed=deepspeed
    )
    model = tiny_model()
    forwards = []
    model.register_forward_pre_hook(lambda module, inputs: None if module.training else forwards.append(1))
    suite = DownstreamEvalCallback("arc_easy,piqa", examples=24, batch_tokens=512)  # several batches to share out
    trainer = PretrainTrainer(
        model=model,
        args=args,
        train_dataset=training_rows(tokenizer, rows=8),
        data_collator=default_data_collator,
        processing_class=tokenizer,
        callbacks=[suite],
    )
    trainer.train()
    batches = suite.evaluator.batches(trainer.model)
    record = {
        "figures": suite.last.tasks,
        "forwards": len(forwards),
        "batches": len(batches[args.process_index :: args.world_size]),
        "all_batches": len(batches),
        "sharded": is_sharded(trainer.model, args),
    }
    with open(f"{out}/rank-{args.process_index}.json", "w") as f:
        json.dump(record, f)
    trainer.save_model(f"{out}/model")
    if args.process_index == 0:
        tokenizer.save_pretrained(f"{out}/model")
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main(*sys.argv[1:])
