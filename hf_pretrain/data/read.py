"""Read documents from files into `datasets`, keeping every field and counting every line that cannot be a document.

Inputs: JSON Lines, plain text (one document per line), either compressed (`.gz`, `.bz2`, `.xz`, `.zst`:
`records.open_lines`), Parquet, Arrow files and `save_to_disk` folders; a path is a file or a folder of files of
one kind, or an fsspec URL (`s3://bucket/prefix`) whose objects are such files, read streamed (`storage.py`).
Out: the text column, every other field as a column (types unified over the whole input, JSON where they cannot
be), and `doc_id` (the record's own id, else where it was read: `part-0.jsonl:17`).

A bad line or row never crashes the read: it becomes a dropped row with its reason (`invalid_utf8`,
`malformed_json`, `missing_text`, `not_text`, `empty`, `too_large`, `corrupt_compression`), counted in
`ReadFiles.stats` like any block's drops; a Parquet or Arrow file that cannot be read (cut short, not the format
its name says, a broken page) is left out whole and counted as `corrupt_file` (its rows when its footer tells them,
else 1) and named in `stats.extra["corrupt_files"]`; when nothing at all can be read, `run` raises one ValueError naming the
files, the drops and the fix. Line files are split between ranks by file and between `num_proc` workers; typed
inputs by contiguous rows. The output is cached by `datasets` under the paths, sizes and modification times (an
object's ETag).

Written by hand: `datasets.load_dataset("json")` stops at the first malformed line, has no per-line error counts
and fails on records whose fields differ between blocks of the file. Every rule, with examples: docs/data.md.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from datasets import Dataset, DatasetDict, IterableDataset, load_dataset, load_from_disk
from datasets.exceptions import DatasetGenerationError

from .blocks import Block, check_rank, check_text_column, shard_range
from .prepared import documents_folder, load_split
from .records import (
    BOM,
    COMPRESSIONS,
    ID_FIELDS,
    LINE_SUFFIXES,
    MAX_BYTES,
    RECORD,
    RESERVED,
    TYPED_SUFFIXES,
    _mark_rows,
    _unpack_row,
    file_kind,
    line_features,
    open_lines,
    read_lines,
    stream_errors,
    unpack_fields,
)
from .storage import is_url, list_objects, open_binary, relative_name, stat

FILE_SUFFIXES = {**LINE_SUFFIXES, **TYPED_SUFFIXES}
VERSION = "read-3"  # in the cache key: a new output format never reuses an old cache


def list_files(path: str | Path, field: str = "input") -> tuple[str, list]:
    """The kind of input at `path` ("disk", "json", "text", "parquet", "arrow") and its files: local paths, or the
    URLs of the objects under an fsspec URL (`storage.list_objects`)."""
    if is_url(path):
        return _one_kind(str(path), field, [name for name in list_objects(str(path), field) if file_kind(Path(name))])
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"{field}={str(path)!r} does not exist; pass a file, a folder of files or a save_to_disk folder."
        )
    if (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists() or documents_folder(path):
        return "disk", [path]
    files = sorted(p for p in (path.rglob("*") if path.is_dir() else [path]) if file_kind(p) and p.is_file())
    return _one_kind(str(path), field, files)


def _one_kind(path: str, field: str, files: list) -> tuple[str, list]:
    kinds = {file_kind(Path(p)) for p in files}
    if not kinds:
        raise ValueError(
            f"No document could be read from {field}={path!r}: it holds no file named *{', *'.join(FILE_SUFFIXES)} "
            f"(line files may end in {', '.join(COMPRESSIONS)}) and is no save_to_disk folder; pass such files or a "
            "folder of them."
        )
    if len(kinds) != 1:
        raise ValueError(
            f"{field}={path!r}: expected files of one kind among {sorted(set(FILE_SUFFIXES.values()))}, found "
            f"{sorted(kinds)}."
        )
    return kinds.pop(), files


def load_saved(path: str | Path) -> Dataset | DatasetDict:
    """A `save_to_disk` folder, or the documents a `prepare` kept (`prepared.documents_folder`): its train shards,
    with its held-out shards as a DatasetDict when it kept any."""
    documents = documents_folder(path)
    if documents is None:
        return load_from_disk(str(path))
    train, heldout = load_split(documents / "train"), None
    if (documents / "heldout").is_dir():
        heldout = load_split(documents / "heldout")
    return DatasetDict(train=train, heldout=heldout) if heldout is not None and len(heldout) else train


def _names(root: str | Path, files: list) -> list[str]:
    """How ids name each file: its path relative to the input folder or URL (its name for a single file)."""
    if is_url(root):
        return [relative_name(str(root), name) for name in files]
    root = Path(root)
    return [p.relative_to(root).as_posix() if root.is_dir() else p.name for p in files]


@contextlib.contextmanager
def _source(path, kind: str):
    """What pyarrow reads a typed file from: the object's stream (a URL), a memory map (a local Arrow file), or the
    path (a local Parquet file)."""
    if is_url(path):
        with open_binary(path) as stream:
            yield stream
    elif kind == "arrow":
        with pa.memory_map(str(path)) as source:
            yield source
    else:
        yield path


def _rows_in(path, kind: str) -> int:
    with _source(path, kind) as source:
        if kind == "parquet":
            return pq.ParquetFile(source).metadata.num_rows
        try:  # datasets' arrow builder reads both IPC formats
            return sum(batch.num_rows for batch in pa.ipc.open_stream(source))
        except pa.ArrowInvalid:
            source.seek(0)
            return pa.ipc.open_file(source).count_rows()


def _reads_whole(path, kind: str) -> bool:
    """Whether every page of a typed file reads (after `datasets` failed on one of them)."""
    try:
        if kind == "parquet":
            with _source(path, kind) as source:
                for _ in pq.ParquetFile(source).iter_batches():
                    pass
        else:
            _rows_in(path, kind)
    except (pa.ArrowException, OSError):
        return False
    return True


@dataclass
class TypedFiles:
    """The Parquet or Arrow files that open, their names and rows; those that do not, and the rows they held
    (their footer's count when it reads, else 1: at least one document was lost)."""

    paths: list[Path]
    names: list[str]
    rows: list[int]
    broken: dict[str, int]

    @classmethod
    def check(cls, kind: str, files: list[Path], names: list[str]) -> TypedFiles:
        checked = cls([], [], [], {})
        for path, name in zip(files, names):
            try:
                rows = _rows_in(path, kind)
            except (pa.ArrowException, OSError):
                checked.broken[name] = 1
                continue
            checked.paths.append(path)
            checked.names.append(name)
            checked.rows.append(rows)
        return checked

    def without_unreadable_pages(self, kind: str) -> TypedFiles:
        """These files less those with a page that does not read (their footer's rows counted)."""
        kept = TypedFiles([], [], [], dict(self.broken))
        for path, name, rows in zip(self.paths, self.names, self.rows):
            if _reads_whole(path, kind):
                kept.paths.append(path)
                kept.names.append(name)
                kept.rows.append(rows)
            else:
                kept.broken[name] = max(rows, 1)
        return kept

    def described_broken(self) -> str:
        return ", ".join(self.broken)


def _stream_rows(kind: str, files: list[str]):
    yield from load_dataset(kind, data_files=files, split="train", streaming=True)


def _streamed_to_arrow(kind: str, files: list[str]) -> Dataset:
    """Typed objects read as a stream into `datasets`' Arrow cache, as a local file is loaded: `load_dataset` without
    `streaming` would first download every object whole into its download cache."""
    stream = load_dataset(kind, data_files=files, split="train", streaming=True)
    key = hashlib.sha1(json.dumps([kind, [[f, *stat(f)] for f in files], VERSION]).encode()).hexdigest()[:16]
    gen_kwargs = {"kind": kind, "files": files}
    return Dataset.from_generator(_stream_rows, gen_kwargs=gen_kwargs, features=stream.features, fingerprint=key)


def _described(files: list[str]) -> str:
    shown = ", ".join(repr(f) for f in files[:3])
    return shown + (f" and {len(files) - 3} more" if len(files) > 3 else "")


class ReadFiles(Block):
    """Read the documents at `path` (see the module docstring); `stats` counts lines and drops.

    A block whose input is a path: `mark` turns the files (or a typed dataset, `read_dataset`) into
    rows with the helper columns, and `Block.run` counts and keeps them like any block's."""

    name = "read"

    def __init__(self, text_column: str = "text", max_bytes: int = MAX_BYTES):
        if text_column in RESERVED:
            raise ValueError(f"text_column={text_column!r} is a column name the data chain uses itself; rename it.")
        super().__init__()
        self.text_column, self.max_bytes = text_column, max_bytes
        self.streaming = False
        self._source: dict = {}  # of the current run: names/starts of typed input, what finish checks

    def run(
        self,
        path: str | Path,
        rank: int = 0,
        world_size: int = 1,
        num_proc: int | None = None,
        streaming: bool = False,
    ) -> Dataset | IterableDataset:
        self.streaming = streaming
        if not isinstance(path, (str, Path)):  # a loaded dataset: its rows are named by position
            self._source = {"names": ["input"], "starts": [0]}
        return super().run(path, rank, world_size, num_proc)

    def read_dataset(
        self,
        data: Dataset | IterableDataset,
        names: str | list[str],
        rank: int = 0,
        world_size: int = 1,
        num_proc: int | None = None,
        streaming: bool = False,
        starts: list[int] | None = None,
    ) -> Dataset | IterableDataset:
        """Rows of a typed input (loaded Parquet, Arrow or save_to_disk data) that are documents, each with a
        `doc_id`; `names` names the input's files, which begin at rows `starts` (one name: the whole input)."""
        self.streaming = streaming
        self._source = {"names": [names] if isinstance(names, str) else names, "starts": starts or [0]}
        return super().run(data, rank, world_size, num_proc)

    def mark(self, data, rank: int, world_size: int, num_proc: int | None) -> Dataset | IterableDataset:
        if not isinstance(data, (str, Path)):
            return self._mark_typed(data, rank, world_size, num_proc)
        kind, files = list_files(data)
        root = data if is_url(data) else Path(data)
        if kind == "disk":
            loaded = load_saved(files[0])
            if not isinstance(loaded, Dataset):
                loaded = loaded["train"] if "train" in loaded else next(iter(loaded.values()))
            self._source = {"names": [root.name], "starts": [0]}
            return self._mark_typed(loaded, rank, world_size, num_proc)
        if kind in TYPED_SUFFIXES.values():
            typed = TypedFiles.check(kind, files, _names(root, files))
            loaded, typed = self._load_typed(kind, typed)
            starts = [0]
            for rows in typed.rows[:-1]:
                starts.append(starts[-1] + rows)
            self._source = {"names": typed.names, "starts": starts, "broken": typed.broken if rank == 0 else {}}
            if self.streaming:
                self._count_broken()  # a stream's counters add up as it is read
            return self._mark_typed(loaded, rank, world_size, num_proc)
        return self._mark_lines(files, _names(root, files), rank, world_size, num_proc)

    def _load_typed(self, kind: str, typed: TypedFiles) -> tuple[Dataset | IterableDataset, TypedFiles]:
        """The readable files as one dataset; a page that fails to read leaves its file out (a second load)."""
        if not typed.paths:
            raise ValueError(
                f"No document could be read: every {kind} file is corrupt or not {kind} ({typed.described_broken()}); "
                "pass files that open (a cut copy: copy it again)."
            )
        load = functools.partial(load_dataset, kind, split="train", streaming=self.streaming)
        files = [str(p) for p in typed.paths]
        try:
            if is_url(files[0]) and not self.streaming:
                return _streamed_to_arrow(kind, files), typed
            return load(data_files=files), typed
        except DatasetGenerationError:
            if self.streaming:
                raise
        typed = typed.without_unreadable_pages(kind)
        return self._load_typed(kind, typed)

    def _count_broken(self) -> None:
        """The unreadable typed files in the counters: `corrupt_file` drops, named in `extra`."""
        broken = self._source.get("broken") or {}
        if broken:
            s = self.stats
            s.documents_in += sum(broken.values())
            s.dropped["corrupt_file"] = s.dropped.get("corrupt_file", 0) + sum(broken.values())
            s.extra["corrupt_files"] = list(broken)

    def keep(self, marked, num_proc):
        kept = super().keep(marked, num_proc)
        self._count_broken()
        return kept

    def _mark_lines(self, files, names, rank, world_size, num_proc) -> Dataset | IterableDataset:
        mine = [(str(p), n, *stat(p)) for p, n in zip(files, names)][rank::world_size]
        if not mine:
            raise ValueError(
                f"rank {rank} of {world_size} has no file to read: {len(files)} file(s) ({_described(names)}); "
                "use at most as many ranks as files, or split the files."
            )
        kwargs = {"files": mine, "text_column": self.text_column, "max_bytes": self.max_bytes}
        features = line_features(self.text_column)
        self._source = {"read": [p for p, *_ in mine], "unit": "line", "num_proc": num_proc}
        if self.streaming:
            return IterableDataset.from_generator(read_lines, gen_kwargs=kwargs, features=features)
        key = hashlib.sha1(json.dumps({**kwargs, "version": VERSION}, sort_keys=True).encode()).hexdigest()[:16]
        marked = Dataset.from_generator(
            read_lines,
            gen_kwargs=kwargs,
            features=features,
            num_proc=min(num_proc, len(mine)) if num_proc else None,
            fingerprint=key,
        )
        record_bytes = pc.max(pc.binary_length(marked.data.column(RECORD))).as_py() if len(marked) else 0
        self._source["has_fields"] = (record_bytes or 0) > 0
        return marked

    def _mark_typed(self, data, rank, world_size, num_proc) -> Dataset | IterableDataset:
        """Typed rows with their drop reasons and ids (`names`, `starts` of the input in `self._source`)."""
        names, starts = self._source["names"], self._source["starts"]
        self._source.update(read=names, unit="row")
        check_text_column(self.name, data, self.text_column)
        columns = data.column_names
        if self.streaming and isinstance(data, Dataset):
            data = data.to_iterable_dataset()
        inputs = [c for c in (self.text_column, *ID_FIELDS) if columns is None or c in columns]
        mark = functools.partial(
            _mark_rows,
            inputs=inputs,
            text_column=self.text_column,
            max_bytes=self.max_bytes,
            starts=starts,
            names=names,
        )
        if isinstance(data, IterableDataset):
            # Ids come from positions in the whole stream, so this rank's rows are taken after marking (every rank
            # reads the stream); datasets' split_dataset_by_node would restart the positions in each rank's files.
            check_rank(rank, world_size)
            marked = data.map(functools.partial(mark, offset=0), batched=True, with_indices=True, input_columns=inputs)
            return marked.filter(lambda _, i: i % world_size == rank, with_indices=True) if world_size > 1 else marked
        first, stop = shard_range(len(data), rank, world_size)
        mine = data.select(range(first, stop))
        if len(mine) == 0:
            self.check_something_read(mine, names, "row")
        return mine.map(
            functools.partial(mark, offset=first),
            batched=True,
            with_indices=True,
            input_columns=inputs,
            num_proc=num_proc,
            desc="read",
        )

    def finish(self, kept: Dataset) -> Dataset:
        """The one error when nothing was read; the fields of JSON records as columns."""
        source = self._source
        self.check_something_read(kept, source["read"], source["unit"])
        if source["unit"] != "line":
            return kept
        return unpack_fields(kept, source["num_proc"]) if source["has_fields"] else kept.remove_columns(RECORD)

    def finish_stream(self, kept: IterableDataset) -> IterableDataset:
        return kept.map(_unpack_row, remove_columns=[RECORD]) if self._source["unit"] == "line" else kept

    def check_something_read(self, data, files: list[str], unit: str) -> None:
        """The one error when no document came out (`data` is empty): the files, what was dropped (`self.stats`) and
        the fix."""
        if len(data):
            return
        s = self.stats
        dropped = ", ".join(f"{n:,} {reason}" for reason, n in sorted(s.dropped.items(), key=lambda x: -x[1]))
        message = f"No document could be read from {_described(files)}"
        if not s.documents_in:
            fix = (
                f"{message}: the files are empty or hold only blank lines; pass files with one document per {unit}"
                + (f" (JSON Lines: one object with a {self.text_column!r} field per line)." if unit == "line" else ".")
            )
            raise ValueError(fix)
        message += f": {s.documents_in:,} {unit}(s), dropped: {dropped}."
        if "missing_text" in s.dropped:
            fields = self._fields_of_first_record(files)
            fix = f"text_column={self.text_column!r} is not a field of the records; fields are {fields}."
        elif unit == "row" and set(s.dropped) == {"not_text"}:
            fix = f"The {self.text_column!r} column holds no text: pass the column that does as text_column."
        else:
            fix = "Fix those lines (each reason is explained in docs/data.md) or pass other files."
        raise ValueError(f"{message} {fix}")

    def _fields_of_first_record(self, files: list[str]) -> list[str]:
        """The fields of the first record that parses, for the error message (a file that breaks first is passed)."""
        for path in files:
            try:
                with open_lines(path) as f:
                    for line in f:
                        try:
                            record = json.loads(line.removeprefix(BOM))
                        except ValueError:
                            continue
                        if isinstance(record, dict):
                            return sorted(record)
            except stream_errors():
                continue
        return []


def read_splits(path: str | Path, text_column: str = "text", num_proc: int | None = None) -> DatasetDict:
    """Every split at `path` through the reader: a save_to_disk DatasetDict keeps its splits, anything else is `train`.
    Prints the drop counts of a split that had any."""
    kind, _ = list_files(path, field="dataset_path")
    loaded = load_saved(path) if kind == "disk" else None
    if not isinstance(loaded, DatasetDict):
        reader = ReadFiles(text_column)
        splits = {"train": reader.run(path, num_proc=num_proc)}
        readers = {"train": reader}
    else:
        if "train" not in loaded:
            raise ValueError(f"dataset_path={str(path)!r} has splits {list(loaded)}, no 'train'; save one named train.")
        readers = {name: ReadFiles(text_column) for name in loaded if name == "train" or len(loaded[name])}
        splits = {
            name: reader.read_dataset(loaded[name], f"{Path(path).name}/{name}", num_proc=num_proc)
            for name, reader in readers.items()
        }
    for name, reader in readers.items():
        if reader.stats.dropped:
            print(f"[data] {path} ({name}): {reader.stats.summary()}")
    return DatasetDict(splits)
