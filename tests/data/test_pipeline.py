"""`hf-pretrain data ...`: each step from the command line and the whole chain from a config, relaunchable."""

import json

from hf_pretrain.cli import main
from hf_pretrain.data import embedded_documents
from hf_pretrain.data.pipeline import load_packed


def dirty_corpus(folder):
    """The embedded corpus with what real crawls hold: duplicates, HTML, malformed and non-UTF-8 lines."""
    docs = embedded_documents()
    lines = [json.dumps({"text": d}).encode() for d in docs]
    lines += [json.dumps({"text": d}).encode() for d in docs[:20]]  # exact duplicates
    lines += [json.dumps({"text": "<p>" + d.replace(" the ", " a ", 1) + "</p>"}).encode() for d in docs[20:30]]
    lines += [b'{"text": "unterminated', b'{"body": "no text field"}', b'{"text": "caf\xe9"}', b""]
    folder.mkdir()
    (folder / "part-0.jsonl").write_bytes(b"\n".join(lines[::2]) + b"\n")
    (folder / "part-1.jsonl").write_bytes(b"\n".join(lines[1::2]) + b"\n")
    return len(docs)


def test_prepare_runs_the_chain_and_a_relaunch_reuses_complete_steps(tmp_path, capsys):
    n = dirty_corpus(tmp_path / "raw")
    config = {
        "input": str(tmp_path / "raw"),
        "output_dir": str(tmp_path / "out"),
        "num_proc": 2,
        "heldout_fraction": 0.05,
        "tokenizer": {"vocab_size": 512},
        "pack": {"seq_len": 128, "mode": "best_fit"},
    }
    (tmp_path / "pipeline.json").write_text(json.dumps(config))
    assert main(["data", "prepare", str(tmp_path / "pipeline.json")]) == 0
    table = capsys.readouterr().out
    stats = {s["block"]: s for s in json.loads((tmp_path / "out" / "stats.json").read_text())}
    assert stats["read"]["documents_in"] == n + 20 + 10 + 3  # the blank line is no document
    assert stats["read"]["dropped"] == {"malformed_json": 1, "missing_text": 1, "invalid_utf8": 1}
    assert stats["exact_dedup"]["dropped"].get("exact_duplicate", 0) >= 20
    assert stats["minhash_dedup"]["dropped"].get("near_duplicate", 0) >= 8  # the HTML copies, once cleaned
    assert stats["tokenizer"]["extra"]["bytes_per_token_on"] == "held-out"
    packed = load_packed(tmp_path / "out")
    assert set(packed) == {"train", "heldout"} and all(len(ids) <= 128 for ids in packed["train"]["input_ids"])
    assert stats["pack train"]["extra"]["tokens"] == sum(len(ids) for ids in packed["train"]["input_ids"])
    for step in ("read", "clean", "dedup", "tokenizer", "pack"):
        assert step in table
    first_run = (tmp_path / "out" / "03-dedup" / "stats.json").stat().st_mtime_ns
    assert main(["data", "prepare", str(tmp_path / "pipeline.json")]) == 0
    assert "reused: read, clean, dedup, split, tokenizer, pack" in capsys.readouterr().out
    assert (tmp_path / "out" / "03-dedup" / "stats.json").stat().st_mtime_ns == first_run


def test_single_steps_from_the_command_line(tmp_path):
    dirty_corpus(tmp_path / "raw")
    assert main(["data", "clean", "--input", str(tmp_path / "raw"), "--output", str(tmp_path / "clean")]) == 0
    assert main(["data", "dedup", "--input", str(tmp_path / "clean"), "--output", str(tmp_path / "dedup")]) == 0
    read, clean = json.loads((tmp_path / "clean" / "stats.json").read_text())
    assert read["block"] == "read" and clean["block"] == "clean" and clean["documents_in"] == read["documents_out"]
    _, exact, near = json.loads((tmp_path / "dedup" / "stats.json").read_text())
    assert exact["dropped"]["exact_duplicate"] >= 20 and near["block"] == "minhash_dedup"
