"""Launched by test_memory.py under torchrun: DeepSpeed's real model-state tensors, counted, against the estimate.

A bf16 model (5 M parameters) under ZeRO stage STAGE over the launched CPU ranks (gloo). Every tensor alive in
the process (gc, deduplicated by storage, gradients included) is counted after backward and inside the
optimizer's step; the model states are that minus what was alive before the model existed. Buckets are kept
tiny so that the count is the states, not DeepSpeed's communication buffers. Rank 0 prints one JSON line.
"""

import gc
import json
import sys

import deepspeed
import torch
import torch.distributed as dist

from hf_pretrain import PretrainForCausalLM, get_preset
from hf_pretrain.distributed.live_tensors import live_bytes
from hf_pretrain.distributed.memory import estimate_memory
from hf_pretrain.training.processes import leave_process_group

SHAPE = dict(
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=4096,
)


def main(stage: int) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    config = get_preset("tiny", **SHAPE)
    ids = torch.randint(0, config.vocab_size, (1, 64))
    gc.collect()
    baseline = live_bytes()
    model = PretrainForCausalLM(config)
    tiny_buckets = {
        "reduce_bucket_size": 4096,
        "allgather_bucket_size": 4096,
        "stage3_prefetch_bucket_size": 4096,
        "stage3_param_persistence_threshold": 0,  # no weights kept gathered between steps
    }
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage, "overlap_comm": False, "contiguous_gradients": True, **tiny_buckets},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
    }
    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=ds_config, model_parameters=model.parameters())
    seen = {}
    inner_step = optimizer.optimizer.step

    def counted_step(*args, **kwargs):
        gc.collect()
        seen["step"] = live_bytes() - baseline
        return inner_step(*args, **kwargs)

    optimizer.optimizer.step = counted_step
    for _ in range(2):  # the second step: Adam's states exist
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        gc.collect()
        seen["backward"] = live_bytes() - baseline
        engine.step()
    estimate = estimate_memory(config, stage, dist.get_world_size(), "bf16", 64, 1)
    if dist.get_rank() == 0:
        print(json.dumps({**seen, "estimate": estimate.to_dict()}))
    dist.barrier()


if __name__ == "__main__":
    main(int(sys.argv[1]))
    leave_process_group()  # as PretrainTrainer does: a group alive at teardown can abort the exit
