"""Byte-level BPE tokenizer training with the `tokenizers` library, saved as a transformers tokenizer.

Byte-level means every byte has a token, so no input ever maps to `<unk>`. Digits are split one per
token before BPE (numbers tokenize consistently, which helps arithmetic). Special tokens:
`<|bos|>`, `<|eos|>` (document separator in packing) and `<|pad|>`, distinct so that padding never
hides an end of document from the loss. The result is a `PreTrainedTokenizerFast` directory that
`AutoTokenizer.from_pretrained` loads.

`train_tokenizer(data, out_dir, vocab_size)` is the chain's step (`hf-pretrain data
train-tokenizer`): it streams the text column in batches, saves the tokenizer and reports bytes
per token on held-out text (`stats.extra`). Input bytes that are not valid UTF-8 are counted and
skipped when the files are read (`read.py`: Arrow cannot even hold them); texts that are not
strings (nulls) are counted and skipped here.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from .blocks import BlockStats

SPECIAL_TOKENS = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}


def _batches(texts: Iterable[str], batch_size: int = 1000) -> Iterator[list[str]]:
    batch = []
    for text in texts:
        batch.append(text)
        if len(batch) == batch_size:
            yield batch
            batch = []
    if batch:
        yield batch


def valid_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_vocab_size(vocab_size: int) -> None:
    least = len(pre_tokenizers.ByteLevel.alphabet()) + len(SPECIAL_TOKENS)
    if vocab_size < least:
        raise ValueError(f"vocab_size={vocab_size} is too small: byte-level BPE needs at least {least}.")


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE of `vocab_size` tokens (special tokens included) on `texts`."""
    check_vocab_size(vocab_size)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tokenizer.train_from_iterator(_batches(texts), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, **SPECIAL_TOKENS)


def bytes_per_token(tokenizer: PreTrainedTokenizerFast, texts: Iterable[str]) -> float:
    """UTF-8 bytes per token over `texts` (higher is a better compression); what is not a string is left out."""
    texts = [t for t in texts if isinstance(t, str)]
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    n_tokens = sum(len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"])
    return n_bytes / max(n_tokens, 1)


def load_or_train_tokenizer(
    path: str | Path, texts: Iterable[str], vocab_size: int
) -> tuple[PreTrainedTokenizerFast, bool]:
    """The tokenizer saved at `path`, or a new one trained on `texts` and saved there. Returns (tokenizer, trained)."""
    path = Path(path)
    if (path / "tokenizer.json").exists():
        return PreTrainedTokenizerFast.from_pretrained(str(path)), False
    tokenizer = train_bpe_tokenizer(texts, vocab_size)
    tokenizer.save_pretrained(str(path))
    return tokenizer, True


def train_tokenizer(
    data: Dataset,
    out_dir: str | Path,
    vocab_size: int,
    text_column: str = "text",
    heldout_texts: list[str] | None = None,
    min_frequency: int = 2,
) -> tuple[PreTrainedTokenizerFast, BlockStats]:
    """Train on `data[text_column]`, save to `out_dir`; stats: texts used / skipped, bytes per token on held-out."""
    stats = BlockStats("tokenizer")
    start = time.perf_counter()

    def texts() -> Iterator[str]:
        for batch in data.iter(batch_size=1000):
            for text in batch[text_column]:
                stats.documents_in += 1
                reason = "not_text" if not isinstance(text, str) else "" if valid_utf8(text) else "invalid_utf8"
                if reason:
                    stats.dropped[reason] = stats.dropped.get(reason, 0) + 1
                    continue
                stats.documents_out += 1
                stats.bytes_in += len(text.encode("utf-8"))
                yield text

    tokenizer = train_bpe_tokenizer(texts(), vocab_size, min_frequency)
    tokenizer.save_pretrained(str(out_dir))
    stats.extra.update(
        vocab_size=len(tokenizer), **measure_bytes_per_token(tokenizer, heldout_texts, data, text_column)
    )
    stats.seconds = time.perf_counter() - start
    return tokenizer, stats


def measure_bytes_per_token(
    tokenizer: PreTrainedTokenizerFast, heldout_texts: list[str] | None, data: Dataset, text_column: str = "text"
) -> dict:
    """`bytes_per_token` on up to 1000 held-out texts, or on the first 200 of `data` when there are none
    (`bytes_per_token_on` says which)."""
    sample = [t for t in (heldout_texts or []) if isinstance(t, str) and valid_utf8(t)][:1000]
    source = "held-out"
    if not sample:  # no held-out text given: measure on the first training texts (says so)
        sample, source = [t for t in data[:200][text_column] if isinstance(t, str) and valid_utf8(t)], "train"
    return {
        "bytes_per_token": round(bytes_per_token(tokenizer, sample), 3) if sample else None,
        "bytes_per_token_on": source,
    }
