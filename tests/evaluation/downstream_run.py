"""Launched by test_downstream_training.py under `accelerate launch` (2 gloo ranks): 2 training steps of the tiny
model with the downstream suite and a generation probe at the end, then the model saved (one launch serves both
evaluations' checks under sharded weights).

Usage: downstream_run.py OUTPUT_DIR [DEEPSPEED_CONFIG]
Writes OUTPUT_DIR/rank-<r>.json: the figures this rank ended with, its evaluation forwards, its share of the batches
(and of each task's requests; under AutoTP its TP group's share), the TP degree,
whether the weights were sharded, the probe's `generate` calls (their `synced_gpus`) and the steps it logged; saves the full model to OUTPUT_DIR/model.
"""

import json
import sys
from collections import Counter

from transformers import default_data_collator

from hf_pretrain import PretrainTrainer
from hf_pretrain.evaluation.downstream.callback import DownstreamEvalCallback
from hf_pretrain.evaluation.generation_probe import GenerationProbeCallback, is_sharded, split_linear_ranks
from tests.conftest import quick_args
from tests.evaluation.downstream_models import bpe_tokenizer, tiny_model, training_rows


def main(out: str, deepspeed: str | None = None) -> None:
    tokenizer = bpe_tokenizer()
    args = quick_args(
        out, max_steps=2, per_device_train_batch_size=2, measure_peak_tflops=False, telemetry=False, deepspeed=deepspeed
    )
    model = tiny_model()
    forwards, generate_calls, generating, generate = [], [], [], model.generate

    def counted_generate(*args, **kwargs):  # the probe's calls, their forwards not counted as the suite's
        generate_calls.append(kwargs.get("synced_gpus"))
        generating.append(True)
        try:
            return generate(*args, **kwargs)
        finally:
            generating.pop()

    model.register_forward_pre_hook(
        lambda module, inputs: None if module.training or generating else forwards.append(1)
    )
    model.generate = counted_generate
    # several batches to share out; a progress line after each (rank 0's share only)
    suite = DownstreamEvalCallback("arc_easy,piqa", examples=24, batch_tokens=512, progress_s=0)
    probe = GenerationProbeCallback(["The cat", "A dog"], every_n_steps=1, max_new_tokens=3)
    trainer = PretrainTrainer(
        model=model,
        args=args,
        train_dataset=training_rows(tokenizer, rows=8),
        data_collator=default_data_collator,
        processing_class=tokenizer,
        callbacks=[suite, probe],
    )
    trainer.train()
    batches = suite.evaluator.batches(trainer.model)
    tp = split_linear_ranks(trainer.model)  # AutoTP: the batches are shared out by TP group (data rank = rank // tp)
    group, groups = args.process_index // tp, args.world_size // tp
    record = {
        "figures": suite.last.tasks,
        "forwards": len(forwards),
        "batches": len(batches[group::groups]),
        "all_batches": len(batches),
        "requests": sum(suite.evaluator._batch_tasks[group::groups], Counter()),
        "tp": tp,
        "sharded": is_sharded(trainer.model, args),
        "generate_calls": generate_calls,
        "probed_steps": [h["step"] for h in trainer.state.log_history if "probe_0" in h],
    }
    with open(f"{out}/rank-{args.process_index}.json", "w") as f:
        json.dump(record, f)
    trainer.save_model(f"{out}/model")
    if args.process_index == 0:
        tokenizer.save_pretrained(f"{out}/model")
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main(*sys.argv[1:])
