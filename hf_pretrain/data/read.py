"""Read documents from files into `datasets`, keeping every field and counting every line that cannot be a document.

Inputs: JSON Lines (`.jsonl`, `.json` one object per line), plain text (`.txt`, `.md`: one
document per line, as `datasets`' text loader), Parquet, Arrow files, and `save_to_disk` folders;
a path may be a file or a folder of files of one kind.

What comes out: the text column, every other field as a column, and `doc_id`.

- Fields: every field of a JSON record becomes a column (objects become structs, arrays lists),
  as the columns of a Parquet or Arrow input stay columns; a field missing from a record is null
  there. Arrow holds one type per column, so the types of a field are unified over the whole
  input (an integer and a float give a float, null goes with anything, objects merge their keys);
  a field whose values cannot be unified (a number here, a string there) is kept as JSON
  (`datasets.Json`: Python objects again on access). Every later block keeps every column.
- `doc_id` (a string) says where a document came from: the record's own `doc_id`, else its `id`
  (as text), else where it was read: `part-0.jsonl:17` (line 17, counted from 1) or
  `part-0.parquet[16]` (row 16, counted from 0; `saved[16]` for a `save_to_disk` folder), the file
  named relative to the input folder. `Pack` keeps the `doc_ids` of every block it packs.

A bad line or row never crashes the read: it becomes a dropped row with its reason, counted in
`ReadFiles.stats` like any block's drops:

- `invalid_utf8`   the line's bytes are not UTF-8 (counted and skipped, never decoded with
                   replacement characters that the tokenizer would learn);
- `malformed_json` the line is not a JSON object;
- `missing_text`   the object has no `text_column` field;
- `not_text`       the text is not a string (a number, a list, null; in Parquet, Arrow and
                   `save_to_disk` inputs as in JSON Lines);
- `empty`          the text is empty or only whitespace;
- `too_large`      the line (the text, for typed inputs) is over `max_bytes` (default 10 MB; a
                   document of tens of MB is almost always a dump, a table or a base64 blob).

A UTF-8 byte order mark at the start of a line (files written by Windows tools, or several such
files joined with `cat`) is not part of the line. When nothing at all can be read (a folder with
no input file, empty or blank files, every line bad), `run` raises one ValueError, "No document
could be read from ...", that names the files, what was dropped and the fix.

Line files are split between ranks by file (`rank`, `world_size`: every machine reads its own
files) and between `num_proc` worker processes; typed inputs are split by contiguous rows. The
output is cached by `datasets` under a key made of the paths, sizes and modification times, so a
re-read of unchanged files is free.

Written by hand: `datasets.load_dataset("json")` stops at the first malformed line, has no
per-line error counts and fails on records whose fields differ between blocks of the file; the
per-line work here is one `json.loads`, and the fields are turned into columns after the read,
with the types unified over every record (one more `json.loads` of the non-text fields).
"""

from __future__ import annotations

import bisect
import codecs
import functools
import hashlib
import json
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from datasets import Dataset, DatasetDict, Features, IterableDataset, Json, Value, load_dataset, load_from_disk

from .blocks import (
    BYTES_IN,
    BYTES_OUT,
    DROP,
    FIRST,
    HELPER_COLUMNS,
    PLACEHOLDER,
    BlockStats,
    check_rank,
    count_and_keep,
    count_and_keep_streaming,
    shard_range,
)
from .workers import children_die_with_parent

LINE_SUFFIXES = {".jsonl": "json", ".json": "json", ".txt": "text", ".md": "text"}
TYPED_SUFFIXES = {".parquet": "parquet", ".arrow": "arrow"}
MAX_BYTES = 10_000_000
DOC_ID = "doc_id"
ID_FIELDS = (DOC_ID, "id")  # a record's own id, in this order of preference
RECORD = "_record"  # a JSON record's other fields, JSON-encoded, until they become columns
SCHEMA = "_schema"
RESERVED = (DOC_ID, RECORD, SCHEMA, *HELPER_COLUMNS)
BOM = codecs.BOM_UTF8
VERSION = "read-3"  # in the cache key: a new output format never reuses an old cache


def text_reason(text: object, max_bytes: int) -> str:
    """Why `text` is not a document ("" when it is one)."""
    if not isinstance(text, str):
        return "not_text"
    if len(text) * 4 > max_bytes and len(text.encode("utf-8", "surrogatepass")) > max_bytes:
        return "too_large"
    return "" if text.strip() else "empty"


