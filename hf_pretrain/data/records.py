"""What the reader makes of one line or row: a document with its fields and `doc_id`, or a reason to drop it.

`parse_line` turns one line of a JSON Lines or text file into a row (text, `doc_id`, the other
fields JSON-encoded, and the helper columns of `blocks.py` with the drop reason); `read_lines`
yields the rows of a list of files; `_mark_rows` marks a batch of typed rows (Parquet, Arrow,
`save_to_disk`). `unpack_fields` then turns the JSON-encoded fields into one column per field,
with the types unified over every record (`unified_features`; a field whose values cannot be
unified is kept as `datasets.Json`). The reasons and the id rules are in `read.py`'s docstring.
"""

from __future__ import annotations

import bisect
import bz2
import codecs
import contextlib
import functools
import gzip
import io
import json
import lzma
import zlib
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
from datasets import Dataset, Features, Json, Value

from .blocks import BYTES_IN, BYTES_OUT, DROP, FIRST, HELPER_COLUMNS, PLACEHOLDER
from .storage import open_binary

LINE_SUFFIXES = {".jsonl": "json", ".json": "json", ".txt": "text", ".md": "text"}
TYPED_SUFFIXES = {".parquet": "parquet", ".arrow": "arrow"}
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")  # of line files: part-0.jsonl.gz (datatrove's default), .json.zst
MAX_BYTES = 10_000_000
DOC_ID = "doc_id"
ID_FIELDS = (DOC_ID, "id")  # a record's own id, in this order of preference
RECORD = "_record"  # a JSON record's other fields, JSON-encoded, until they become columns
SCHEMA = "_schema"
RESERVED = (DOC_ID, RECORD, SCHEMA, *HELPER_COLUMNS)
BOM = codecs.BOM_UTF8


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


def file_kind(path: Path) -> str | None:
    """ "json", "text", "parquet" or "arrow" by the file's name (a line file may end in a compression suffix)."""
    name = path.name
    compression = next((c for c in COMPRESSIONS if name.endswith(c)), "")
    suffix = Path(name.removesuffix(compression)).suffix if compression else path.suffix
    return LINE_SUFFIXES.get(suffix) if compression else {**LINE_SUFFIXES, **TYPED_SUFFIXES}.get(suffix)


@contextlib.contextmanager
def open_lines(path: str | Path) -> Iterator[io.BufferedIOBase]:
    """The file's bytes, decompressed by its suffix (`COMPRESSIONS`); a local path or a URL (`storage.py`: streamed)."""
    name = str(path)
    with open_binary(name) as raw, _decompressed(raw, name) as opened:
        yield opened


def _decompressed(raw: io.BufferedIOBase, name: str) -> io.BufferedIOBase:
    """A reader of `raw`'s decompressed bytes by the suffix of `name` (`raw` itself when none)."""
    if name.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if name.endswith(".bz2"):
        return bz2.BZ2File(raw, "rb")
    if name.endswith(".xz"):
        return lzma.LZMAFile(raw, "rb")
    if name.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raise ValueError(f"{name}: reading .zst files needs the zstandard package: pip install zstandard") from None
        return io.BufferedReader(ZstdFrames(raw, zstandard.ZstdDecompressor()))
    return raw


class ZstdFrames(io.RawIOBase):
    """The bytes of every frame of a `.zst` stream (files joined with cat have several), and EOFError when the
    stream ends inside a frame, as gzip, bz2 and lzma raise. Written by hand: zstandard's `stream_reader` (with
    `read_across_frames`) returns what it decoded so far and stops at a cut as if the file were whole."""

    CHUNK = 1 << 17

    def __init__(self, raw: io.BufferedIOBase, decompressor):
        super().__init__()
        self._raw, self._decompressor = raw, decompressor
        self._frame = None  # the decompressor of the frame being read; None between frames
        self._out, self._at = b"", 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self._at == len(self._out):
            chunk = self._raw.read(self.CHUNK)
            if not chunk:
                if self._frame is not None:
                    raise EOFError("Compressed file ended before the end-of-stream marker was reached")
                return 0
            self._out, self._at = self._decode(chunk), 0
        n = min(len(buffer), len(self._out) - self._at)
        buffer[:n] = self._out[self._at : self._at + n]
        self._at += n
        return n

    def _decode(self, data: bytes) -> bytes:
        out = []
        while data:
            self._frame = self._frame or self._decompressor.decompressobj()
            out.append(self._frame.decompress(data))
            if not self._frame.eof:
                break
            data, self._frame = self._frame.unused_data, None
        return b"".join(out)

    def close(self) -> None:
        self._raw.close()
        super().close()


def stream_errors() -> tuple[type[BaseException], ...]:
    """What a broken compressed stream raises while it is read (cut short, or its bytes damaged)."""
    errors: tuple[type[BaseException], ...] = (EOFError, OSError, zlib.error, lzma.LZMAError)
    try:
        import zstandard
    except ImportError:
        return errors
    return (*errors, zstandard.ZstdError)


def read_lines(files: list[tuple[str, str, int, int | str]], text_column: str, max_bytes: int):
    """Rows of line-format `files`: (path or URL, name in ids, size, version: mtime or ETag, `storage.stat`); size and
    version make the cache key change.

    A compressed file whose stream breaks (cut short, damaged) gives the lines before the break and one
    `corrupt_compression` row (`name:after N`): the rest of that file cannot be read, and is counted, not hidden."""
    rows = 0
    for path, name, _, _ in files:
        kind = file_kind(Path(path))
        compressed = Path(path).name.endswith(COMPRESSIONS)
        number, broken = 0, stream_errors() if compressed else ()
        with open_lines(path) as f:
            lines = enumerate(f, start=1)
            while True:
                try:
                    number, line = next(lines)
                except StopIteration:
                    break
                except broken:
                    rows += 1
                    yield _row(text_column, "", "corrupt_compression", 0, f"{name}:after {number}")
                    break
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
