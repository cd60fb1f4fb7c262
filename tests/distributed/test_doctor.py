"""`hf-pretrain doctor --distributed` under a real launcher, and its checks against known failures."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_pretrain.distributed.doctor import RankFacts, find_mismatches, interface_problems, probe_port

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(command, env=None, timeout=180):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.distributed
def test_two_ranks_report_one_table_links_and_flag_a_wrong_interface():
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
    ]
    command += ["-m", "hf_pretrain.cli", "doctor", "--distributed", "--megabytes", "1"]
    ok = run(command)
    assert ok.returncode == 0, ok.stdout + ok.stderr[-3000:]
    lines = ok.stdout.splitlines()
    table = [line for line in lines if line[:4].strip() in ("0", "1")]
    assert len(table) == 2 and all(torch.__version__[:12] in row for row in table)
    assert any(line.startswith("all-reduce of 1 MB over 2 ranks") for line in lines)
    assert any(line.startswith("link 0 <-> 1") for line in lines) and "no mismatch across ranks" in ok.stdout
    # A socket interface that does not exist on this host is what makes NCCL hang at start-up on real clusters.
    wrong = run(command, env={"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "ib-does-not-exist"})
    assert (
        wrong.returncode == 1
        and "FLAG: rank 0: NCCL_SOCKET_IFNAME=ib-does-not-exist matches no interface" in wrong.stdout
    )


def test_a_rank_that_cannot_reach_the_rendezvous_says_why():
    port = free_port()  # nothing listens there
    env = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    result = run([sys.executable, "-m", "hf_pretrain.cli", "doctor", "--distributed", "--timeout", "4"], env=env)
    assert result.returncode == 1 and f"rendezvous 127.0.0.1:{port} refused" in result.stdout
    assert "is rank 0 running" in result.stdout
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert probe_port("127.0.0.1", server.getsockname()[1]) == "open"
    assert probe_port("127.0.0.1", port) == "refused"


def facts(rank, **changes):
    base = dict(rank=rank, local_rank=rank, host=f"node{rank}", torch="2.13.0", cuda="12.8", nccl="2.27.3")
    base.update(transformers="5.24.0", accelerate="1.15.0", deepspeed="0.19.8", hf_pretrain="0.1.0")
    base.update(gpu="NVIDIA H100 80GB HBM3", driver="570.86", sm_clock_mhz="1980", environment={})
    return RankFacts(**{**base, **changes})


def test_mismatches_name_the_field_and_the_ranks():
    same = [facts(0), facts(1)]
    assert find_mismatches(same) == []
    mixed = [facts(0), facts(1, nccl="2.21.5", environment={"NCCL_IB_DISABLE": "1"}), facts(2)]
    found = find_mismatches(mixed)
    assert "nccl differs: 2.27.3 on ranks [0, 2]; 2.21.5 on ranks [1]" in found
    assert "NCCL_IB_DISABLE differs: (unset) on ranks [0, 2]; 1 on ranks [1]" in found


def test_interface_check_knows_this_hosts_interfaces():
    assert interface_problems({"NCCL_SOCKET_IFNAME": "lo"}) == []
    assert interface_problems({"NCCL_SOCKET_IFNAME": "^docker"}) == []  # exclusions are not names
    assert "matches no interface" in interface_problems({"GLOO_SOCKET_IFNAME": "eth-nope"})[0]
