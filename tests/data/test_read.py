"""The reader counts every line that cannot be a document, the same way for a Dataset and a stream."""

import json

import pytest

from hf_pretrain.data.read import ReadFiles

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
