"""Launched by test_straggler.py (torchrun for DDP, `accelerate launch` for ZeRO-3 and FSDP2): a short CPU run
with the telemetry callbacks on, one rank slowed inside its linears (benchmarks/gpu/faults.py)."""

import sys
from pathlib import Path

import torch
from datasets import Dataset

from benchmarks.gpu.faults import slow_linears
from hf_pretrain import PretrainForCausalLM, PretrainingArguments, PretrainTrainer
from hf_pretrain.data import PackedDocumentCollator
from hf_pretrain.presets import get_preset

ZERO3 = Path(__file__).resolve().parents[2] / "ds_configs" / "zero3.json"


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
        deepspeed=str(ZERO3) if engine == "zero3" else None,  # FSDP2 comes from the accelerate config
    )
    config = get_preset("tiny", vocab_size=512, num_hidden_layers=2)
    model = PretrainForCausalLM(config)
    if slow:  # "RANK:SECONDS" per forward, inside the linears
        rank, _, seconds = slow.partition(":")
        slow_linears(model, int(rank), float(seconds))
    trainer = PretrainTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_dict({"input_ids": ids.tolist()}),
        data_collator=PackedDocumentCollator(1),
    )
    trainer.train()
    trainer.accelerator.wait_for_everyone()  # no rank leaves while another still talks to it
    trainer.accelerator.end_training()  # tear the process group down before exit, not in interpreter shutdown


if __name__ == "__main__":  # OUTPUT_DIR SLOW ("RANK:SECONDS" or "") [ACCUMULATION THRESHOLD STEPS EVERY ENGINE]
    kinds = [str, int, float, int, int, str]
    main(sys.argv[1], *(kind(value) for kind, value in zip(kinds, sys.argv[2:])))
