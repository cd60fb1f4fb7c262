"""The stages on datatrove's executors: local processes, a Ray cluster, or Slurm job arrays.

Every runner hands each stage to datatrove's executor of its kind with `tasks` tasks and a logging folder per
stage (`OUTPUT/logs/NN-stage/`: `completions/` (datatrove's marks: a relaunch runs only the tasks without one),
`logs/task_NNNNN.log`, `stats/`), and checks after the stage that every task completed; a task that did not is one
error naming it and its log. Then `after(stage)`, the caller's check of the stage's output (the engine's: that the
input yielded a document), may end the run with its one line. Local and Ray run the stages one after the other;
Slurm submits them all at once, each an array job depending on the one before (`afterok`), then waits for them (or
returns with `wait: false`), checking each stage as it completes and cancelling the rest when a check fails.

Before any data work the cluster is asked whether it would take the tasks: Slurm with `sbatch --test-only`
(`check_slurm`), Ray by a connection to the address the run would join (`check_ray`: `ray.init` retries a wrong
address for ever, a warning every 30 s): something must answer there, speak gRPC, and be Ray's GCS (it gives the
cluster's id to one request, sent by a process of its own, `gcs_answer`: on another gRPC server, a raylet's port,
`ray.init` retries for 20 s, a warning a second, then raises).
"""

from __future__ import annotations

import getpass
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ..executor_config import ExecutorConfig
from .stages import Stage


class StageFailed(ValueError):
    """Tasks of a stage did not complete: one line naming them and their logs (`hf-pretrain data` exits with 2)."""


def incomplete_message(stage: Stage, executor, logs: Path, ranks: list[int]) -> str:
    shown = ", ".join(str(logs / stage.folder / "logs" / f"task_{rank:05d}.log") for rank in ranks[:3])
    return (
        f"stage {stage.folder}: {len(ranks)} of {executor.world_size} task(s) did not complete ({ranks[:10]}); "
        f"see {shown}. Relaunch the same command: it runs only the tasks not complete."
    )


class Runner:
    def __init__(self, config: ExecutorConfig, logs: Path):
        self.config, self.logs = config, logs

    def workers(self, tasks: int) -> int:
        return tasks if self.config.workers == -1 else min(self.config.workers, tasks)

    def run(
        self, stages: list[tuple[Stage, int]], after: Callable[[Stage], None] = lambda stage: None
    ) -> list[dict] | None:
        """Run the stages in order, `after(stage)` once each is complete; per stage: tasks, and how many were
        complete from an earlier launch."""
        report = []
        with self.session():
            for stage, tasks in stages:
                executor = self.executor(stage, tasks)
                before = len(executor.get_incomplete_ranks())
                executor.run()
                missing = executor.get_incomplete_ranks(skip_completed=True)
                if missing:
                    raise StageFailed(incomplete_message(stage, executor, self.logs, missing))
                after(stage)
                report.append({"stage": stage.folder, "tasks": tasks, "ran": before, "reused": tasks - before})
        return report

    def session(self):
        import contextlib

        return contextlib.nullcontext()

    def executor(self, stage: Stage, tasks: int):
        raise NotImplementedError


class LocalRunner(Runner):
    def executor(self, stage, tasks):
        from datatrove.executor import LocalPipelineExecutor

        return LocalPipelineExecutor(
            pipeline=[stage],
            tasks=tasks,
            workers=self.workers(tasks),
            logging_dir=str(self.logs / stage.folder),
            start_method=self.config.start_method,
        )


class RayRunner(Runner):
    def session(self):
        import contextlib

        import ray

        @contextlib.contextmanager
        def connected():
            started = not ray.is_initialized()
            if started:  # address None: a Ray started for this run on this machine; else the cluster's
                ray.init(address=self.config.address, logging_level="ERROR", log_to_driver=False)
            try:
                yield
            finally:
                if started:
                    ray.shutdown()

        return connected()

    def executor(self, stage, tasks):
        from datatrove.executor import RayPipelineExecutor

        return RayPipelineExecutor(
            pipeline=[stage],
            tasks=tasks,
            workers=self.workers(tasks),
            logging_dir=str(self.logs / stage.folder),
            cpus_per_task=self.config.cpus_per_task,
            mem_per_cpu_gb=self.config.mem_per_cpu_gb,
        )


HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])  # and an empty SETTINGS


def grpc_answer(host: str, port: int, timeout: float = 5.0) -> str | None:
    """None when a gRPC server (Ray's GCS, its client server) answers at host:port: it replies to the HTTP/2 preface
    with a SETTINGS frame (type 4); else why not, in words."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            sock.sendall(HTTP2_PREFACE)
            header = sock.recv(9)
    except OSError as err:
        return f"nothing answers at {host}:{port} ({err.strerror or err})"
    if len(header) < 4 or header[3] != 4:
        return f"{host}:{port} answers, but is no Ray cluster (no gRPC server there: the dashboard's port?)"
    return None


GCS_PROBE = """
import sys
try:
    from ray._raylet import GcsClient
