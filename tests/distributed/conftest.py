"""The one-process reference run that the DDP, ZeRO-3 and FSDP2 curves are held to, run once per session."""

import subprocess
import sys

import pytest

from tests.distributed.test_distributed import ENV, ROOT, SCRIPT, finish, ranks


@pytest.fixture(scope="session")
def single(tmp_path_factory):
    """One process, the whole global batch of 8 per step; then the same steps with windows and packed documents
    (`windows_documents`, dist_run.py's second run, in the same process: seconds, not a second start-up), and the
    Trainer's `evaluate()` of 13 rows (`--evaluate`)."""
    out = tmp_path_factory.mktemp("single")
    command = [sys.executable, str(SCRIPT), str(out), "8", "--windows_documents", "--evaluate"]
    finish(subprocess.Popen(command, cwd=ROOT, env=ENV, stdout=subprocess.PIPE))
    return {**ranks(out)[0], "windows_documents": ranks(out / "windows_documents")[0]}
