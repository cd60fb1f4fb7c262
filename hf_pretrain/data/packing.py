"""Tokenize and pack documents into fixed-length blocks, cached as Arrow on disk.

Every document is tokenized (`datasets.map`, `num_proc` workers) and followed by the EOS token,
which is what the collator uses to keep documents apart (position ids restarting after each EOS,
see `collator.py`). Two ways to fill blocks of `seq_len` tokens (default 4096; the CPU example
uses 256):

- `concat` (GPT recipe): concatenate a batch of `batch_size` documents and cut the stream into
  blocks. No padding, every token trains; documents are cut at block edges, and the tail of each
  batch that does not fill a block is dropped (`tail_tokens_dropped`).
- `best_fit` (best-fit decreasing bin packing, as in "Fewer Truncations Improve Language
  Modeling", Ding et al. 2024): whole documents are placed, longest first, into the block with
  the least room that still fits them, so no document is cut unless it is longer than a block
  (then it is cropped into block-sized pieces, `cropped_documents`, no token lost). Rows are the
  documents of a block, unpadded; the collator pads a batch to its longest row rounded up to a
  multiple of 8 (`pad_to_multiple_of`). `padding_to_block` reports what padding every row to
  `seq_len` would cost and `padding_multiple_of_8` what rounding each row costs.

Provenance: every block keeps `doc_ids`, the `doc_id` (see `read.py`) of each document with tokens
in it, in order (a document cut at a block edge is in both blocks); data without a `doc_id` or
`id` column (a `Dataset` built in memory) names its documents by position, `input[17]`. Only
`input_ids` reach the model: the Trainer drops other columns (`remove_unused_columns`) and
`PackedDocumentCollator` reads nothing else.

Counters (`Pack.stats`, a `BlockStats`): documents in, blocks out, `tokens` (with EOS),
`packed_tokens`, `tail_tokens_dropped` (concat), `cropped_documents`, `padding_to_block`,
`padding_multiple_of_8` (best_fit); texts that are not strings are dropped as `not_text`. No token
is lost or duplicated except the reported tail (tested). The counters are carried in helper
columns on each batch's first row, so they are right with worker processes.

`pack_dataset` caches the packed dataset with `save_to_disk` under a key made of the source
dataset's fingerprint, the tokenizer's hash, the mode and `seq_len`, so a second run reuses it.
Written by hand: `datasets` and `transformers` have the tokenization, not the packing.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
from datasets import Dataset, IterableDataset, load_from_disk
from transformers import PreTrainedTokenizerBase

from .blocks import Block, BlockStats, check_text_column, shard
from .records import ID_FIELDS, own_id

MODES = ("concat", "best_fit")
COUNTERS = ("_documents", "_tokens", "_tail", "_cropped", "_bytes", "_not_text")
PACK_VERSION = "pack-2"  # in the cache key: a new output format never reuses an old cache
DOC_IDS = "doc_ids"  # per block: the doc_id of each document with tokens in it, in order


def check_seq_len(seq_len: int) -> None:
    if not isinstance(seq_len, int) or isinstance(seq_len, bool):
        raise ValueError(f"seq_len={seq_len!r} is not a whole number: use an integer >= 8 (4096 is typical).")
    if seq_len < 8:
        raise ValueError(f"seq_len={seq_len} is too small; use at least 8 (4096 is typical).")


def tokenizer_hash(tokenizer: PreTrainedTokenizerBase) -> str:
    state = (
        tokenizer.backend_tokenizer.to_str() if hasattr(tokenizer, "backend_tokenizer") else repr(tokenizer.get_vocab())
    )
    return hashlib.sha1(state.encode("utf-8")).hexdigest()[:16]


def best_fit(documents: list[list[int]], seq_len: int) -> tuple[list[list[int]], int, list[list[int]]]:
    """Best-fit decreasing: rows of whole documents (longer ones cropped into `seq_len` pieces); returns
    (rows, documents cropped, the index in `documents` of each piece of each row, in row order).
    Deterministic: ties go to the earliest opened row."""
    pieces, owners, cropped = [], [], 0
    for index, doc in enumerate(documents):
        if len(doc) > seq_len:
            cropped += 1
            cut = [doc[i : i + seq_len] for i in range(0, len(doc), seq_len)]
        else:
            cut = [doc]
        pieces += cut
        owners += [index] * len(cut)
    order = sorted(range(len(pieces)), key=lambda i: (-len(pieces[i]), i))
    rows: list[list[int]] = []
    sources: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (free tokens, row index), sorted
    for i in order:
        need = len(pieces[i])
        at = bisect.bisect_left(room, (need, -1))
        if at == len(room):  # nothing fits: open a row
            rows.append(list(pieces[i]))
            sources.append([owners[i]])
            bisect.insort(room, (seq_len - need, len(rows) - 1))
            continue
        free, row = room.pop(at)
        rows[row] += pieces[i]
        sources[row].append(owners[i])
        bisect.insort(room, (free - need, row))
    return rows, cropped, sources


def concat_sources(lengths: list[int], seq_len: int, blocks: int) -> list[list[int]]:
    """For `blocks` blocks cut from the concatenated documents of `lengths` tokens: the documents in each block."""
    sources, doc, doc_start = [], 0, 0
    for block in range(blocks):
        start, end = block * seq_len, (block + 1) * seq_len
        while doc_start + lengths[doc] <= start:  # documents that ended before this block
            doc_start += lengths[doc]
            doc += 1
        inside, first, first_start = [], doc, doc_start
        while first < len(lengths) and first_start < end:
            inside.append(first)
            first_start += lengths[first]
            first += 1
        sources.append(inside)
    return sources


class Pack(Block):
    """Tokenize + pack (`run(data, rank, world_size, num_proc)` -> a Dataset of `input_ids` rows).

    A block whose rows are blocks of tokens, not documents: `mark` packs each batch and `keep` counts
    from the per-batch counter columns; `Block.run` does the rest."""

    name = "pack"

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        seq_len: int = 4096,
        mode: str = "concat",
        text_column: str = "text",
        batch_size: int = 1000,
    ):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is invalid; use one of {list(MODES)}.")
        if tokenizer.eos_token_id is None:
            raise ValueError(
                "The tokenizer has no eos_token: packing needs one to separate documents. Set tokenizer.eos_token."
            )
        check_seq_len(seq_len)
        self.tokenizer, self.seq_len, self.mode = tokenizer, seq_len, mode
        self.text_column, self.batch_size = text_column, batch_size

    def _pack(self, *args, inputs: list[str]) -> dict:
        """A batch of documents -> its blocks; `args` are the `inputs` columns, then the rows' indices."""
        *columns, indices = args
        batch = dict(zip(inputs, columns))
        texts = batch[self.text_column]
        good = [i for i, text in enumerate(texts) if isinstance(text, str)]
        names = [
            own_id({name: batch[name][i] for name in ID_FIELDS if name in batch}) or f"input[{indices[i]}]"
            for i in good
        ]
        ids = self.tokenizer([texts[i] for i in good], add_special_tokens=False)["input_ids"] if good else []
        docs = [doc + [self.tokenizer.eos_token_id] for doc in ids]
        tokens = sum(len(d) for d in docs)
        if self.mode == "concat":
            stream = [t for d in docs for t in d]
            usable = len(stream) - len(stream) % self.seq_len
            rows = [stream[i : i + self.seq_len] for i in range(0, usable, self.seq_len)]
            tail, cropped = len(stream) - usable, 0
            sources = concat_sources([len(d) for d in docs], self.seq_len, len(rows))
        else:
            (rows, cropped, sources), tail = best_fit(docs, self.seq_len), 0
        text_bytes = sum(len(texts[i].encode("utf-8", "surrogatepass")) for i in good)
        counters = [len(texts), tokens, tail, cropped, text_bytes, len(texts) - len(good)]
        # an empty marker row carries the counters of a batch that packs nothing
        out = {"input_ids": rows or [[]], DOC_IDS: [[names[j] for j in src] for src in sources] or [[]]}
        for name, value in zip(COUNTERS, counters, strict=True):
            out[name] = [value] + [0] * (len(out["input_ids"]) - 1)
        return out

    def mark(self, data: Dataset, rank: int, world_size: int, num_proc: int | None) -> Dataset:
        """This rank's documents tokenized and packed into rows, each batch's counters on its first row."""
        data = shard(data, rank, world_size)
        check_text_column(self.name, data, self.text_column)
        if isinstance(data, IterableDataset):
            raise ValueError("pack: needs a datasets.Dataset (it reports the blocks it made), not a stream.")
        if len(data) == 0:
            raise ValueError(f"No {self.seq_len}-token block could be packed: the data has no document; add data.")
        inputs = [c for c in (self.text_column, *ID_FIELDS) if c in data.column_names]
        return data.map(
            functools.partial(self._pack, inputs=inputs),
            batched=True,
            batch_size=self.batch_size,
            with_indices=True,
            input_columns=inputs,
            num_proc=num_proc,
            remove_columns=data.column_names,
            desc=f"pack {self.mode} {self.seq_len}",
        )

    def keep(self, marked: Dataset, num_proc: int | None) -> Dataset:
        """The non-empty rows; `stats` from the counter columns (summed before the empty marker rows go)."""
        sums = {name: pc.sum(marked.data.column(name)).as_py() or 0 for name in COUNTERS}
        lengths = np.asarray(pc.list_value_length(marked.data.column("input_ids")))  # fresh from map: the rows
        lengths = lengths[lengths > 0]
        packed = marked.filter(lambda ids: [len(x) > 0 for x in ids], input_columns=["input_ids"], batched=True)
        packed = packed.remove_columns(list(COUNTERS))
        rows, packed_tokens = len(lengths), int(lengths.sum())
        self.stats = BlockStats(
            self.name,
            documents_in=sums["_documents"],
            documents_out=rows,
            bytes_in=sums["_bytes"],
            dropped={name: n for name, n in (("not_text", sums["_not_text"]), ("tail_tokens", sums["_tail"])) if n},
            extra={
                "mode": self.mode,
                "seq_len": self.seq_len,
                "tokens": sums["_tokens"],
                "blocks": rows,
                "packed_tokens": packed_tokens,
                "tail_tokens_dropped": sums["_tail"],
                "cropped_documents": sums["_cropped"],
                "padding_to_block": rows * self.seq_len - packed_tokens,
                "padding_multiple_of_8": int((-(-lengths // 8) * 8).sum()) - packed_tokens,
            },
        )
        if rows == 0:
            raise ValueError(
                f"No {self.seq_len}-token block could be packed from {sums['_documents']} documents "
                f"({sums['_tokens']} tokens); lower seq_len or add data."
            )
        return packed


def pack_dataset(
    dataset: Dataset,
    tokenizer: PreTrainedTokenizerBase,
    seq_len: int,
    cache_dir: str | Path,
    text_column: str = "text",
    num_proc: int | None = None,
    batch_size: int = 1000,
    mode: str = "concat",
) -> tuple[Dataset, BlockStats]:
    """Packed blocks (column `input_ids`) and their counters; reused from `cache_dir` when the inputs match
    (`stats.extra["reused_cache"]`)."""
    key = f"{PACK_VERSION}-{dataset._fingerprint}-{tokenizer_hash(tokenizer)}-{seq_len}-{batch_size}-{mode}"
    path = Path(cache_dir) / f"packed-{hashlib.sha1(key.encode()).hexdigest()[:16]}"
    stats_path = path / "pack_stats.json"
    if stats_path.exists():
        stats = BlockStats(**json.loads(stats_path.read_text()))
        stats.extra["reused_cache"] = True
        return load_from_disk(str(path)), stats
    pack = Pack(tokenizer, seq_len, mode, text_column, batch_size)
    packed = pack.run(dataset, num_proc=num_proc)
    packed.save_to_disk(str(path))
    pack.stats.save(stats_path)
    pack.stats.extra["reused_cache"] = False
    return load_from_disk(str(path)), pack.stats
