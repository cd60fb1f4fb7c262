"""Launched by test_memory_fsdp2.py under torchrun: FSDP2's real model-state tensors, counted, against the estimate.

The model of ds_inventory.py (5 M parameters) sharded by accelerate's FSDP2 (`fully_shard` per decoder layer,
the embedding and the final norm + LM head as their own units: `fsdp2_prepare_model`) over the launched CPU
ranks (gloo), `mixed_precision` PRECISION ("no" or "bf16"), AdamW. Every tensor alive in the process
(live_tensors.py: a DTensor counts its local shard) is counted after backward and inside the optimizer's step,
minus what was alive before the model existed. Rank 0 prints one JSON line.
"""

import json
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from accelerate import Accelerator, PartialState
from accelerate.utils import FullyShardedDataParallelPlugin

from hf_pretrain import PretrainForCausalLM, get_preset
from hf_pretrain.distributed.live_tensors import live_bytes
from hf_pretrain.distributed.memory import estimate_memory
from hf_pretrain.training.fsdp import fsdp_on_cpu
from hf_pretrain.training.processes import leave_process_group
from tests.distributed.ds_inventory import SHAPE


def main(precision: str) -> None:
    PartialState(cpu=True)  # the gloo group, as PretrainingArguments makes it on a CPU
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["PretrainDecoderLayer"],
        reshard_after_forward=True,
        state_dict_type="SHARDED_STATE_DICT",
    )
    with fsdp_on_cpu(SimpleNamespace(fsdp=True)):
        accelerator = Accelerator(fsdp_plugin=plugin, mixed_precision=precision)
    assert accelerator.is_fsdp2
    torch.manual_seed(0)
    config = get_preset("tiny", **SHAPE)
    ids = torch.randint(0, config.vocab_size, (1, 64))
    baseline = live_bytes()
    model = PretrainForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    seen = {}
    inner = optimizer.optimizer
    inner_step = inner.step

    def counted_step(*args, **kwargs):
        seen["step"] = live_bytes() - baseline
        return inner_step(*args, **kwargs)

    inner.step = counted_step
    for _ in range(2):  # the second step: Adam's states exist
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        seen["backward"] = live_bytes() - baseline
        optimizer.step()
        optimizer.zero_grad()
    estimate = estimate_memory(
        config, 3, dist.get_world_size(), "fp32" if precision == "no" else precision, 64, 1, fsdp2=True
    )
    if dist.get_rank() == 0:
        print(json.dumps({**seen, "estimate": estimate.to_dict()}))
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
    leave_process_group()  # as PretrainTrainer does: a group alive at teardown can abort the exit
