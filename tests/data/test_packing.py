"""Best-fit packing and padded collation: no token lost or duplicated, documents kept apart."""

import random
from collections import Counter

import pytest
import torch
from datasets import Dataset

from hf_pretrain.data import Pack, PackedDocumentCollator
from hf_pretrain.data.packing import best_fit
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
