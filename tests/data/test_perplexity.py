"""The perplexity filter with a model this package trained (a real, if small, causal LM)."""

import math
import random

import pytest
import torch
from datasets import Dataset

from hf_pretrain import PretrainForCausalLM, get_preset
from hf_pretrain.data import embedded_documents, train_bpe_tokenizer
from hf_pretrain.data.perplexity import PerplexityFilter


@pytest.fixture(scope="module")
def scorer_dir(tmp_path_factory):
    """A tiny LM trained for a few seconds on the embedded English corpus, saved with its tokenizer."""
    docs = embedded_documents()
    tokenizer = train_bpe_tokenizer(docs, vocab_size=512)
    stream = [t for ids in tokenizer(docs[:300], add_special_tokens=False)["input_ids"] for t in ids]
    blocks = torch.tensor(stream[: len(stream) // 64 * 64]).view(-1, 64)
    torch.manual_seed(0)
    model = PretrainForCausalLM(get_preset("tiny", vocab_size=512, num_hidden_layers=2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(150):
        batch = blocks[torch.randint(0, len(blocks), (16,))]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    path = tmp_path_factory.mktemp("scorer")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def garbage(n, seed=0):
    rng = random.Random(seed)
    alphabet = "qxzjv#@%&*{}|~^0123456789"
    return [
        " ".join("".join(rng.choice(alphabet) for _ in range(rng.randrange(3, 9))) for _ in range(60)) for _ in range(n)
    ]


def test_fluent_text_scores_lower_and_garbage_is_dropped(scorer_dir):
    english = embedded_documents()[-40:]  # documents the scorer was not trained on
    block = PerplexityFilter(scorer_dir, threshold=1e9)
    good, bad = block.perplexities(english), block.perplexities(garbage(20))
    assert sorted(good)[len(good) // 2] * 3 < min(bad)  # the median document is far below any garbage
    threshold = math.sqrt(max(good) * min(bad)) if max(good) < min(bad) else sorted(good)[-2] * 1.01
    texts = english + garbage(20)
    ids = [f"doc-{i}" for i in range(len(texts))]
    meta = [{"source": "english" if i < 40 else "garbage", "n": i} for i in range(len(texts))]
    data = Dataset.from_dict({"id": ids, "text": texts, "meta": meta})
    filtered = PerplexityFilter(scorer_dir, threshold=threshold, keep_scores=True)
    kept = filtered.run(data)
    assert filtered.stats.dropped["perplexity"] >= 19 and len(kept) >= 39
    assert all(s <= threshold for s in kept["perplexity"])
    for row in kept:  # every field of a kept record survives, beside its row's text
        n = int(row["id"].removeprefix("doc-"))
        assert row["text"] == texts[n] and row["meta"] == meta[n]
    assert filtered.stats.extra["scored"] == 60 and filtered.stats.extra["threshold"] == threshold


def test_unscorable_documents_are_kept_and_counted(scorer_dir):
    block = PerplexityFilter(scorer_dir, threshold=1500)
    kept = block.run(Dataset.from_dict({"text": ["a", "The for statement is used to iterate over a sequence."]}))
    assert len(kept) == 2 and "perplexity" not in kept.column_names
    assert block.stats.extra["unscored"] == 1
    with pytest.raises(ValueError, match="threshold=0.5"):
        PerplexityFilter(scorer_dir, threshold=0.5)
    with pytest.raises(ValueError, match="tokenizer_path='no/tok' cannot be loaded"):
        PerplexityFilter(scorer_dir, tokenizer_path="no/tok")  # checked at once, not at the first batch
