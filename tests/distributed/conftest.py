"""The one-process reference run that the DDP, ZeRO-1/2/3 and FSDP2 curves are held to, run once per session."""

import subprocess
import sys

import pytest

from tests.distributed.test_distributed import ENV, ROOT, SCRIPT, finish, ranks


@pytest.fixture(scope="session")
def single(tmp_path_factory):
    """One process, the whole global batch of 8 per step; then the same steps with windows and packed documents
    through MoE layers (`windows_documents`, dist_run.py's second run, in the same process: seconds, not a second
    start-up), those again as 2 accumulation micro-batches of 4 rows (`windows_documents_micro`: the router losses of
    4 rows at a time, as on each of 2 data-parallel ranks; test_distributed.py's docstring), and the Trainer's
    `evaluate()` of 13 rows (`--evaluate`)."""
    out = tmp_path_factory.mktemp("single")
    command = [sys.executable, str(SCRIPT), str(out), "8", "--windows_documents", "--windows_micro_batches", "2"]
    finish(subprocess.Popen(command + ["--evaluate"], cwd=ROOT, env=ENV, stdout=subprocess.PIPE))
    also = {name: ranks(out / name)[0] for name in ("windows_documents", "windows_documents_micro")}
    return {**ranks(out)[0], **also}
