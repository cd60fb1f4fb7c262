"""The reader keeps every field, names every document and counts every line that cannot be one (Dataset and stream)."""

import bz2
import gzip
import json
import lzma

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from datasets import Dataset, DatasetDict

from hf_pretrain.data import load_text_dataset
from hf_pretrain.data.read import ReadFiles, list_files

BAD = {"malformed_json": 1, "missing_text": 1, "not_text": 1, "empty": 1, "invalid_utf8": 1, "too_large": 1}


def write_bad_lines(folder):
    lines = [
        json.dumps({"text": "good one"}).encode(),
        b'{"text": unterminated',
        json.dumps({"body": "no text field"}).encode(),
        json.dumps({"text": 5}).encode(),
        json.dumps({"text": "   "}).encode(),
        b'{"text": "caf\xe9"}',  # Latin-1, not UTF-8
        json.dumps({"text": "y" * 2000}).encode(),  # over max_bytes below
        b"",  # a blank separator line: no document, no count
        json.dumps({"text": "good two"}).encode(),
    ]
    (folder / "a.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    (folder / "b.jsonl").write_bytes(json.dumps({"text": "third"}).encode() + b"\n")


@pytest.mark.parametrize("streaming, num_proc", [(False, None), (False, 2), (True, None)])
def test_bad_lines_are_counted_by_reason_and_skipped(tmp_path, streaming, num_proc):
    write_bad_lines(tmp_path)
    reader = ReadFiles(max_bytes=1000)
    data = reader.run(tmp_path, num_proc=num_proc, streaming=streaming)
    assert [row["text"] for row in data] == ["good one", "good two", "third"]  # a stream counts once consumed
    assert reader.stats.dropped == BAD and reader.stats.documents_in == 9 and reader.stats.documents_out == 3
    assert reader.stats.bytes_out == len("good onegood twothird")


def test_nothing_readable_is_an_error_that_names_the_fields(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"body": "x", "id": 1}) + "\n")
    with pytest.raises(
        ValueError, match=r"text_column='text' is not a field of the records; fields are \['body', 'id'\]"
    ):
        ReadFiles().run(tmp_path)


# --- every field kept, an id per document -------------------------------------------------------------


def records(n: int = 2500) -> list[dict]:
    """Records as crawls write them: ids, URLs, nested metadata whose keys change after the first 1,000 records
    (past a batch boundary), a field with values of mixed types, records without an id."""
    out = []
    for i in range(n):
        record = {"id": i, "text": f"document {i} " + "word " * (i % 7), "url": f"https://example.com/{i}"}
        record["meta"] = {"lang": "en", "score": i / 10} if i < 1000 else {"lang": "fr", "source": {"crawl": i}}
        if i % 3 == 0:
            record["mixed"] = i if i % 2 else f"s{i}"  # an int here, a string there: kept as JSON
        if i % 500 == 7:
            del record["id"]
        out.append(record)
    return out


def expected_row(record: dict, line: int, name: str = "a.jsonl") -> dict:
    doc_id = str(record["id"]) if "id" in record else f"{name}:{line}"
    return {**record, "doc_id": doc_id}