def own_id(record: dict) -> str | None:
    """The record's own id as text (`doc_id`, else `id`), or None."""
    for name in ID_FIELDS:
        value = record.get(name)
        if value is not None:
            return value if isinstance(value, str) else json.dumps(value)
    return None


def _row(text_column: str, text: str, drop: str, size: int, doc_id: str, fields: str = "") -> dict:
    out_bytes = len(text.encode("utf-8")) if not drop else 0
    return {
        text_column: text,
        DOC_ID: doc_id,
        RECORD: fields,
        DROP: drop,
        FIRST: True,
        BYTES_IN: size,
        BYTES_OUT: out_bytes,
    }


def parse_line(line: bytes, kind: str, text_column: str, max_bytes: int, where: str = "") -> dict:
    """One input line -> a row: the text, its id and other fields, or "" with the reason it is not a document."""
    size = len(line)
    if size > max_bytes:
        return _row(text_column, "", "too_large", size, where)
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        return _row(text_column, "", "invalid_utf8", size, where)
    doc_id, fields = where, ""
    if kind == "json":
        try:
            record = json.loads(text)
        except json.JSONDecodeError:
            return _row(text_column, "", "malformed_json", size, where)
        if not isinstance(record, dict):
            return _row(text_column, "", "malformed_json", size, where)
        if text_column not in record:
            return _row(text_column, "", "missing_text", size, where)
        text = record.pop(text_column)
        doc_id = own_id(record) or where
        record.pop(DOC_ID, None)  # the doc_id column holds it
        fields = json.dumps(record) if record else ""
    reason = text_reason(text, max_bytes)
    return _row(text_column, "" if reason else text, reason, size, doc_id, "" if reason else fields)


def read_lines(files: list[tuple[str, str, int, int]], text_column: str, max_bytes: int):
    """Rows of line-format `files`: (path, name in ids, size, mtime); size and mtime make the cache key change."""
    rows = 0
    for path, name, _, _ in files:
        kind = LINE_SUFFIXES[Path(path).suffix]
        with open(path, "rb") as f:
            for number, line in enumerate(f, start=1):
                line = line.rstrip(b"\r\n")
                if line.startswith(BOM):
                    line = line[len(BOM) :]
                if kind == "json" and not line.strip():
                    continue  # blank separator lines of a JSONL file are not documents
                rows += 1
                yield parse_line(line, kind, text_column, max_bytes, f"{name}:{number}")
    if not rows:  # empty or blank files
        yield {**_row(text_column, "", PLACEHOLDER, 0, ""), FIRST: False}


def line_features(text_column: str) -> Features:
    return Features(
        {
            text_column: Value("string"),
            DOC_ID: Value("string"),
            RECORD: Value("string"),
            DROP: Value("string"),
            FIRST: Value("bool"),
            BYTES_IN: Value("int64"),
            BYTES_OUT: Value("int64"),
        }
    )


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
    files = sorted(p for p in (path.rglob("*") if path.is_dir() else [path]) if p.suffix in suffixes and p.is_file())
    kinds = {suffixes[p.suffix] for p in files}
    if not kinds:
        raise ValueError(
            f"No document could be read from {field}={str(path)!r}: it holds no file named *{', *'.join(suffixes)} "
            "and is no save_to_disk folder; pass such files or a folder of them."
        )
    if len(kinds) != 1:
        raise ValueError(
            f"{field}={str(path)!r}: expected files of one kind among {sorted(suffixes)}, found {sorted(kinds)}."
        )
    return kinds.pop(), files


def _names(root: Path, files: list[Path]) -> list[str]:
    """How ids name each file: its path relative to the input folder (its name for a single file)."""
    return [p.relative_to(root).as_posix() if root.is_dir() else p.name for p in files]


def _rows_in(path: Path, kind: str) -> int:
    if kind == "parquet":
        return pq.ParquetFile(path).metadata.num_rows
    with pa.memory_map(str(path)) as source:  # datasets' arrow builder reads both IPC formats
        try:
            return pa.ipc.open_stream(source).read_all().num_rows
        except pa.ArrowInvalid:
            return pa.ipc.open_file(source).count_rows()


