"""The attempts record of a real 2-rank gloo launch that nothing relaunches: a rank SIGKILLed at a known step is
recorded as killed, with its rank and the step, by the time the launch has ended (before, the record waited for a
next start: the survivor's "Connection closed by peer" stood as the end, on rank 0, or nothing did)."""

import subprocess
import sys

import pytest

from hf_pretrain.training.recovery.attempts import KILLED, read_attempts
from tests.distributed.test_distributed import CONFIGS, ENV, ROOT, free_port

SCRIPT = ROOT / "tests" / "training" / "killed_rank.py"

pytestmark = pytest.mark.distributed


def launch_and_kill(out, rank: int, step: int) -> subprocess.CompletedProcess:
    config = ["--config_file", str(CONFIGS / "cpu_2proc.yaml"), "--main_process_port", str(free_port())]
    command = [sys.executable, "-m", "accelerate.commands.launch", *config, str(SCRIPT), str(out), str(rank), str(step)]
    return subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("rank", [1, pytest.param(0, marks=pytest.mark.exhaustive)])
def test_a_rank_killed_with_no_relaunch_is_recorded_with_its_rank_and_step(tmp_path, rank):
    """Rank 1 killed: rank 0 is SIGTERMed by the launcher (or sees its peer go first); rank 0 killed: nothing of
    it writes. The recorder settles either by the time the launch returns (it holds the launch's stderr)."""
    result = launch_and_kill(tmp_path, rank, step=3)
    assert result.returncode != 0, result.stdout[-3000:] + result.stderr[-3000:]
    (attempt,) = read_attempts(tmp_path)
    assert (attempt.ended, attempt.failed_rank, attempt.last_step) == (KILLED, rank, 3), attempt
    assert attempt.end_time is not None and attempt.end_time >= attempt.started
