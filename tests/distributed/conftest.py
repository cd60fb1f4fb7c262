"""The one-process reference run that the DDP, ZeRO-3 and FSDP2 curves are held to, run once per session."""

import subprocess
import sys

import pytest

from tests.distributed.test_distributed import ENV, ROOT, SCRIPT, finish, ranks


@pytest.fixture(scope="session")
def single(tmp_path_factory):
    """One process, the whole global batch of 8 per step."""
    out = tmp_path_factory.mktemp("single")
    process = subprocess.Popen([sys.executable, str(SCRIPT), str(out), "8"], cwd=ROOT, env=ENV, stdout=subprocess.PIPE)
    finish(process)
    return ranks(out)[0]