@pytest.mark.parametrize("streaming, num_proc", [(False, None), (False, 2), (True, None)])
def test_every_field_of_a_jsonl_record_is_kept_with_a_doc_id(tmp_path, streaming, num_proc):
    recs = records()
    lines = [json.dumps(r) for r in recs]
    lines.insert(5, "")  # a blank line: no document, but it is line 6 of the file
    lines.insert(20, "{broken")
    (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")
    reader = ReadFiles()
    rows = list(reader.run(tmp_path, num_proc=num_proc, streaming=streaming))
    assert reader.stats.dropped == {"malformed_json": 1}
    numbers = [i + 1 + (i >= 5) + (i >= 19) for i in range(len(recs))]  # line numbers, counted from 1
    expected = [expected_row(r, n) for r, n in zip(recs, numbers)]
    if streaming:  # a stream has no schema: each row holds the fields of its own record
        assert rows == expected
    else:  # one schema: absent fields are None (nested ones too)
        for row, want in zip(rows, expected, strict=True):
            assert _without_nones(row) == _without_nones(want)
        assert rows[7]["doc_id"] == "a.jsonl:9" and rows[1000]["meta"] == {
            "lang": "fr",
            "score": None,
            "source": {"crawl": 1000},
        }
        assert {type(r["mixed"]) for r in rows} == {int, str, type(None)}


def _without_nones(value):
    if isinstance(value, dict):
        return {k: _without_nones(v) for k, v in value.items() if v is not None}
    return value


def test_a_records_own_doc_id_wins_and_leaves_the_fields(tmp_path):
    (tmp_path / "a.jsonl").write_text(
        json.dumps({"text": "x", "doc_id": "D1", "id": 5}) + "\n" + json.dumps({"text": "y", "id": {"k": 1}}) + "\n"
    )
    rows = list(ReadFiles().run(tmp_path))
    assert [(r["doc_id"], r["id"]) for r in rows] == [("D1", 5), ('{"k": 1}', {"k": 1})]


def test_typed_inputs_keep_their_columns_and_name_rows_by_file(tmp_path):
    for part in range(2):
        table = pa.table({"text": [f"p{part} r{r}" for r in range(3)], "meta": [{"n": r} for r in range(3)]})
        pq.write_table(table, tmp_path / f"part-{part}.parquet")
    for streaming, world_size in [(False, 1), (True, 1), (False, 2), (True, 2)]:
        rows = []
        for rank in range(world_size):
            rows += list(ReadFiles().run(tmp_path, rank=rank, world_size=world_size, streaming=streaming))
        ids = sorted(r["doc_id"] for r in rows)
        assert ids == [f"part-{p}.parquet[{r}]" for p in range(2) for r in range(3)], (streaming, world_size)
        assert all(r["meta"] == {"n": int(r["doc_id"][-2])} for r in rows)
    Dataset.from_dict({"text": ["a b", "c d"], "id": [10, 11]}).save_to_disk(str(tmp_path / "saved"))
    assert ReadFiles().run(tmp_path / "saved")["doc_id"] == ["10", "11"]
    Dataset.from_dict({"text": ["a b", "c d"]}).save_to_disk(str(tmp_path / "plain"))
    assert ReadFiles().run(tmp_path / "plain")["doc_id"] == ["plain[0]", "plain[1]"]


# --- faults: byte order marks, empty inputs, text that is not text ----------------------------------------


@pytest.mark.parametrize("streaming, num_proc", [(False, None), (False, 2), (True, None)])
def test_lines_with_a_byte_order_mark_are_read(tmp_path, streaming, num_proc):
    bom = b"\xef\xbb\xbf"
    first = bom + json.dumps({"text": "first", "id": "a"}).encode() + b"\r\n"
    (tmp_path / "a.jsonl").write_bytes(first + b'{"text": "second"}\n' + bom + b'{"text": "third", "id": "c"}\n')
    (tmp_path / "b.jsonl").write_bytes(bom + b"\n" + bom + b'{"text": "fourth"}\n')  # a BOM-only line is blank
    reader = ReadFiles()
    rows = list(reader.run(tmp_path, num_proc=num_proc, streaming=streaming))
    assert [r["text"] for r in rows] == ["first", "second", "third", "fourth"]
    assert [r["doc_id"] for r in rows] == ["a", "a.jsonl:2", "c", "b.jsonl:2"]
    assert reader.stats.dropped == {} and reader.stats.documents_in == 4


@pytest.mark.parametrize("content", [b"", b"\n\n  \n\t\n", b"\xef\xbb\xbf\n"])
@pytest.mark.parametrize("num_proc", [None, 2])
def test_empty_or_blank_files_are_one_clear_error(tmp_path, content, num_proc):
    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / name).write_bytes(content)
    with pytest.raises(ValueError, match=r"^No document could be read from '.*a.jsonl', '.*b.jsonl': .*blank") as err:
        ReadFiles().run(tmp_path, num_proc=num_proc)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="^No document could be read"):
        load_text_dataset(tmp_path / "a.jsonl")


