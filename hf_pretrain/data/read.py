"""Read documents from files into `datasets`, counting every line that cannot be a document.

Inputs: JSON Lines (`.jsonl`, `.json` one object per line), plain text (`.txt`, `.md`: one
document per line, as `datasets`' text loader), Parquet, Arrow files, and `save_to_disk` folders;
a path may be a file or a folder of files of one kind. The typed formats (Parquet, Arrow,
`save_to_disk`) go through `datasets` as they are; the line formats go through `read_lines`,
which never crashes on a bad line: each becomes a dropped row with its reason, counted in
`ReadFiles.stats` like any block's drops:

- `invalid_utf8`   the line's bytes are not UTF-8 (counted and skipped, never decoded with
                   replacement characters that the tokenizer would learn);
- `malformed_json` the line is not a JSON object;
- `missing_text`   the object has no `text_column` field;
- `not_text`       the field is not a string (a number, a list, null);
- `empty`          the text is empty or only whitespace;
- `too_large`      the line is over `max_bytes` (default 10 MB; a document of tens of MB is
                   almost always a dump, a table or a base64 blob).

Files are split between ranks (`rank`, `world_size`: every machine reads its own files) and
between `num_proc` worker processes. The output dataset is cached by `datasets` under a key made
of the paths, sizes and modification times, so a re-read of unchanged files is free.

Written by hand: `datasets.load_dataset("json")` stops at the first malformed line and has no
per-line error counts; the per-line work here is one `json.loads`.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from datasets import Dataset, IterableDataset, load_dataset, load_from_disk

from .blocks import BYTES_IN, BYTES_OUT, DROP, FIRST, BlockStats, count_and_keep, count_and_keep_streaming, shard
from .workers import children_die_with_parent

LINE_SUFFIXES = {".jsonl": "json", ".json": "json", ".txt": "text", ".md": "text"}
TYPED_SUFFIXES = {".parquet": "parquet", ".arrow": "arrow"}
MAX_BYTES = 10_000_000


def _row(text: str, drop: str, size: int) -> dict:
    return {"text": text, DROP: drop, FIRST: True, BYTES_IN: size, BYTES_OUT: len(text.encode("utf-8"))}


def parse_line(line: bytes, kind: str, text_column: str, max_bytes: int) -> dict:
    """One input line -> a row: the text, or "" with the reason it is not a document."""
    size = len(line)
    if size > max_bytes:
        return _row("", "too_large", size)
    try:
        decoded = line.decode("utf-8")
    except UnicodeDecodeError:
        return _row("", "invalid_utf8", size)
    if kind == "json":
        try:
            record = json.loads(decoded)
        except json.JSONDecodeError:
            return _row("", "malformed_json", size)
        if not isinstance(record, dict):
            return _row("", "malformed_json", size)
        if text_column not in record:
            return _row("", "missing_text", size)
        decoded = record[text_column]
        if not isinstance(decoded, str):
            return _row("", "not_text", size)
    if not decoded.strip():
        return _row("", "empty", size)
    return _row(decoded, "", size)


def read_lines(files: list[tuple[str, int, int]], text_column: str, max_bytes: int):
    """Generator over the rows of line-format `files` ((path, size, mtime) so the cache key changes with them)."""
    for path, _, _ in files:
        kind = LINE_SUFFIXES[Path(path).suffix]
        with open(path, "rb") as f:
            for line in f:
                line = line.rstrip(b"\r\n")
                if kind == "json" and not line.strip():
                    continue  # blank separator lines of a JSONL file are not documents
                yield parse_line(line, kind, text_column, max_bytes)


def list_files(path: str | Path, field: str = "input") -> tuple[str, list[Path]]:
    """The kind of input at `path` ("disk", "json", "text", "parquet", "arrow") and its files."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"{field}={str(path)!r} does not exist; pass a file, a folder of files or a save_to_disk folder."
        )
    if (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists():
        return "disk", [path]
    suffixes = {**LINE_SUFFIXES, **TYPED_SUFFIXES}
    files = sorted(p for p in (path.rglob("*") if path.is_dir() else [path]) if p.suffix in suffixes)
    kinds = {suffixes[p.suffix] for p in files}
    if len(kinds) != 1:
        raise ValueError(
            f"{field}={str(path)!r}: expected files of one kind among {sorted(suffixes)}, found {sorted(kinds) or 'none'}."
        )
    return kinds.pop(), files


class ReadFiles:
    """Read the documents at `path` (see the module docstring); `stats` counts lines and drops."""

    name = "read"

    def __init__(self, text_column: str = "text", max_bytes: int = MAX_BYTES):
        self.text_column, self.max_bytes = text_column, max_bytes
        self.stats = BlockStats(self.name)

    @children_die_with_parent()
    def run(
        self,
        path: str | Path,
        rank: int = 0,
        world_size: int = 1,
        num_proc: int | None = None,
        streaming: bool = False,
    ) -> Dataset | IterableDataset:
        kind, files = list_files(path)
        self.stats = BlockStats(self.name)
        start = time.perf_counter()
        if kind in ("disk", "parquet", "arrow"):
            data = self._typed(kind, files, streaming)
            return shard(data, rank, world_size)
        mine = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files[rank::world_size]]
        if not mine:
            raise ValueError(f"rank {rank} of {world_size} has no file to read: {len(files)} file(s) at {str(path)!r}.")
        kwargs = {"files": mine, "text_column": self.text_column, "max_bytes": self.max_bytes}
        if streaming:
            return self._streaming(IterableDataset.from_generator(read_lines, gen_kwargs=kwargs), start)
        key = hashlib.sha1(json.dumps(kwargs, sort_keys=True).encode()).hexdigest()[:16]
        marked = Dataset.from_generator(
            read_lines, gen_kwargs=kwargs, num_proc=min(num_proc or 1, len(mine)) if num_proc else None, fingerprint=key
        )
        data = count_and_keep(marked, self.stats, num_proc)
        self.stats.seconds = time.perf_counter() - start
        if len(data) == 0:
            raise ValueError(self._nothing_read(mine[0][0]))
        return data.rename_column("text", self.text_column) if self.text_column != "text" else data

    def _nothing_read(self, first_file: str) -> str:
        message = f"No document could be read: {self.stats.summary()}."
        if "missing_text" in self.stats.dropped:
            with open(first_file, "rb") as f:
                fields = sorted(json.loads(f.readline() or b"{}"))
            message += f" text_column={self.text_column!r} is not a field of the records; fields are {fields}."
        return message

    def _typed(self, kind: str, files: list[Path], streaming: bool) -> Dataset | IterableDataset:
        if kind == "disk":
            data = load_from_disk(str(files[0]))
            if not isinstance(data, Dataset):
                data = data["train"] if "train" in data else next(iter(data.values()))
            data = data.to_iterable_dataset() if streaming else data
        else:
            data = load_dataset(kind, data_files=[str(p) for p in files], split="train", streaming=streaming)
        columns = data.column_names
        if columns is not None and self.text_column not in columns:
            raise ValueError(f"text_column={self.text_column!r} is not in the data; columns are {columns}.")
        if not streaming:
            self.stats.documents_in = self.stats.documents_out = len(data)
        return data

    def _streaming(self, rows: IterableDataset, start: float) -> IterableDataset:
        data = count_and_keep_streaming(rows, self.stats, start)
        return data.rename_column("text", self.text_column) if self.text_column != "text" else data
