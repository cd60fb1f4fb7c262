"""`ExecutorConfig`: where the chain's tasks run (the `executor` section of `hf-pretrain data prepare`'s config).

`kind` picks datatrove's executor: `local` (`LocalPipelineExecutor`: a pool of processes on this machine),
`slurm` (`SlurmPipelineExecutor`: one job array per stage, chained by `afterok` dependencies) or `ray`
(`RayPipelineExecutor`: on a Ray cluster, `address` "auto" or host:port, or a local one started for the run).
`tasks` is the number of shards (each task reads a contiguous part of the input files, or rows), `workers`
how many run at once. Checked before any data is read; Ray (and Slurm's commands) are optional installs, named in the error.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

KINDS = ("local", "slurm", "ray")
EXTRAS = {"slurm": "slurm", "ray": "ray"}  # pip install hf_pretrain[...]; datatrove itself is a dependency
MODULES = {"local": ("datatrove",), "slurm": ("datatrove",), "ray": ("datatrove", "ray")}


@dataclass
class ExecutorConfig:
    kind: str = "local"
    tasks: int | None = None  # shards; default: this machine's cores (local), else required
    workers: int = -1  # tasks running at once; -1: all
    tokenizer_sample_documents: int = 1_000_000  # the tokenizer is trained once, on this many training documents
    start_method: str = "fork"  # local: how the pool starts its processes (fork: as datasets' num_proc)
    address: str | None = None  # ray: "auto", "host:port", or None to start a local Ray for the run
    cpus_per_task: int = 1  # ray, slurm
    mem_per_cpu_gb: float = 2  # ray, slurm
    partition: str | None = None  # slurm: default, the cluster's default partition
    time: str = "24:00:00"  # slurm: time limit of a task
    qos: str | None = None  # slurm
    job_name: str = "hf-pretrain-data"  # slurm: jobs are named JOB_NAME-STAGE
    env_command: str | None = None  # slurm: shell line run before each task; default: activate this Python's venv
    sbatch_args: dict = field(default_factory=dict)  # slurm: more #SBATCH options, e.g. {"account": "proj"}
    wait: bool = True  # slurm: wait for the jobs and merge the counts; False: submit and return

    def __post_init__(self):
        """The refusals name the field alone: they are read after `section 'executor': ` (`PipelineConfig`)."""
        if self.kind not in KINDS:
            raise ValueError(f"kind={self.kind!r} is invalid; use one of {list(KINDS)}.")
        if self.tasks is None:
            if self.kind != "local":
                raise ValueError(f"kind={self.kind!r} needs tasks (the number of shards), e.g. 64.")
            self.tasks = os.cpu_count() or 1
        for name, what, example in (
            ("tasks", "shards", 8),
            ("cpus_per_task", "CPUs", 1),
            ("tokenizer_sample_documents", "documents", 1_000_000),
        ):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r}: use a number of {what} >= 1 (e.g. {example}).")
        if self.workers != -1 and (not isinstance(self.workers, int) or self.workers < 1):
            raise ValueError(f"workers={self.workers!r}: use a number of tasks at once >= 1, or -1 for all.")
        if self.mem_per_cpu_gb <= 0:
            raise ValueError(f"mem_per_cpu_gb={self.mem_per_cpu_gb}: use a positive number of GB.")
        if self.start_method not in ("forkserver", "spawn", "fork"):
            raise ValueError(f"start_method={self.start_method!r}: use forkserver, spawn or fork.")

    def check_installed(self) -> None:
        """The engine's libraries are importable, or one line naming the extra to install."""
        import importlib.util

        missing = [name for name in MODULES[self.kind] if importlib.util.find_spec(name) is None]
        if missing:
            extra = EXTRAS.get(self.kind)
            fix = f"pip install 'hf_pretrain[{extra}]'" if extra else "pip install hf_pretrain again (a dependency)"
            raise ValueError(f"kind={self.kind!r} needs {', '.join(missing)}: {fix}.")
