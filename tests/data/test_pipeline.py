"""`hf-pretrain data ...`: each step from the command line and the whole chain from a config, relaunchable."""

import json

import pytest
from datasets import load_from_disk
from transformers import AutoTokenizer

from hf_pretrain.cli import main
from hf_pretrain.data import embedded_documents
from hf_pretrain.data.prepared import load_packed, tokenizer_path

STAGES = ("01-documents", "02-buckets", "03-clusters", "04-tokenizer", "05-pack")


def kept_documents(out, split: str):
    """The documents the chain kept in `split`, in order (each pack task's shard)."""
    from datasets import concatenate_datasets

    shards = sorted((out / "05-pack" / "documents" / split).glob("0*"))
    return concatenate_datasets([load_from_disk(str(p)) for p in shards])


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
    first_run = (tmp_path / "out" / "03-clusters" / "tasks" / "00000.json").stat().st_mtime_ns
    assert main(["data", "prepare", str(tmp_path / "pipeline.json")]) == 0
    assert f"reused: {', '.join(STAGES)})" in capsys.readouterr().out
    assert (tmp_path / "out" / "03-clusters" / "tasks" / "00000.json").stat().st_mtime_ns == first_run


def test_single_steps_from_the_command_line(tmp_path, capsys):
    """Each step is the chain with its one section on; the next step reads the folder the last one wrote, and the
    steps one by one keep what `prepare` keeps."""
    dirty_corpus(tmp_path / "raw")
    assert main(["data", "clean", "--input", str(tmp_path / "raw"), "--output", str(tmp_path / "clean")]) == 0
    assert main(["data", "dedup", "--input", str(tmp_path / "clean"), "--output", str(tmp_path / "dedup")]) == 0
    read, clean, _ = json.loads((tmp_path / "clean" / "stats.json").read_text())
    assert read["block"] == "read" and clean["block"] == "clean" and clean["documents_in"] == read["documents_out"]
    read, exact, near, _ = json.loads((tmp_path / "dedup" / "stats.json").read_text())
    assert read["documents_in"] == clean["documents_out"] and exact["dropped"]["exact_duplicate"] >= 20
    assert near["block"] == "minhash_dedup"
    tok = ["--input", str(tmp_path / "dedup"), "--output", str(tmp_path / "tok"), "--vocab-size", "512"]
    assert main(["data", "train-tokenizer", *tok]) == 0
    assert "512 tokens; " in capsys.readouterr().out
    packed = ["--input", str(tmp_path / "dedup"), "--tokenizer", str(tmp_path / "tok"), "--output", str(tmp_path / "k")]
    assert main(["data", "pack", *packed, "--seq-len", "128"]) == 0
    config = {"input": str(tmp_path / "raw"), "output_dir": str(tmp_path / "all"), "heldout_fraction": 0.0}
    (tmp_path / "all.json").write_text(json.dumps({**config, "tokenizer": None, "pack": None}))
    assert main(["data", "prepare", str(tmp_path / "all.json")]) == 0
    one_by_one = kept_documents(tmp_path / "k", "train")
    assert one_by_one["doc_id"] == kept_documents(tmp_path / "all", "train")["doc_id"]
    assert sum(len(ids) for ids in load_packed(tmp_path / "k")["train"]["doc_ids"]) >= len(one_by_one)