except ImportError:
    sys.exit(3)  # another Ray version: ray.init's own check
try:
    GcsClient(address=sys.argv[1])  # asks the GCS for the cluster's id, once
except Exception as err:
    said = str(err).split("\\n")[0].strip().rstrip(":")
    print(said if not said.endswith("RPC error") else f"{said}: gRPC status {getattr(err, 'rpc_code', '?')}")
    sys.exit(1)
"""


def gcs_answer(address: str, timeout: float = 20.0) -> str | None:
    """None when Ray's GCS answers at host:port (it gives the cluster's id); else why not, in words. Asked once, in a
    process of its own: Ray's client logs every try on stderr, and `ray.init` tries for 20 s before its traceback."""
    try:
        probe = subprocess.run(
            [sys.executable, "-c", GCS_PROBE, address], capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return f"{address} did not answer Ray's GCS request within {timeout:.0f} s"
    if probe.returncode in (0, 3):
        return None
    said = probe.stdout.strip() or (probe.stderr.strip().splitlines() or ["no reason"])[-1]
    return (
        f"a gRPC server answers at {address}, but not Ray's GCS ({said}): another port of a Ray node? (the Ray "
        "client's, 10001, is written ray://host:10001)"
    )


def check_ray(c: ExecutorConfig) -> None:
    """Before any data work: the Ray cluster the run would join answers, or one line naming the address and the fix.

    The address is `ray.init`'s: `RAY_ADDRESS` when set, else the executor's; None or "local" start a Ray for the
    run (nothing to check), "auto" is the cluster `ray start` last started here, "ray://host:port" a Ray client's."""
    import ray

    if ray.is_initialized():  # this process joined a Ray already: its tasks run there
        return
    field = "RAY_ADDRESS" if os.environ.get("RAY_ADDRESS") else "executor address"
    address = os.environ.get("RAY_ADDRESS") or c.address
    if address in (None, "local"):
        return
    fix = (
        "start Ray there (`ray start --head` prints the address), pass the head's host:port (6379 unless "
        "--port says otherwise), or null to start a local Ray for the run."
    )
    if address == "auto":
        try:
            from ray._private.services import canonicalize_bootstrap_address
        except ImportError:  # another Ray version: ray.init's own error
            return
        try:
            address = canonicalize_bootstrap_address("auto")
        except ConnectionError:
            raise ValueError(
                f"{field}='auto': no Ray cluster runs on this machine (`ray start --head` starts one); pass the "
                "head's host:port, or null to start a local Ray for the run."
            ) from None
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{field}={address!r} is no host:port (e.g. 10.0.0.1:6379); {fix}")
    why = grpc_answer(host.strip("[]"), int(port))
    if why is None and not address.startswith("ray://"):  # the Ray client's server is no GCS
        why = gcs_answer(f"{host}:{port}")
    if why:
        raise ValueError(f"{field}={address!r}: {why}; {fix}")


def check_slurm(c: ExecutorConfig) -> None:
    """Before any data work: the Slurm commands are here and the cluster would accept a task as configured.

    `sbatch --test-only` validates the options a task is submitted with (partition, time, qos, memory, the extra
    `sbatch_args`) against the cluster without queueing anything; its refusal is one line naming the section.
    """
    missing = [name for name in ("sbatch", "squeue", "sinfo", "scancel") if shutil.which(name) is None]
    if missing:
        raise ValueError(
            f"executor kind='slurm': {', '.join(missing)} not on PATH: run from a Slurm login node (where sbatch "
            "works), or use --executor local|ray."
        )
    options = {
        "partition": c.partition or default_partition(),
        "time": c.time,
        "cpus-per-task": c.cpus_per_task,
        "mem-per-cpu": f"{c.mem_per_cpu_gb}G",
        **({"qos": c.qos} if c.qos else {}),
        **c.sbatch_args,
    }
    command = ["sbatch", "--test-only", *(f"--{k}={v}" for k, v in options.items()), "--wrap", "true"]
    tried = subprocess.run(command, capture_output=True, text=True, check=False)
    if tried.returncode != 0:
        said = (tried.stderr.strip() or tried.stdout.strip()).splitlines()
        raise ValueError(
            f"executor kind='slurm': the cluster refuses a task as configured ({said[-1] if said else 'no reason'}; "
            f"{' '.join(command[2:-2])}): fix partition, time, qos, cpus_per_task, mem_per_cpu_gb or sbatch_args "
            "in the executor section."
        )


def default_partition() -> str:
    """The Slurm cluster's default partition (`sinfo` marks it with *)."""
    listed = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, check=False).stdout.split()
    default = [p.rstrip("*") for p in listed if p.endswith("*")]
    if not default:
        raise ValueError(f"executor kind='slurm': no default partition found (sinfo: {listed}); set partition.")
    return default[0]


