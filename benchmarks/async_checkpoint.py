"""The training loop's stall of a checkpoint save, asynchronous against synchronous, and the slowdown of the steps
that overlap a background write.

One process trains the same model (its weights and AdamW states a few GB) with `PretrainTrainer`, alternating
`async_checkpoint=True` and `False` for `--rounds` rounds of `--steps` steps, a checkpoint every `--save-every`
steps. A callback times every gap between one step's end and the next step's start: at a save step the gap holds
the save's stall (less the median gap of the other steps: logging, the next batch). With asynchronous saves the
stall also holds the time the next step's update waited for the copy that ran beside its forward and backward
(`BackgroundSaves.staging_waits`), and the callback times each step while a save's copy or write is in flight (less
that wait) against the steps without one. Prints per round the stalls
and, over the rounds, the ratio async / sync (median, min-max) of the saves after a run's first (the first also pays
one-time costs: the host buffers allocated, the first files written), of the first, and the overlapped steps'
slowdown.

    python benchmarks/async_checkpoint.py [--layers 12] [--hidden 1024] [--rounds 3] [--steps 20] [--save-every 6]
                                          [--out /tmp/async_checkpoint]
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import TrainerCallback

from hf_pretrain import PretrainConfig, PretrainForCausalLM, PretrainingArguments, PretrainTrainer
from hf_pretrain.modeling.accounting import count_parameters


class Gaps(TrainerCallback):
    """Times each step and each gap between steps; notes which steps overlapped a background write."""

    def __init__(self):
        self.trainer = None
        self.gaps: dict[int, float] = {}  # the gap after step s
        self.steps: list[tuple[float, bool]] = []  # (seconds, a background write in flight)
        self.waits: dict[int, float] = {}  # step s's update waited this long for the copy of the save at step s - 1
        self._end = self._begin = None
        self._waited = 0.0

    def _writing(self) -> bool:
        background = self.trainer.checkpointing.background if self.trainer else None
        return background is not None and background.in_flight is not None

    def on_step_begin(self, args, state, control, **kwargs):
        self._begin = time.perf_counter()
        if self._end is not None:
            self.gaps[state.global_step] = self._begin - self._end
        self._writing_at_begin = self._writing()

    def on_step_end(self, args, state, control, **kwargs):
        self._end = time.perf_counter()
        background = self.trainer.checkpointing.background if self.trainer else None
        waited = sum(background.staging_waits) if background is not None else 0.0
        wait, self._waited = waited - self._waited, waited
        if wait:
            self.waits[state.global_step] = wait
        self.steps.append((self._end - self._begin - wait, self._writing_at_begin or self._writing()))


def train_round(model, data, out: Path, async_checkpoint: bool, steps: int, save_every: int) -> Gaps:
    shutil.rmtree(out, ignore_errors=True)
    args = PretrainingArguments(
        str(out),
        max_steps=steps,
        per_device_train_batch_size=1,
        save_strategy="steps",
        save_steps=save_every,
        async_checkpoint=async_checkpoint,
        report_to="none",
        disable_tqdm=True,
        logging_steps=1,
        telemetry=False,
        measure_peak_tflops=False,
        dataloader_num_workers=0,
    )
    gaps = Gaps()
    trainer = PretrainTrainer(model=model, args=args, train_dataset=data, callbacks=[gaps])
    gaps.trainer = trainer
    trainer.train()
    del trainer
    gc.collect()
    return gaps


def stalls(gaps: Gaps, save_every: int) -> list[float]:
    saves = [s for s in gaps.gaps if s % save_every == 0]
    others = [g for s, g in gaps.gaps.items() if s % save_every and s > 1] or [0.0]
    base = statistics.median(others)
    return [gaps.gaps[s] - base + gaps.waits.get(s + 1, 0.0) for s in saves]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--save-every", type=int, default=6)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--out", default="/tmp/async_checkpoint")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    config = PretrainConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 64),
        max_position_embeddings=args.seq_len,
    )
    model = PretrainForCausalLM(config)
    parameters = count_parameters(config)
    ids = torch.randint(3, args.vocab, (64, args.seq_len)).tolist()
    data = Dataset.from_dict({"input_ids": ids, "labels": ids})
    print(
        f"model: {parameters / 1e6:.0f} M parameters; a checkpoint holds ~{parameters * 12 / 2**30:.1f} GiB "
        f"(fp32 weights + AdamW states); {args.steps} steps a round, a save every {args.save_every}; "
        f"torch {torch.__version__}, {'CUDA' if torch.cuda.is_available() else 'CPU'}"
    )
    results: dict[str, list] = {"async": [], "sync": [], "ratio": [], "first": [], "overlap": []}
    for round_ in range(args.rounds):
        measured = {}
        for mode in ("async", "sync"):
            gaps = train_round(model, data, Path(args.out) / mode, mode == "async", args.steps, args.save_every)
            measured[mode] = stalls(gaps, args.save_every)
            results[mode] += measured[mode]
            if mode == "async":
                held = [gaps.waits.get(s + 1, 0.0) for s in gaps.gaps if s % args.save_every == 0]
                writing = [s for s, w in gaps.steps[1:] if w]
                quiet = [s for s, w in gaps.steps[1:] if not w]
                if writing and quiet:
                    results["overlap"].append(statistics.median(writing) / statistics.median(quiet))
        # a round's first save also pays what a run pays once (the host buffers allocated, the checkpointer's
        # group, the first weight files written): apart from the saves after it
        results["first"].append(measured["async"][0] / measured["sync"][0])
        later = {mode: measured[mode][1:] for mode in measured}
        ratio = statistics.median(later["async"]) / statistics.median(later["sync"]) if later["sync"] else None
        if ratio is not None:
            results["ratio"].append(ratio)
        print(
            f"round {round_ + 1}: save stall async {', '.join(f'{s:.2f}' for s in measured['async'])} s (the next "
            f"update held for the copy {', '.join(f'{s:.2f}' for s in held)} s) | sync "
            f"{', '.join(f'{s:.2f}' for s in measured['sync'])} s | first save {results['first'][-1]:.3f}"
            + (f" | later saves {ratio:.3f}" if ratio is not None else "")
        )
    ratios, first, overlap = results["ratio"], results["first"], results["overlap"]
    if ratios:
        print(
            f"stall async / sync, saves after a run's first: median {statistics.median(ratios):.3f} "
            f"(min {min(ratios):.3f}, max {max(ratios):.3f}) over {len(ratios)} rounds"
        )
    print(
        f"stall async / sync, a run's first save: median {statistics.median(first):.3f} (min {min(first):.3f}, "
        f"max {max(first):.3f})"
    )
    if overlap:
        print(
            f"steps overlapping a background write / the others: median {statistics.median(overlap):.2f}x "
            f"(min {min(overlap):.2f}, max {max(overlap):.2f})"
        )
    shutil.rmtree(args.out, ignore_errors=True)
    return results


if __name__ == "__main__":
    main()