def test_fields_survive_the_chain_and_blocks_name_their_documents(tmp_path):
    """read -> clean -> dedup -> split -> pack keeps every field of the kept records, and each packed block
    holds exactly the documents its doc_ids name, in order."""
    docs = embedded_documents()[:120]
    recs = [
        {"id": f"doc-{i}", "text": d, "url": f"https://example.com/{i}", "meta": {"source": "pydoc", "n": i}}
        for i, d in enumerate(docs)
    ]
    recs += [{**recs[3], "id": "copy-of-3"}]  # an exact duplicate: dropped by dedup, fields and all
    raw = tmp_path / "raw.jsonl"
    raw.write_text("".join(json.dumps(r) + "\n" for r in recs))
    config = {
        "input": str(raw),
        "output_dir": str(tmp_path / "out"),
        "num_proc": 2,
        "heldout_fraction": 0.1,
        "clean": {"min_tokens": 1},
        "tokenizer": {"vocab_size": 400},
        "pack": {"seq_len": 4096, "mode": "best_fit"},
    }
    (tmp_path / "pipeline.json").write_text(json.dumps(config))
    assert main(["data", "prepare", str(tmp_path / "pipeline.json")]) == 0
    by_id = {r["id"]: r for r in recs}
    split = {name: kept_documents(tmp_path / "out", name) for name in ("train", "heldout")}
    kept = [row for name in ("train", "heldout") for row in split[name]]
    assert "copy-of-3" not in {row["doc_id"] for row in kept} and len(kept) >= 100
    for row in kept:  # every field as it was in the file (clean rewrites only the text)
        original = by_id[row["doc_id"]]
        assert {k: row[k] for k in ("id", "url", "meta")} == {k: original[k] for k in ("id", "url", "meta")}
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path(tmp_path / "out")))
    for name in ("train", "heldout"):
        text_of = {row["doc_id"]: row["text"] for row in split[name]}
        packed = load_packed(tmp_path / "out")[name]
        assert sorted(i for ids in packed["doc_ids"] for i in ids) == sorted(text_of)  # each document once
        for block in packed:
            named = tokenizer([text_of[i] for i in block["doc_ids"]], add_special_tokens=False)["input_ids"]
            assert block["input_ids"] == [t for ids in named for t in (*ids, tokenizer.eos_token_id)]


def error_line(capsys) -> str:
    """The one line the command printed for bad input: the last of stderr (datasets' progress bars come before)."""
    err = capsys.readouterr().err
    line = err.rstrip("\n").split("\n")[-1].split("\r")[-1]
    assert line.startswith("error: ") and err.endswith(line + "\n"), err[-2000:]
    return line


def test_bad_input_is_one_line_naming_the_path_or_the_key(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["data", "clean", "--input", str(tmp_path / "missing"), "--output", str(out)]) == 2
    assert error_line(capsys) == f"error: input={str(tmp_path / 'missing')!r} does not exist; " + (
        "pass a file, a folder of files or a save_to_disk folder."
    )
    (tmp_path / "empty.jsonl").write_text("\n \n")
    assert main(["data", "dedup", "--input", str(tmp_path / "empty.jsonl"), "--output", str(tmp_path / "read")]) == 2
    line = error_line(capsys)
    assert line.startswith("error: No document could be read from ") and "empty.jsonl" in line and "blank" in line
    dirty_corpus(tmp_path / "raw")
    clean = ["data", "clean", "--input", str(tmp_path / "raw"), "--output", str(out)]
    assert main([*clean, "--config", '{"min_token": 16}']) == 2
    line = error_line(capsys)
    assert "unknown key(s) ['min_token']" in line and "'min_tokens'" in line
    config = {"input": str(tmp_path / "raw"), "output_dir": str(out)}
    for section, values, expected in [
        ("clean", {"min_token": 16}, "section 'clean' has unknown key(s) ['min_token']; valid keys are ["),
        ("dedup", {"treshold": 0.7}, "section 'dedup' has unknown key(s) ['treshold']; valid keys are ["),
        ("tokenizer", {"vocab": 512}, "section 'tokenizer' has unknown key(s) ['vocab']; valid keys are ["),
        ("pack", {"seq_len": 4}, "section 'pack': seq_len=4 is too small"),
        ("perplexity", {"threshold": 100}, "section 'perplexity' lacks ['model_path']"),
        ("perplexity", {"model_path": "no/scorer"}, "section 'perplexity': model_path='no/scorer' cannot be loaded"),
        ("tokenizer", {"path": "no/tok"}, "section 'tokenizer': path='no/tok' cannot be loaded (no such folder)"),
    ]:
        (tmp_path / "p.json").write_text(json.dumps({**config, section: values}))
        assert main(["data", "prepare", str(tmp_path / "p.json")]) == 2
        assert error_line(capsys).startswith(f"error: {tmp_path / 'p.json'}: {expected}")
        assert not out.exists()  # refused before any data work
    missing = str(tmp_path / "missing")  # an input that does not exist: refusing a flag first shows nothing was read
    for argv, expected in [
        (["pack", "--tokenizer", "no/tok"], "error: --tokenizer='no/tok' cannot be loaded (no such folder); give a"),
        (["filter", "--model", "no/scorer"], "error: model_path='no/scorer' cannot be loaded (no such folder)"),
        (["train-tokenizer", "--vocab-size", "10"], "error: vocab_size=10 is too small"),
        (["train-tokenizer", "--vocab-size", "512", "--heldout-fraction", "1.5"], "error: --heldout-fraction=1.5"),
    ]:
        assert main(["data", argv[0], "--input", missing, "--output", str(out), *argv[1:]]) == 2
        assert error_line(capsys).startswith(expected)