def _described(files: list[str]) -> str:
    shown = ", ".join(repr(f) for f in files[:3])
    return shown + (f" and {len(files) - 3} more" if len(files) > 3 else "")


# --- the fields of JSON records as columns -----------------------------------------------------


def _batch_schema(records: list[str]) -> dict:
    """The Arrow type of each field in a batch of JSON-encoded records (a field of mixed types marked JSON)."""
    rows = [json.loads(r) if r else {} for r in records]
    fields = []
    for name in dict.fromkeys(name for row in rows for name in row):
        try:
            fields.append(pa.field(name, pa.array([row.get(name) for row in rows]).type))
        except (pa.ArrowException, OverflowError, TypeError, ValueError):
            fields.append(pa.field(name, pa.string(), metadata={b"json": b"1"}))
    return {SCHEMA: [pa.schema(fields).serialize().to_pybytes()]}


def unified_features(schemas: list[pa.Schema]) -> Features:
    """One feature per field over every batch's schema: unified types, or `Json()` where they cannot be."""
    by_name: dict[str, list[pa.Field]] = {}
    for schema in schemas:
        for f in schema:
            by_name.setdefault(f.name, []).append(f)
    features = {}
    for name, fields in by_name.items():
        if name in RESERVED:
            raise ValueError(f"The records have a field {name!r}, a column name the data chain uses itself; rename it.")
        if any(f.metadata and f.metadata.get(b"json") for f in fields):
            features[name] = Json()
            continue
        try:
            unified = pa.unify_schemas([pa.schema([f]) for f in fields], promote_options="permissive")
            features[name] = Features.from_arrow_schema(unified)[name]
        except (pa.ArrowException, TypeError, ValueError):
            features[name] = Json()
    return Features(features)


def _fields_as_columns(batch: dict, names: list[str]) -> dict:
    rows = [json.loads(r) if r else {} for r in batch[RECORD]]
    return {name: [row.get(name) for row in rows] for name in names}


def unpack_fields(data: Dataset, num_proc: int | None = None) -> Dataset:
    """Turn the JSON-encoded `RECORD` column into one column per field (module docstring: types)."""
    schemas = data.map(
        _batch_schema,
        batched=True,
        batch_size=1000,
        input_columns=[RECORD],
        remove_columns=data.column_names,
        num_proc=num_proc,
        desc="read: field types",
    )
    fields = unified_features([pa.ipc.read_schema(pa.py_buffer(s)) for s in schemas[SCHEMA]])
    features = Features({name: f for name, f in data.features.items() if name != RECORD} | fields)
    return data.map(
        functools.partial(_fields_as_columns, names=list(fields)),
        batched=True,
        remove_columns=[RECORD],
        features=features,
        num_proc=num_proc,
        desc="read: fields",
    )


def _unpack_row(row: dict) -> dict:
    return json.loads(row[RECORD]) if row[RECORD] else {}


# --- typed inputs: Parquet, Arrow, save_to_disk ------------------------------------------------


def _mark_rows(*args, inputs: list[str], offset: int, text_column: str, max_bytes: int, starts: list, names: list):
    """Drop reasons, sizes and ids of a batch of typed rows: `args` are the `inputs` columns, then the row
    indices (plus `offset`: positions in the whole input, whose files `names` begin at rows `starts`)."""
    *columns, indices = args
    batch = dict(zip(inputs, columns))
    texts = batch[text_column]
    reasons = [text_reason(t, max_bytes) for t in texts]
    sizes = [len(t.encode("utf-8", "surrogatepass")) if isinstance(t, str) else 0 for t in texts]
    ids = []
    for i, index in enumerate(indices):
        own = own_id({name: batch[name][i] for name in ID_FIELDS if name in batch})
        at = bisect.bisect_right(starts, offset + index) - 1
        ids.append(own or f"{names[at]}[{offset + index - starts[at]}]")
    return {
        DOC_ID: ids,
        DROP: reasons,
        FIRST: [True] * len(texts),
        BYTES_IN: sizes,
        BYTES_OUT: [0 if r else s for r, s in zip(reasons, sizes)],
    }


