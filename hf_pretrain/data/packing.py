"""Tokenize and pack documents into fixed-length blocks, cached as Arrow on disk.

Documents are tokenized in batches (`datasets.map`, `num_proc` workers), each followed by the EOS
token, concatenated and cut into blocks of `seq_len` tokens, the classic GPT recipe: no padding,
every token trains. The tail of each batch of `batch_size` documents that does not fill a block is dropped and
counted (`PackStats.dropped_tokens`), never lost silently. Attention still crosses document boundaries
inside a block here; document-aware masks come with the attention backends.

The packed dataset is saved with `save_to_disk` under a key made of the source dataset's
fingerprint, the tokenizer's hash and `seq_len`, so a second run with the same inputs reuses it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from datasets import Dataset, load_from_disk
from transformers import PreTrainedTokenizerBase


@dataclass
class PackStats:
    documents: int
    tokens: int
    blocks: int
    seq_len: int
    dropped_tokens: int
    reused_cache: bool

    @property
    def packed_tokens(self) -> int:
        return self.blocks * self.seq_len


def tokenizer_hash(tokenizer: PreTrainedTokenizerBase) -> str:
    state = (
        tokenizer.backend_tokenizer.to_str() if hasattr(tokenizer, "backend_tokenizer") else repr(tokenizer.get_vocab())
    )
    return hashlib.sha1(state.encode("utf-8")).hexdigest()[:16]


def _tokenize(batch: dict, tokenizer, text_column: str) -> dict:
    ids = tokenizer(batch[text_column], add_special_tokens=False)["input_ids"]
    return {"input_ids": [doc + [tokenizer.eos_token_id] for doc in ids]}


def _pack(batch: dict, seq_len: int) -> dict:
    stream = [tok for doc in batch["input_ids"] for tok in doc]
    return {"input_ids": [stream[i : i + seq_len] for i in range(0, len(stream) - seq_len + 1, seq_len)]}


def pack_dataset(
    dataset: Dataset,
    tokenizer: PreTrainedTokenizerBase,
    seq_len: int,
    cache_dir: str | Path,
    text_column: str = "text",
    num_proc: int | None = None,
    batch_size: int = 1000,
) -> tuple[Dataset, PackStats]:
    """Packed blocks of `seq_len` tokens (column `input_ids`) and their counters."""
    if tokenizer.eos_token_id is None:
        raise ValueError(
            "The tokenizer has no eos_token: packing needs one to separate documents. Set tokenizer.eos_token."
        )
    key = f"{dataset._fingerprint}-{tokenizer_hash(tokenizer)}-{seq_len}-{batch_size}"
    path = Path(cache_dir) / f"packed-{hashlib.sha1(key.encode()).hexdigest()[:16]}"
    stats_path = path / "pack_stats.json"
    if stats_path.exists():
        stats = PackStats(**{**json.loads(stats_path.read_text()), "reused_cache": True})
        return load_from_disk(str(path)), stats
    tokenized = dataset.map(
        _tokenize,
        fn_kwargs={"tokenizer": tokenizer, "text_column": text_column},
        batched=True,
        remove_columns=dataset.column_names,
        num_proc=num_proc,
        desc="tokenize",
    )
    tokens = sum(len(ids) for ids in tokenized["input_ids"])
    packed = tokenized.map(
        _pack, fn_kwargs={"seq_len": seq_len}, batched=True, batch_size=batch_size, desc=f"pack {seq_len}"
    )
    if len(packed) == 0:
        raise ValueError(
            f"No {seq_len}-token block could be packed from {len(dataset)} documents ({tokens} tokens); lower seq_len or add data."
        )
    stats = PackStats(len(dataset), tokens, len(packed), seq_len, tokens - len(packed) * seq_len, False)
    packed.save_to_disk(str(path))
    stats_path.write_text(json.dumps(asdict(stats)))
    return packed, stats