@pytest.mark.parametrize(
    "settings, expected",
    [
        (
            {"heldout_fraction": "0.05"},
            "heldout_fraction='0.05' is a string; expected a number: write \"heldout_fraction\": 0.05, without quotes.",
        ),
        (
            {"pack": {"seq_len": "128"}},
            "section 'pack': seq_len='128' is a string; expected a whole number: write \"seq_len\": 128, without quotes.",
        ),
        ({"num_proc": True}, "num_proc=True is a boolean; expected a whole number or null."),
        (
            {"clean": {"min_tokens": 3.5}},
            "section 'clean': min_tokens=3.5 is a decimal number; expected a whole number or null.",
        ),
        ({"dedup": {"exact": "no"}}, "section 'dedup': exact='no' is a string; expected true or false."),
        (
            {"tokenizer": {"vocab_size": [512]}},
            "section 'tokenizer': vocab_size=[512] is a list; expected a whole number.",
        ),
        (
            {"executor": {"kind": "local", "mem_per_cpu_gb": "2"}},
            "section 'executor': mem_per_cpu_gb='2' is a string; expected a number: write \"mem_per_cpu_gb\": 2, without quotes.",
        ),
    ],
)
def test_a_value_of_the_wrong_type_is_one_line_naming_the_field_the_type_and_the_value(
    tmp_path, capsys, settings, expected
):
    """A JSON config has no types of its own: each field and section key is checked against its annotation before a
    block compares it with anything (no `'<=' not supported between ...`, no `seq_len=128 is too small`)."""
    dirty_corpus(tmp_path / "raw")
    config = {"input": str(tmp_path / "raw"), "output_dir": str(tmp_path / "out"), **settings}
    (tmp_path / "p.json").write_text(json.dumps(config))
    assert main(["data", "prepare", str(tmp_path / "p.json")]) == 2
    assert error_line(capsys) == f"error: {tmp_path / 'p.json'}: {expected}"
    assert not (tmp_path / "out").exists()  # refused before any data work


def test_an_output_dir_that_is_a_file_and_a_bad_number_of_tasks_are_one_line_before_any_data_work(tmp_path, capsys):
    tasks_zero = {"executor": {"kind": "local", "tasks": 0}}
    dirty_corpus(tmp_path / "raw")
    (tmp_path / "taken").write_text("a file, not a folder")
    for output_dir, where in (("taken", "is a file"), ("taken/out", f"is inside {str(tmp_path / 'taken')!r}, a file")):
        path = tmp_path / "p.json"
        path.write_text(json.dumps({"input": str(tmp_path / "raw"), "output_dir": str(tmp_path / output_dir)}))
        assert main(["data", "prepare", str(path)]) == 2
        assert error_line(capsys) == (
            f"error: {path}: output_dir={str(tmp_path / output_dir)!r} {where}: pass a folder (it is created when missing)."
        )
    path.write_text(json.dumps({"input": str(tmp_path / "raw"), "output_dir": str(tmp_path / "out")}))
    for flag, value, expected in (
        ("--tasks", "0", "--tasks 0 is invalid: use a number of shards >= 1 (e.g. --tasks 8)."),
        ("--tasks", "-3", "--tasks -3 is invalid: use a number of shards >= 1 (e.g. --tasks 8)."),
        ("--workers", "0", "--workers 0 is invalid: use a number of tasks at once >= 1, or -1 for all."),
    ):
        assert main(["data", "prepare", str(path), "--executor", "local", flag, value]) == 2
        assert error_line(capsys) == f"error: {expected}"
        assert not (tmp_path / "out").exists()
    path.write_text(json.dumps({"input": str(tmp_path / "raw"), "output_dir": str(tmp_path / "out"), **tasks_zero}))
    assert main(["data", "prepare", str(path)]) == 2  # the section's field named once, as the flag is
    assert error_line(capsys) == f"error: {path}: section 'executor': tasks=0: use a number of shards >= 1 (e.g. 8)."
    step = ["data", "clean", "--input", str(tmp_path / "raw"), "--output", str(tmp_path / "out"), "--num-proc", "0"]
    assert main(step) == 2  # the flag the user typed, not the config field behind it
    assert (
        error_line(capsys) == "error: --num-proc 0 is invalid: use a number of tasks at once >= 1 (e.g. --num-proc 4)."
    )
    assert not (tmp_path / "out").exists()