def test_a_folder_without_input_files_is_the_same_error(tmp_path):
    (tmp_path / "notes.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"^No document could be read from input=.*no file named \*\.jsonl"):
        ReadFiles().run(tmp_path)


# --- compressed line files (datatrove writes .jsonl.gz; Dolma .json.gz; RedPajama .jsonl.zst) ---------------------


def compress(suffix: str, data: bytes) -> bytes:
    if suffix == ".zst":
        import zstandard

        half = len(data) // 2  # two frames, as files joined with cat are: both are read
        compressor = zstandard.ZstdCompressor()
        return compressor.compress(data[:half]) + compressor.compress(data[half:])
    return {".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress}[suffix](data)


@pytest.mark.parametrize("suffix", [".gz", ".bz2", ".xz", ".zst"])
@pytest.mark.parametrize("streaming, num_proc", [(False, None), (False, 2), (True, None)])
def test_compressed_line_files_read_like_plain_ones(tmp_path, suffix, streaming, num_proc):
    write_bad_lines(tmp_path)
    for plain in sorted(tmp_path.glob("*.jsonl")):
        plain.with_name(plain.name + suffix).write_bytes(compress(suffix, plain.read_bytes()))
        plain.unlink()
    reader = ReadFiles(max_bytes=1000)
    data = reader.run(tmp_path, num_proc=num_proc, streaming=streaming)
    rows = list(data)
    assert [row["text"] for row in rows] == ["good one", "good two", "third"]
    assert [row["doc_id"] for row in rows] == [f"a.jsonl{suffix}:1", f"a.jsonl{suffix}:9", f"b.jsonl{suffix}:1"]
    assert reader.stats.dropped == BAD and reader.stats.documents_in == 9


def test_a_compressed_file_cut_short_keeps_its_lines_and_counts_the_break(tmp_path):
    lines = b"".join(json.dumps({"text": f"document {i} " + "word " * 50}).encode() + b"\n" for i in range(400))
    whole = gzip.compress(lines)
    (tmp_path / "a.jsonl.gz").write_bytes(whole[: len(whole) // 2])  # a download cut short
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(b'{"text": "whole file"}\n'))
    reader = ReadFiles()
    rows = list(reader.run(tmp_path))
    read_before_the_break = len(rows) - 1
    assert 0 < read_before_the_break < 400 and rows[-1]["text"] == "whole file"
    assert [row["text"] for row in rows[:-1]] == [f"document {i} " + "word " * 50 for i in range(len(rows) - 1)]
    assert reader.stats.dropped == {"corrupt_compression": 1}  # one count for the rest of a.jsonl.gz


def broken_typed_files(folder, kind: str) -> None:
    """Three files of 200 rows: a.<kind> whole, b cut short (no footer), c with a page overwritten (Parquet;
    Arrow: c also cut, after its schema)."""
    table = pa.table({"text": [f"document {i} " + "word " * 20 for i in range(200)]})
    for name in ("a", "b", "c"):
        path = folder / f"{name}.{kind}"
        if kind == "parquet":
            pq.write_table(table, path, row_group_size=50)
        else:
            with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
                writer.write_table(table)
    whole = (folder / f"b.{kind}").read_bytes()
    (folder / f"b.{kind}").write_bytes(whole[: len(whole) // 2])  # a copy cut short
    broken = bytearray((folder / f"c.{kind}").read_bytes())
    if kind == "parquet":
        broken[len(broken) // 3 : len(broken) // 3 + 200] = bytes(range(200))  # a bad page, the footer intact
    else:
        broken = broken[:-100]
    (folder / f"c.{kind}").write_bytes(bytes(broken))


@pytest.mark.parametrize("kind", ["parquet", "arrow"])
def test_an_unreadable_typed_file_is_left_out_counted_and_named(tmp_path, kind):
    broken_typed_files(tmp_path, kind)
    reader = ReadFiles()
    rows = list(reader.run(tmp_path))
    assert [row["doc_id"] for row in rows] == [f"a.{kind}[{i}]" for i in range(200)]  # the whole file, ids its own
    assert reader.stats.extra["corrupt_files"] == ["b." + kind, "c." + kind]
    lost = {"parquet": 1 + 200, "arrow": 1 + 1}[kind]  # a readable footer tells the rows lost, else 1
    assert reader.stats.dropped == {"corrupt_file": lost} and reader.stats.documents_in == 200 + lost
    (tmp_path / f"a.{kind}").unlink()
    with pytest.raises(ValueError, match=rf"every {kind} file is corrupt or not {kind} \(b.{kind}"):
        ReadFiles().run(tmp_path / f"b.{kind}")


def test_a_file_named_gz_that_is_not_gzip_is_counted_not_a_crash(tmp_path):
    (tmp_path / "a.jsonl.gz").write_text('{"text": "not compressed at all"}\n')
    with pytest.raises(ValueError, match=r"^No document could be read .*dropped: 1 corrupt_compression"):
        ReadFiles().run(tmp_path)


def test_compression_suffixes_are_for_line_files_and_kinds_still_must_agree(tmp_path):
    (tmp_path / "a.txt.gz").write_bytes(gzip.compress(b"one line\n"))
    assert list_files(tmp_path) == ("text", [tmp_path / "a.txt.gz"])
    (tmp_path / "b.jsonl.xz").write_bytes(lzma.compress(b'{"text": "x"}\n'))
    with pytest.raises(ValueError, match=r"expected files of one kind among .*found \['json', 'text'\]"):
        list_files(tmp_path)
    (tmp_path / "c.parquet.gz").write_bytes(b"")  # Parquet compresses inside: a compressed Parquet file is no input
    with pytest.raises(ValueError, match=r"^No document could be read from x=.*line files may end in \.gz"):
        list_files(tmp_path / "c.parquet.gz", "x")


@pytest.mark.parametrize("streaming", [False, True])
def test_null_text_in_typed_inputs_is_counted_as_not_text(tmp_path, streaming):
    table = pa.table({"text": ["a document", None, "another one", "  "], "id": [1, 2, 3, 4]})
    pq.write_table(table, tmp_path / "a.parquet")
    with pa.OSFile(str(tmp_path / "b.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    Dataset(table).save_to_disk(str(tmp_path / "saved"))
    for path in (tmp_path / "a.parquet", tmp_path / "b.arrow", tmp_path / "saved"):
        reader = ReadFiles()
        rows = list(reader.run(path, streaming=streaming))
        assert [(r["text"], r["doc_id"]) for r in rows] == [("a document", "1"), ("another one", "3")], path
        assert reader.stats.dropped == {"not_text": 1, "empty": 1} and reader.stats.documents_in == 4


def test_a_typed_text_column_of_numbers_is_one_clear_error(tmp_path):
    pq.write_table(pa.table({"text": [1, 2, 3], "body": ["a", "b", "c"]}), tmp_path / "a.parquet")
    with pytest.raises(ValueError, match=r"No document could be read .* 3 not_text\. The 'text' column holds no text"):
        ReadFiles().run(tmp_path / "a.parquet")


def test_the_main_jobs_loader_skips_null_text(tmp_path, capsys):
    """`is_heldout` crashed on None: the loader now reads through the reader, for every split."""
    pq.write_table(pa.table({"text": [f"document {i}" if i % 4 else None for i in range(40)]}), tmp_path / "a.parquet")
    splits = load_text_dataset(tmp_path / "a.parquet", heldout_fraction=0.2)
    assert len(splits["train"]) + len(splits["heldout"]) == 30
    assert "not_text 10" in capsys.readouterr().out
    DatasetDict(
        train=Dataset.from_dict({"text": ["a", None, "b"]}), test=Dataset.from_dict({"text": [None, "c"]})
    ).save_to_disk(str(tmp_path / "saved"))
    splits = load_text_dataset(tmp_path / "saved")
    assert splits["train"]["text"] == ["a", "b"] and splits["heldout"]["text"] == ["c"]
    assert splits["heldout"]["doc_id"] == ["saved/test[1]"]


def _frames(suffix: str, parts: list[bytes]) -> list[bytes]:
    """Each part as its own frame / member / stream, as files joined with cat are."""
    if suffix == ".zst":
        import zstandard

        return [zstandard.ZstdCompressor().compress(p) for p in parts]
    return [{".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress}[suffix](p) for p in parts]


@pytest.mark.parametrize("suffix", [".gz", ".bz2", ".xz", ".zst"])
@pytest.mark.parametrize("where", ["first frame", "second frame", "second frame header", "last byte"])
def test_every_compression_cut_anywhere_keeps_the_lines_before_and_counts_the_break(tmp_path, suffix, where):
    docs = [f"document {i} " + "word " * 40 for i in range(2000)]  # 200 kB a frame: several zstd blocks
    lines = [json.dumps({"text": d}).encode() + b"\n" for d in docs]
    first, second = _frames(suffix, [b"".join(lines[:1000]), b"".join(lines[1000:])])
    whole = first + second
    cut = {
        "first frame": len(first) // 2,
        "second frame": len(first) + len(second) // 2,
        "second frame header": len(first) + 3,
        "last byte": len(whole) - 1,
    }[where]
    (tmp_path / f"a.jsonl{suffix}").write_bytes(whole[:cut])
    (tmp_path / "b.jsonl").write_text('{"text": "whole file"}\n')  # a bz2 block cut short yields no line at all
    reader = ReadFiles()
    *texts, last = [row["text"] for row in reader.run(tmp_path)]
    assert last == "whole file" and texts == docs[: len(texts)]  # the lines before the cut, in order, nothing half-read
    if where == "first frame":  # half-way into the first frame: what the format lets a reader decode before the cut
        # gz streams its lines out, xz a buffer at a time; bz2 and zstd decode whole blocks only (a zstd block is
        # 128 kB of text: this cut falls inside the first)
        assert len(texts) >= {".gz": 300, ".xz": 100, ".bz2": 0, ".zst": 0}[suffix], len(texts)
    if cut > len(first):
        assert len(texts) >= 1000  # every line of the whole first frame
    assert reader.stats.dropped == {"corrupt_compression": 1}, reader.stats.dropped


def test_a_wrong_text_column_behind_a_file_cut_in_its_first_block_is_one_error_naming_the_fields(tmp_path):
    whole = bz2.compress(b"".join(json.dumps({"body": f"doc {i} " + "w " * 50}).encode() + b"\n" for i in range(3000)))
    (tmp_path / "a.jsonl.bz2").write_bytes(whole[: len(whole) // 2])  # not one line decodes: bz2 decodes whole blocks
    (tmp_path / "b.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(ValueError, match=r"1 corrupt_compression, 1 missing_text.*fields are \['body'\]"):
        list(ReadFiles().run(tmp_path))
