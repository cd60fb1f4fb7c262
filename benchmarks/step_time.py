"""Median training-step time of `PretrainForCausalLM` against plain `LlamaForCausalLM`.

Both models get the same config and weights and train under `transformers.Trainer` on the same
random batches; rounds alternate between the two so that machine noise hits both alike. Prints the
median step time of each and the ratio ours / Llama (goal: <= 1.00).

    python benchmarks/step_time.py                         # tiny and gpt2-124m, seq 128, CPU fp32
    python benchmarks/step_time.py --presets tiny --rounds 3 --steps 5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from datasets import Dataset
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PrinterCallback,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    default_data_collator,
)

from hf_pretrain import PretrainForCausalLM, get_preset


class StepTimer(TrainerCallback):
    """Wall time of each optimizer step (forward, backward, optimizer), first step excluded as warm-up."""

    def __init__(self):
        self.times: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step > 1:
            self.times.append(time.perf_counter() - self._start)


def time_steps(model, data, steps: int, batch: int) -> list[float]:
    timer = StepTimer()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            max_steps=steps + 1,
            per_device_train_batch_size=batch,
            report_to="none",
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            use_cpu=not torch.cuda.is_available(),
        )
        trainer = Trainer(
            model=model, args=args, train_dataset=data, data_collator=default_data_collator, callbacks=[timer]
        )
        trainer.remove_callback(PrinterCallback)
        trainer.train()
    return timer.times


def compare(preset: str, seq_len: int, batch: int, rounds: int, steps: int) -> float:
    config = get_preset(preset, max_position_embeddings=max(seq_len, 128))
    ours = PretrainForCausalLM(config)
    llama_fields = {k: v for k, v in config.to_dict().items() if k in LlamaConfig.__dataclass_fields__}
    llama = LlamaForCausalLM(LlamaConfig(**llama_fields))
    llama.load_state_dict(ours.state_dict())
    ids = torch.randint(0, config.vocab_size, (batch * (steps + 1), seq_len))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    times = {"hf_pretrain": [], "llama": []}
    models = [("hf_pretrain", ours), ("llama", llama)]
    for round_index in range(rounds):  # ABBA order: neither model always runs first
        for name, model in models if round_index % 2 == 0 else models[::-1]:
            times[name] += time_steps(model, data, steps, batch)
    med = {name: statistics.median(t) for name, t in times.items()}
    ratio = med["hf_pretrain"] / med["llama"]
    print(
        f"{preset:>10} seq {seq_len} batch {batch}: hf_pretrain {med['hf_pretrain'] * 1e3:8.1f} ms/step, "
        f"llama {med['llama'] * 1e3:8.1f} ms/step, ratio {ratio:.3f} ({len(times['llama'])} steps each)"
    )
    return ratio


def main(argv=None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="tiny,gpt2-124m")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    a = parser.parse_args(argv)
    torch.manual_seed(0)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, {'cuda' if torch.cuda.is_available() else 'cpu'}"
    )
    return {p: compare(p, a.seq_len, a.batch, a.rounds, a.steps) for p in a.presets.split(",")}


if __name__ == "__main__":
    main()
