"""Launched by test_straggler.py (torchrun for DDP, AutoTP and SP, `accelerate launch` for ZeRO-3 and FSDP2): a short
CPU run with the telemetry callbacks on, one rank slowed inside its linears (benchmarks/gpu/faults.py).

Engines: `ddp`, `zero3` (ds_configs/zero3.json), `fsdp2` (from the accelerate config), `autotp` (AutoTP=2 under
ZeRO-1, ds_configs/zero1_autotp.json), `sp` (Ulysses SP=2 under ZeRO-3), and `autotp-uneven`: AutoTP=2 of a model
with one KV head (rank 0 holds all of q/k/v, rank 1 none: 1.5x rank 1's multiply-adds) at widths 512/1536, where
the matmuls outweigh the per-call overhead as they do at real sizes. The slow rank's hooks go on at train begin,
once DeepSpeed has put its own layers in place of the linears (AutoTP), and before the callback's per-step hooks."""

import sys
from pathlib import Path

import torch
from accelerate import ParallelismConfig
from datasets import Dataset
from transformers import TrainerCallback

from benchmarks.gpu.faults import slow_linears
from hf_pretrain import PretrainForCausalLM, PretrainingArguments, PretrainTrainer
from hf_pretrain.data import PackedDocumentCollator
from hf_pretrain.presets import get_preset

CONFIGS = Path(__file__).resolve().parents[2] / "ds_configs"
AUTOTP = CONFIGS / "zero1_autotp.json"
DEEPSPEED = {"zero3": CONFIGS / "zero3.json", "sp": CONFIGS / "zero3.json", "autotp": AUTOTP, "autotp-uneven": AUTOTP}
UNEVEN = dict(num_key_value_heads=1, hidden_size=512, intermediate_size=1536, head_dim=128)


class SlowRank(TrainerCallback):
    """`slow_linears` on the model as it trains: "RANK:SECONDS" per forward, inside the linears."""

    def __init__(self, slow: str):
        rank, _, seconds = slow.partition(":")
        self.rank, self.seconds = int(rank), float(seconds)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        slow_linears(model, self.rank, self.seconds)


def main(
    output_dir: str,
    slow: str = "",
    accumulation: int = 1,
    threshold: float = 0.75,
    steps: int = 8,
    every: int = 4,
    engine: str = "ddp",
) -> None:
    torch.manual_seed(0)
    ids = torch.randint(2, 512, (2 * 2 * steps * accumulation, 64))
    args = PretrainingArguments(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=2,
        logging_steps=4,
        report_to="none",
        save_strategy="no",
        straggler_every=every,
        straggler_threshold=threshold,
        gradient_accumulation_steps=accumulation,
        disable_tqdm=True,
        measure_peak_tflops=False,
        seed=0,
        deepspeed=str(DEEPSPEED[engine]) if engine in DEEPSPEED else None,  # FSDP2 comes from the accelerate config
        parallelism_config=ParallelismConfig(sp_size=2) if engine == "sp" else None,
    )
    config = get_preset("tiny", vocab_size=512, num_hidden_layers=2, **(UNEVEN if engine == "autotp-uneven" else {}))
    trainer = PretrainTrainer(
        model=PretrainForCausalLM(config),
        args=args,
        train_dataset=Dataset.from_dict({"input_ids": ids.tolist()}),
        data_collator=PackedDocumentCollator(1),
        callbacks=[SlowRank(slow)] if slow else None,
    )
    trainer.train()
    trainer.accelerator.wait_for_everyone()  # no rank leaves while another still talks to it
    trainer.accelerator.end_training()  # tear the process group down before exit, not in interpreter shutdown


if __name__ == "__main__":  # OUTPUT_DIR SLOW ("RANK:SECONDS" or "") [ACCUMULATION THRESHOLD STEPS EVERY ENGINE]
    kinds = [str, int, float, int, int, str]
    main(sys.argv[1], *(kind(value) for kind, value in zip(kinds, sys.argv[2:])))
