import json

import pytest
from datasets import Dataset
from transformers import AutoTokenizer

from hf_pretrain.data import (
    bytes_per_token,
    embedded_documents,
    load_or_train_tokenizer,
    load_text_dataset,
    pack_dataset,
    train_bpe_tokenizer,
    write_embedded_corpus,
)
from hf_pretrain.data.corpus import is_heldout


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_embedded_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def tokenizer(corpus):
    texts = [json.loads(line)["text"] for line in corpus["train"].read_text().splitlines()]
    return train_bpe_tokenizer(texts, vocab_size=1024)


def test_embedded_corpus_is_deterministic_prose_with_disjoint_heldout(corpus):
    docs = embedded_documents()
    assert docs == embedded_documents()
    assert len(docs) > 300 and sum(map(len, docs)) > 500_000
    splits = load_text_dataset(corpus["train"].parent)
    train, heldout = set(splits["train"]["text"]), set(splits["heldout"]["text"])
    assert not train & heldout
    assert len(train) + len(heldout) == len(set(docs))
    assert 0.02 < len(heldout) / len(docs) < 0.10


def test_user_files_in_every_supported_form(tmp_path):
    docs = [f"document number {i} " * 5 for i in range(200)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in docs))
    splits = load_text_dataset(tmp_path / "a.jsonl", text_column="body", heldout_fraction=0.2)
    assert len(splits["train"]) + len(splits["heldout"]) == 200 and len(splits["heldout"]) > 10
    Dataset.from_dict({"text": docs}).save_to_disk(str(tmp_path / "saved"))
    assert (
        len(load_text_dataset(tmp_path / "saved")["train"]) + len(load_text_dataset(tmp_path / "saved")["heldout"])
        == 200
    )
    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "one.txt").write_text("\n".join(docs))
    assert sum(len(s) for s in load_text_dataset(tmp_path / "txt").values()) == 200


def test_bad_data_arguments_name_the_field(tmp_path):
    with pytest.raises(FileNotFoundError, match="dataset_path="):
        load_text_dataset(tmp_path / "missing")
    (tmp_path / "a.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match="text_column='text'.*body"):
        load_text_dataset(tmp_path / "a.jsonl")
    (tmp_path / "b.txt").write_text("x")
    with pytest.raises(ValueError, match="one kind"):
        load_text_dataset(tmp_path)


def test_heldout_choice_depends_only_on_text():
    assert is_heldout("some text", 0.5) == is_heldout("some text", 0.5)
    flags = [is_heldout(f"doc {i}", 0.1) for i in range(5000)]
    assert 0.08 < sum(flags) / len(flags) < 0.12


def test_tokenizer_is_byte_level_lossless_and_loads_with_auto(tokenizer, tmp_path):
    assert len(tokenizer) == 1024
    text = "If 5x + 3 = 13, then x is 5. Ünïcödé ☃ 𝔘 \t tabs\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert tokenizer.unk_token_id is None or tokenizer.unk_token_id not in ids
    tokens = tokenizer.convert_ids_to_tokens(tokenizer("year 2026", add_special_tokens=False)["input_ids"])
    assert {"2", "0", "6"} <= set(tokens), tokens  # digits split one per token
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded(text, add_special_tokens=False)["input_ids"] == ids
    assert {loaded.bos_token, loaded.eos_token, loaded.pad_token} == {"<|bos|>", "<|eos|>", "<|pad|>"}
    assert len({loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id}) == 3


def test_tokenizer_compresses_heldout_text(tokenizer, corpus):
    heldout = [json.loads(line)["text"] for line in corpus["heldout"].read_text().splitlines()]
    assert bytes_per_token(tokenizer, heldout) > 2.5  # bytes alone would be 1.0


def test_tokenizer_is_trained_once_then_loaded(tmp_path):
    texts = ["hello world " * 20] * 10
    first, trained = load_or_train_tokenizer(tmp_path, texts, 300)
    second, trained_again = load_or_train_tokenizer(tmp_path, ["other"], 300)
    assert trained and not trained_again and second.get_vocab() == first.get_vocab()
    with pytest.raises(ValueError, match="vocab_size=100 is too small"):
        train_bpe_tokenizer(texts, 100)


def test_packing_counts_every_token_and_reuses_its_cache(tokenizer, tmp_path):
    docs = Dataset.from_dict({"text": [f"document {i} " + "word " * (i % 37) for i in range(300)]})
    packed, stats = pack_dataset(docs, tokenizer, seq_len=64, cache_dir=tmp_path)
    encoded = tokenizer(list(docs["text"]), add_special_tokens=False)["input_ids"]
    stream = [tok for ids in encoded for tok in (*ids, tokenizer.eos_token_id)]
    counts = stats.extra
    assert counts["tokens"] == len(stream) and stats.documents_in == 300
    assert counts["blocks"] == len(packed) and all(len(ids) == 64 for ids in packed["input_ids"])
    assert counts["packed_tokens"] + counts["tail_tokens_dropped"] == counts["tokens"]
    assert 0 <= counts["tail_tokens_dropped"] < 64 and not counts["reused_cache"]
    # Blocks are the EOS-separated document stream cut in order; only the tail is dropped.
    assert [tok for ids in packed["input_ids"] for tok in ids] == stream[: counts["packed_tokens"]]
    again, stats_again = pack_dataset(docs, tokenizer, seq_len=64, cache_dir=tmp_path)
    assert stats_again.extra["reused_cache"] and again["input_ids"] == packed["input_ids"]
    _, other = pack_dataset(docs, tokenizer, seq_len=32, cache_dir=tmp_path)
    assert not other.extra["reused_cache"] and other.extra["blocks"] > counts["blocks"]


def test_packing_too_little_data_is_a_clear_error(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="lower seq_len"):
        pack_dataset(Dataset.from_dict({"text": ["tiny"]}), tokenizer, seq_len=512, cache_dir=tmp_path)