class ReadFiles:
    """Read the documents at `path` (see the module docstring); `stats` counts lines and drops."""

    name = "read"

    def __init__(self, text_column: str = "text", max_bytes: int = MAX_BYTES):
        if text_column in RESERVED:
            raise ValueError(f"text_column={text_column!r} is a column name the data chain uses itself; rename it.")
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
        root = Path(path)
        if kind == "disk":
            data = load_from_disk(str(files[0]))
            if not isinstance(data, Dataset):
                data = data["train"] if "train" in data else next(iter(data.values()))
            return self.read_dataset(data, root.name, rank, world_size, num_proc, streaming)
        if kind in TYPED_SUFFIXES.values():
            data = load_dataset(kind, data_files=[str(p) for p in files], split="train", streaming=streaming)
            starts = [0]
            for p in files[:-1]:
                starts.append(starts[-1] + _rows_in(p, kind))
            return self.read_dataset(data, _names(root, files), rank, world_size, num_proc, streaming, starts)
        return self._read_lines(files, _names(root, files), rank, world_size, num_proc, streaming)

    def _read_lines(self, files, names, rank, world_size, num_proc, streaming) -> Dataset | IterableDataset:
        self.stats = BlockStats(self.name)
        start = time.perf_counter()
        mine = [(str(p), n, p.stat().st_size, p.stat().st_mtime_ns) for p, n in zip(files, names)][rank::world_size]
        if not mine:
            raise ValueError(
                f"rank {rank} of {world_size} has no file to read: {len(files)} file(s) ({_described(names)}); "
                "use at most as many ranks as files, or split the files."
            )
        kwargs = {"files": mine, "text_column": self.text_column, "max_bytes": self.max_bytes}
        features = line_features(self.text_column)
        if streaming:
            rows = IterableDataset.from_generator(read_lines, gen_kwargs=kwargs, features=features)
            return count_and_keep_streaming(rows, self.stats, start).map(_unpack_row, remove_columns=[RECORD])
        key = hashlib.sha1(json.dumps({**kwargs, "version": VERSION}, sort_keys=True).encode()).hexdigest()[:16]
        marked = Dataset.from_generator(
            read_lines,
            gen_kwargs=kwargs,
            features=features,
            num_proc=min(num_proc, len(mine)) if num_proc else None,
            fingerprint=key,
        )
        has_fields = len(marked) and (pc.max(pc.binary_length(marked.data.column(RECORD))).as_py() or 0) > 0
        data = count_and_keep(marked, self.stats, num_proc)
        self._check_something_read(data, [p for p, *_ in mine], "line")
        data = unpack_fields(data, num_proc) if has_fields else data.remove_columns(RECORD)
        self.stats.seconds = time.perf_counter() - start
        return data

    @children_die_with_parent()
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
        self.stats = BlockStats(self.name)
        start = time.perf_counter()
        names, starts = ([names], [0]) if isinstance(names, str) else (names, starts)
        columns = data.column_names
        if columns is not None and self.text_column not in columns:
            raise ValueError(f"text_column={self.text_column!r} is not in the data; columns are {columns}.")
        if streaming and isinstance(data, Dataset):
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
            if world_size > 1:
                marked = marked.filter(lambda _, i: i % world_size == rank, with_indices=True)
            return count_and_keep_streaming(marked, self.stats, start)
        first, stop = shard_range(len(data), rank, world_size)
        marked = data.select(range(first, stop)).map(
            functools.partial(mark, offset=first),
            batched=True,
            with_indices=True,
            input_columns=inputs,
            num_proc=num_proc,
            desc="read",
        )
        kept = count_and_keep(marked, self.stats, num_proc)
        self._check_something_read(kept, names, "row")
        self.stats.seconds = time.perf_counter() - start
        return kept

    def _check_something_read(self, data: Dataset, files: list[str], unit: str) -> None:
        """The one error when no document came out: the files, what was dropped and the fix."""
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
        with open(files[0], "rb") as f:
            for line in f:
                try:
                    record = json.loads(line.removeprefix(BOM))
                except ValueError:
                    continue
                if isinstance(record, dict):
                    return sorted(record)
        return []


def read_splits(path: str | Path, text_column: str = "text", num_proc: int | None = None) -> DatasetDict:
    """Every split at `path` through the reader: a save_to_disk DatasetDict keeps its splits, anything else is `train`.
    Prints the drop counts of a split that had any."""
    kind, _ = list_files(path, field="dataset_path")
    loaded = load_from_disk(str(path)) if kind == "disk" else None
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
