"""The tokenizer step: trains on a dataset column, skips invalid input with a count, loads with AutoTokenizer."""

import json

from transformers import AutoTokenizer

from hf_pretrain.cli import main
from hf_pretrain.data import embedded_documents


def test_train_tokenizer_cli_counts_invalid_utf8_and_round_trips_any_input(tmp_path, capsys):
    docs = embedded_documents()[:300]
    lines = [json.dumps({"text": d}).encode() for d in docs]
    lines.insert(50, b'{"text": "caf\xe9 in Latin-1, not UTF-8"}')
    (tmp_path / "raw.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    out = tmp_path / "tok"
    argv = ["data", "train-tokenizer", "--input", str(tmp_path / "raw.jsonl"), "--output", str(out)]
    assert main(argv + ["--vocab-size", "600", "--heldout-fraction", "0.1"]) == 0
    stats = {s["block"]: s for s in json.loads((out / "stats.json").read_text())}
    read, trained = stats["read"], stats["tokenizer"]
    assert read["documents_in"] == 301 and read["dropped"] == {"invalid_utf8": 1}
    assert trained["documents_in"] + stats["split"]["extra"]["heldout"] == 300  # trained on train, measured on held-out
    assert trained["extra"]["bytes_per_token_on"] == "held-out"
    assert trained["extra"]["bytes_per_token"] > 1.5
    assert "bytes/token on held-out text" in capsys.readouterr().out
    loaded = AutoTokenizer.from_pretrained(str(out))
    assert len(loaded) == 600 and loaded.eos_token == "<|eos|>" and loaded.pad_token == "<|pad|>"
    for text in ("2024-11-30: 12345 items", "naïve café — 東京 🚀", "\x00\x01 tabs\tand\nnewlines"):
        ids = loaded(text, add_special_tokens=False)["input_ids"]
        assert loaded.decode(ids) == text and loaded.unk_token_id not in ids  # byte-level: never <unk>
    digits = loaded.convert_ids_to_tokens(loaded("12345", add_special_tokens=False)["input_ids"])
    assert digits == ["1", "2", "3", "4", "5"]  # digits split one per token