def activate_command() -> str:
    """The line that puts this Python environment on the task's PATH (a venv's activate script), or ""."""
    activate = Path(sys.prefix) / "bin" / "activate"
    return f"source {activate}" if sys.prefix != sys.base_prefix and activate.exists() else ""


class SlurmRunner(Runner):
    """All stages submitted at once (each an array job, `afterok` on the one before), then waited for."""

    poll_seconds = 1.0

    def executor(self, stage, tasks, depends=None):
        from datatrove.executor import SlurmPipelineExecutor

        c = self.config
        return SlurmPipelineExecutor(
            pipeline=[stage],
            tasks=tasks,
            workers=c.workers,
            time=c.time,
            partition=c.partition or default_partition(),
            cpus_per_task=c.cpus_per_task,
            mem_per_cpu_gb=c.mem_per_cpu_gb,
            job_name=f"{c.job_name}-{stage.folder}",
            qos=c.qos or "",
            env_command=c.env_command if c.env_command is not None else activate_command(),
            sbatch_args=dict(c.sbatch_args),
            logging_dir=str(self.logs / stage.folder),
            slurm_logs_folder=str(self.logs / stage.folder / "slurm"),
            depends=depends,
            requeue=False,
        )

    def run(self, stages, after=lambda stage: None):
        executors, report, previous = [], [], None
        for stage, tasks in stages:
            previous = self.executor(stage, tasks, depends=previous)
            executors.append((stage, previous))
            before = len(previous.get_incomplete_ranks())
            report.append({"stage": stage.folder, "tasks": tasks, "ran": before, "reused": tasks - before})
        previous.run()  # launches the chain, each stage's job after the job of the stage before
        jobs = [str(e.job_id) for _, e in executors if e.job_id not in (None, -1)]
        if jobs:
            print(f"[slurm] submitted job(s) {', '.join(jobs)}: one array per stage, logs in {self.logs}/STAGE/slurm")
        if not self.config.wait:
            print(
                "[slurm] not waiting (wait: false): run the same command again once the jobs ended to merge the counts"
            )
            return None
        self.wait(executors, jobs, after)
        return report

    def wait(self, executors, jobs: list[str], after) -> None:
        checked = 0  # stages complete and checked by `after`, in order
        while True:
            pending = [(stage, e, e.get_incomplete_ranks(skip_completed=True)) for stage, e in executors]
            while checked < len(executors) and not pending[checked][2]:
                try:
                    after(executors[checked][0])
                except ValueError:
                    self.cancel(jobs)
                    raise
                checked += 1
            pending = [item for item in pending if item[2]]
            if not pending:
                return
            queued = self.queued(jobs)
            stuck = [job for job, (reason, _) in queued.items() if "DependencyNeverSatisfied" in reason]
            if not queued or stuck:
                self.cancel(jobs)
                raise StageFailed(incomplete_message(*pending[0][:2], self.logs, pending[0][2]))
            time.sleep(self.poll_seconds)

    def cancel(self, jobs: list[str]) -> None:
        """`scancel` our jobs still queued and datatrove's stats-merging job after each (submitted `afterok` on ours,
        it would wait for ever once ours are gone)."""
        doomed = list(self.queued(jobs, following=True))
        if doomed:
            subprocess.run(["scancel", *doomed], check=False)

    @staticmethod
    def queued(jobs: list[str], following: bool = False) -> dict[str, tuple[str, str]]:
        """Our jobs still in the queue (array job id -> state and reason, dependencies); `following`: also the jobs
        that depend on one of ours."""
        listed = subprocess.run(
            ["squeue", "-h", "-u", getpass.getuser(), "-o", "%F|%T|%r|%E"], capture_output=True, text=True, check=False
        ).stdout
        found: dict[str, tuple[str, str]] = {}
        for line in listed.splitlines():
            job, state, reason, depends = (line.split("|") + ["", "", ""])[:4]
            if job in jobs or following and set(re.findall(r"\d+", depends)) & set(jobs):
                found[job] = (f"{found.get(job, ('', ''))[0]} {state} {reason}".strip(), depends)
        return found


RUNNERS = {"local": LocalRunner, "ray": RayRunner, "slurm": SlurmRunner}


def runner_for(config: ExecutorConfig, logs: Path) -> Runner:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    return RUNNERS[config.kind](config, logs)
