"""Exact resume of a streaming `datasets.IterableDataset` from its saved position, twice in a row, across
epochs of the stream, without reading the trained part again."""

import json

import torch
from transformers import default_data_collator

from hf_pretrain import PretrainForCausalLM, PretrainTrainer
from tests.conftest import quick_args, small_config
from tests.training.test_resume import Record
from tests.training.test_trainer import dataset

ROWS, BATCH, STEPS = 32, 4, 20  # 8 steps a pass over the stream: the runs cross two of its epochs


def stream(reads: list):
    def counted(row):
        reads.append(1)
        return row

    return dataset(ROWS).to_iterable_dataset(num_shards=2).map(counted)


def train(output_dir, reads, resume=None, stop_at=None):
    torch.manual_seed(0)
    args = quick_args(
        output_dir,
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        learning_rate=3e-3,
        save_strategy="steps",
        save_steps=3,
        measure_peak_tflops=False,
        telemetry=False,
        seed=3,
    )
    record = Record(stop_at)
    trainer = PretrainTrainer(
        model=PretrainForCausalLM(small_config()),
        args=args,
        train_dataset=stream(reads),
        data_collator=default_data_collator,
        callbacks=[record],
    )
    trainer.train(resume_from_checkpoint=resume)
    return record.losses


def test_stream_resumes_exactly_twice_in_a_row_without_rereading(tmp_path):
    straight = train(tmp_path / "straight", [])
    assert sorted(straight) == list(range(1, STEPS + 1))
    out = tmp_path / "run"
    train(out, [], stop_at=4)  # pre-empted after step 4; the newest checkpoint is 3
    second = train(out, [], resume=True, stop_at=10)  # from 3, across the stream's first epoch end (step 8)
    saved = json.loads((out / "checkpoint-9" / "hf_pretrain_state.json").read_text())["stream"]
    assert saved["micro_batches"] == 9 and saved["state"]["epoch"] == 1  # written by a resumed run: it moved on
    reads = []
    third = train(out, reads, resume=True)  # from 9: the resumed run's own position
    assert sorted(second) == list(range(4, 11)) and sorted(third) == list(range(10, STEPS + 1))
    assert second == {s: straight[s] for s in second} and third == {s: straight[s] for s in third}
    # What was trained before step 9 is not read again (the Trainer's skipping would read 9 x 4 rows more).
    assert len(reads) <= (STEPS - 9 + 3) * BATCH