def test_a_step_runs_again_when_its_settings_or_input_change(tmp_path, capsys):
    """Steps are reused under the same key only: a new `pack` section re-packs, an edited input file re-reads."""
    raw = tmp_path / "raw.jsonl"
    raw.write_text("".join(json.dumps({"text": d}) + "\n" for d in embedded_documents()[:120]))
    config = {
        "input": str(raw),
        "output_dir": str(tmp_path / "out"),
        "heldout_fraction": 0.1,
        "dedup": {"verbose": False},
        "tokenizer": {"vocab_size": 300},
        "pack": {"seq_len": 128, "mode": "concat"},
    }
    (tmp_path / "p.json").write_text(json.dumps(config))
    assert main(["data", "prepare", str(tmp_path / "p.json")]) == 0
    assert len(load_packed(tmp_path / "out")["train"][0]["input_ids"]) == 128
    (tmp_path / "p.json").write_text(json.dumps({**config, "pack": {"seq_len": 64, "mode": "concat"}}))
    capsys.readouterr()
    assert main(["data", "prepare", str(tmp_path / "p.json")]) == 0
    assert f"reused: {', '.join(STAGES[:-1])})" in capsys.readouterr().out  # only the pack stage ran again
    assert len(load_packed(tmp_path / "out")["train"][0]["input_ids"]) == 64  # not the 128-token blocks
    with raw.open("a") as f:
        f.write(json.dumps({"text": " ".join(["a new document with enough words to be kept"] * 8)}) + "\n")
    assert main(["data", "prepare", str(tmp_path / "p.json")]) == 0
    assert "complete from an earlier run" not in capsys.readouterr().out  # the read changed: every stage ran again
    stats = {s["block"]: s for s in json.loads((tmp_path / "out" / "stats.json").read_text())}
    assert stats["read"]["documents_in"] == 121


def test_a_heldout_split_too_small_for_one_block_is_left_unpacked_with_the_reason(tmp_path):
    """The input's own `validation` split is the held-out one (not re-split by hash: cleaned, not deduplicated); too
    short for a block."""
    from datasets import Dataset, DatasetDict

    from hf_pretrain.data.chain import run_pipeline
    from hf_pretrain.data.pipeline_config import PipelineConfig

    train = Dataset.from_dict({"text": embedded_documents()[:80], "id": [f"t{i}" for i in range(80)]})
    held = Dataset.from_dict({"text": ["a short held-out text"], "id": ["h0"]})
    DatasetDict(train=train, validation=held).save_to_disk(str(tmp_path / "saved"))
    config = PipelineConfig(
        input=str(tmp_path / "saved"),
        output_dir=str(tmp_path / "out"),
        clean={"min_tokens": 1},
        dedup={"verbose": False},
        tokenizer={"vocab_size": 300},
        pack={"seq_len": 64, "mode": "concat"},
    )
    stats = {s.block: s for s in run_pipeline(config, verbose=False)}
    assert stats["read"].documents_out == 80 and stats["read heldout"].documents_out == 1
    assert stats["split"].extra == {
        "train": stats["minhash_dedup"].documents_out,
        "heldout": 1,
        "heldout_fraction": None,
    }
    assert stats["clean heldout"].documents_in == 1  # the document blocks ran on it; dedup did not
    assert "exact_dedup heldout" not in stats
    assert stats["pack heldout"].extra["skipped"].startswith("No 64-token block could be packed from 1 documents")
    assert set(load_packed(tmp_path / "out")) == {"train"}
