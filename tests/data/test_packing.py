"""Packing and padded collation: no token lost or duplicated, documents kept apart, each block naming its documents."""

import random
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch
from datasets import Dataset

from hf_pretrain import PretrainForCausalLM, PretrainTrainer
from hf_pretrain.data import Pack, PackedDocumentCollator
from hf_pretrain.data.packing import best_fit
from hf_pretrain.training.resume.sampler import ResumableSampler
from tests.conftest import quick_args, small_config
from tests.data.test_data import corpus, tokenizer  # noqa: F401  (fixtures)


def test_best_fit_places_whole_documents_and_crops_only_long_ones():
    rng = random.Random(0)
    docs = [[rng.randrange(5, 50) for _ in range(rng.randrange(1, 31))] + [1] for _ in range(200)]
    docs.append(list(range(100, 175)) + [1])  # longer than a block: cropped into pieces
    rows, cropped, sources = best_fit(docs, 32)
    assert cropped == 1 and all(len(r) <= 32 for r in rows)
    # each row is the concatenation of the pieces of the documents it names, in order
    offsets = {}
    for row, source in zip(rows, sources, strict=True):
        rebuilt = []
        for d in source:
            piece = docs[d][offsets.get(d, 0) :][:32] if len(docs[d]) > 32 else docs[d]
            offsets[d] = offsets.get(d, 0) + len(piece)
            rebuilt += piece
        assert rebuilt == row
    assert sorted(t for r in rows for t in r) == sorted(t for d in docs for t in d)  # nothing lost or duplicated
    whole = [d for d in docs if len(d) <= 32]
    text = [",".join(map(str, r)) + "," for r in rows]
    assert all(any(",".join(map(str, d)) + "," in row for row in text) for d in whole)  # never split
    assert best_fit(docs, 32) == (rows, cropped, sources)  # deterministic
    lower_bound = -(-sum(map(len, docs)) // 32)
    assert len(rows) <= lower_bound * 1.1  # dense: within 10 % of the fewest rows possible


def documents_of(rows, eos):
    docs, current = [], []
    for row in rows:
        for tok in row:
            current.append(tok)
            if tok == eos:
                docs.append(tuple(current))
                current = []
        if current:  # a cropped piece (no EOS): a document of its own
            docs.append(tuple(current))
            current = []
    return docs


@pytest.mark.parametrize("num_proc", [None, 2])
def test_pack_best_fit_keeps_every_document_whole(tokenizer, num_proc):  # noqa: F811
    rng = random.Random(1)
    texts = [
        " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "x1"]) for _ in range(rng.randrange(1, 60)))
        for _ in range(400)
    ]
    pack = Pack(tokenizer, seq_len=64, mode="best_fit", batch_size=100)
    packed = pack.run(Dataset.from_dict({"text": texts}), num_proc=num_proc)
    eos = tokenizer.eos_token_id
    expected = [tuple(ids + [eos]) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    long = [d for d in expected if len(d) > 64]
    pieces = [d[i : i + 64] for d in expected for i in range(0, len(d), 64)]
    # every document is whole in one row, except the long ones, cut into block-sized pieces; nothing lost or doubled
    assert Counter(documents_of(list(packed["input_ids"]), eos)) == Counter(pieces)
    stats = pack.stats.extra
    assert stats["tokens"] == stats["packed_tokens"] == sum(map(len, expected)) and stats["tail_tokens_dropped"] == 0
    assert stats["cropped_documents"] == len(long) and pack.stats.documents_in == 400
    assert stats["padding_to_block"] == stats["blocks"] * 64 - stats["packed_tokens"] >= 0
    assert 0 <= stats["padding_multiple_of_8"] < 8 * stats["blocks"]


def test_collator_pads_best_fit_rows_to_a_multiple_of_8_and_masks_the_padding():
    eos, pad = 1, 0
    rows = [[5, 6, eos, 7, 8, 9, eos], [4, 4, 4, eos, 3, eos, 2, 2, 2, 2, eos]]
    collator = PackedDocumentCollator(eos, pad_token_id=pad)
    batch = collator([{"input_ids": r} for r in rows])
    assert batch["input_ids"].shape == (2, 16) and collator.has_padding
    assert batch["input_ids"][0, 7:].eq(pad).all() and batch["labels"][0, 7:].eq(-100).all()
    assert batch["position_ids"][0].tolist()[:8] == [0, 1, 2, 0, 1, 2, 3, 0]  # padding starts a "document"
    assert batch["labels"][1].tolist()[:11] == [4, 4, 4, eos, -100, eos, -100, 2, 2, 2, eos]
    with pytest.raises(ValueError, match="pass pad_token_id"):
        PackedDocumentCollator(eos)([{"input_ids": r} for r in rows])
    full = PackedDocumentCollator(eos)([{"input_ids": rows[0]}, {"input_ids": rows[0]}])
    assert not PackedDocumentCollator(eos).has_padding and full["input_ids"].shape == (2, 7)
    assert torch.equal(full["labels"][0], torch.tensor([5, 6, eos, -100, 8, 9, eos]))


# --- provenance: the documents of each block -----------------------------------------------------------


def test_concat_blocks_name_every_document_with_tokens_in_them(tokenizer):  # noqa: F811
    texts = [f"document {i} " + "word " * (i % 23) for i in range(150)]
    data = Dataset.from_dict({"text": texts, "doc_id": [f"d{i}" for i in range(150)]})
    packed = Pack(tokenizer, seq_len=32, mode="concat", batch_size=1000).run(data)
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    owner = [f"d{i}" for i, ids in enumerate(encoded) for _ in range(len(ids) + 1)]  # +1: the EOS
    for k, block in enumerate(packed):
        assert block["doc_ids"] == list(dict.fromkeys(owner[k * 32 : (k + 1) * 32]))  # a cut document in both


def test_pack_counts_text_that_is_not_text_and_names_rows_without_ids(tokenizer):  # noqa: F811
    texts = ["alpha beta gamma " * 3, None, "delta " * 5, None, "x1 x1"]
    pack = Pack(tokenizer, seq_len=8, mode="best_fit")
    packed = pack.run(Dataset.from_dict({"text": texts}))
    assert pack.stats.dropped == {"not_text": 2} and pack.stats.documents_in == 5
    assert sorted({i for ids in packed["doc_ids"] for i in ids}) == ["input[0]", "input[2]", "input[4]"]
    with_ids = Pack(tokenizer, seq_len=8, mode="best_fit").run(Dataset.from_dict({"text": texts, "id": range(5)}))
    assert sorted({i for ids in with_ids["doc_ids"] for i in ids}) == ["0", "2", "4"]


def packed_blocks(n: int = 40, seq: int = 16) -> Dataset:
    rows = [[3 + (i * 7 + j) % 120 for j in range(seq - 1)] + [2] for i in range(n)]
    return Dataset.from_dict({"input_ids": rows, "doc_ids": [[f"doc-{i}", f"doc-{i + 1}"] for i in range(n)]})


@dataclass
class RecordingCollator(PackedDocumentCollator):
    seen: list = field(default_factory=list)

    def __call__(self, features):
        self.seen += [f.get("doc_ids") for f in features]
        return super().__call__(features)


@pytest.mark.parametrize("remove_unused_columns", [True, False])
def test_trainer_and_collator_take_blocks_with_doc_ids(tmp_path, remove_unused_columns):
    collator = RecordingCollator(eos_token_id=2)
    args = quick_args(tmp_path, per_device_train_batch_size=4, remove_unused_columns=remove_unused_columns)
    model = PretrainForCausalLM(small_config())
    trainer = PretrainTrainer(model=model, args=args, train_dataset=packed_blocks(), data_collator=collator)
    batch = next(iter(trainer.get_train_dataloader()))
    assert set(batch) == {"input_ids", "position_ids", "labels"} and batch["input_ids"].shape == (4, 16)
    assert all((ids is None) == remove_unused_columns for ids in collator.seen)  # dropped, or passed and ignored


def test_which_documents_a_step_trained_on(tmp_path):
    """The recipe of docs/data.md: the blocks of optimizer step s are rows [(s-1) G, s G) of the sampler's order."""
    train = packed_blocks()
    collator = RecordingCollator(eos_token_id=2)
    b, accumulation, steps = 2, 2, 3
    args = quick_args(
        tmp_path,
        max_steps=steps,
        per_device_train_batch_size=b,
        gradient_accumulation_steps=accumulation,
        remove_unused_columns=False,
        seed=5,
    )
    trainer = PretrainTrainer(
        model=PretrainForCausalLM(small_config()), args=args, train_dataset=train, data_collator=collator
    )
    trainer.train()
    per_step = b * args.world_size * accumulation
    order = ResumableSampler(len(train), seed=args.seed).order(epoch=0)
    for step in range(1, steps + 1):
        rows = order[(step - 1) * per_step : step * per_step].tolist()
        assert collator.seen[(step - 1) * per_step : step * per_step] == train.select(rows)["doc_ids"]
