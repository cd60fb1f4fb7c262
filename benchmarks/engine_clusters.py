"""Real clusters on this machine: a Ray head (`ray start --head`) and a one-node Slurm (Debian's slurmctld +
slurmd, munge authentication), each started from its own temporary folder and stopped by the ids of the processes
it started. Both are context managers. The executor tests (`tests/data/test_chain.py`) hold them once per session
and `benchmarks/data_scale.py` starts the Slurm one when no cluster answers `sinfo`; they live here rather than in
tests/ because benchmarks do not import the tests (as `benchmarks/gpu/faults.py`).

Slurm: `make test` installs its packages as root (`.ci/install_engines`); `ProctrackType=proctrack/linuxproc` and
`TaskPlugin=task/none` need no cgroups, so it runs in a container.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SLURM_BINARIES = ("slurmctld", "slurmd", "munged", "sbatch", "squeue", "srun")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(check, seconds: float, what: str, log: Path | None = None) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
    raise RuntimeError(f"{what} did not come up within {seconds:.0f} s.\n{tail}")


@contextlib.contextmanager
def ray_head(cpus: int = 2):
    """A Ray head node on 127.0.0.1; yields its address (host:port)."""
    root = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # short: Ray's socket paths have a length limit
    port = free_port()
    log = root / "head.log"
    command = [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", f"--num-cpus={cpus}"]
    command += [f"--port={port}", "--node-ip-address=127.0.0.1", "--include-dashboard=false", "--disable-usage-stats"]
    command += [f"--temp-dir={root}"]
    # Token authentication off, for the head and (through os.environ) every client of this session: the cluster
    # listens on 127.0.0.1 only, and a token left in ~/.ray by another local Ray would otherwise switch it on.
    saved = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    with open(log, "w") as out:
        head = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        wait_until(lambda: "Ray runtime started" in log.read_text() or head.poll() is not None, 120, "ray head", log)
        if head.poll() is not None:
            raise RuntimeError(f"ray start exited with {head.returncode}:\n{log.read_text()[-3000:]}")
        yield f"127.0.0.1:{port}"
    finally:
        stop_group(head.pid, grace=2.0)
        shutil.rmtree(root, ignore_errors=True)
        if saved is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = saved


def stop_group(pgid: int, grace: float = 5.0) -> None:
    """SIGTERM to the process group we started, SIGKILL to what is left after `grace` seconds."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            os.killpg(pgid, 0)
            time.sleep(0.2)
        os.killpg(pgid, signal.SIGKILL)


def slurm_missing() -> list[str]:
    return [name for name in SLURM_BINARIES if shutil.which(name) is None]


SLURM_CONF = """\
ClusterName=hftest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge.socket
SlurmUser={user}
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MinJobAge=600
SchedulerParameters=sched_interval=1
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


@contextlib.contextmanager
def slurm_cluster():
    """munged, slurmctld and slurmd on this machine (as root); yields the environment (SLURM_CONF) for its clients."""
    import getpass

    import psutil

    root = Path(tempfile.mkdtemp(prefix="slurm", dir="/tmp"))
    root.chmod(0o755)
    (root / "state").mkdir()
    (root / "spool").mkdir()
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    host = socket.gethostname().split(".")[0]
    conf = root / "slurm.conf"
    conf.write_text(
        SLURM_CONF.format(
            host=host,
            root=root,
            user=getpass.getuser(),
            ctld_port=free_port(),
            d_port=free_port(),
            cpus=os.cpu_count(),
            memory=psutil.virtual_memory().total // 2**20 - 512,
        )
    )
    env = {**os.environ, "SLURM_CONF": str(conf)}
    pids = []
    try:
        munged = ["munged", "-f", f"--socket={root}/munge.socket", f"--key-file={key}"]
        munged += [f"--log-file={root}/munged.log", f"--pid-file={root}/munged.pid", f"--seed-file={root}/munge.seed"]
        subprocess.run(munged, check=True, env=env, capture_output=True)
        pids.append(root / "munged.pid")
        subprocess.run(["slurmctld", "-i"], check=True, env=env, capture_output=True)
        pids.append(root / "slurmctld.pid")
        subprocess.run(["slurmd"], check=True, env=env, capture_output=True)
        pids.append(root / "slurmd.pid")

        def idle() -> bool:
            state = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True).stdout
            return state.strip() == "idle"

        wait_until(idle, 60, "the Slurm node", root / "slurmd.log")
        yield env
    finally:
        for pid_file in reversed(pids):
            with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError):
                os.kill(int(pid_file.read_text().strip()), signal.SIGTERM)
        time.sleep(0.5)
        shutil.rmtree(root, ignore_errors=True)
