"""The background writer's exchange of a save's outcome (resume/background.py) with a peer lost, on real gloo ranks:
the failure is this rank's write error, not a writer thread that dies without a word (then the checkpoint was
neither promoted nor reported, and `auto` resumed an older one quietly)."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.mark.distributed
def test_an_exchange_that_fails_is_the_writes_error_and_nothing_is_promoted(tmp_path):
    script = ROOT / "tests" / "distributed" / "exchange_fault.py"
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path), free_port()], cwd=ROOT, capture_output=True, text=True, timeout=180
    )
    record = json.loads((tmp_path / "rank0.json").read_text())
    assert record["done"] and not record["promoted"], (record, proc.stderr[-2000:])
    assert record["error"] and "failed on [0]" in record["error"], record
    assert "could not agree on the write's outcome" in record["error"], record
