"""`rehearse`: the three runs of a rehearsal and its checklist.

1. straight: the launch for `steps` steps, checkpoints every `save_steps`, the final save. It answers
   rendezvous, data sharding, the consolidated save (exported and loaded in plain transformers), and
   is the reference of the resume;
2. killed: the same launch in another folder; the last rank SIGKILLs itself in step `kill_at`; the
   launch must tear down; its checkpoints must be complete;
3. resumed: the same launch again from the killed run's newest checkpoint
   (`--resume_from_checkpoint PATH`): the same samples and the same losses as the straight run.
Each run's ranks write their records (probe.py) under OUT/runs/<run>/probe, the launch's output in
OUT/runs/<run>/launch.log, the script's output_dir is OUT/runs/<run>/run.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from . import checks
from .launch import (
    PROBE,
    RunResult,
    Topology,
    UserLaunch,
    build_deepspeed_ops,
    launch_commands,
    rehearsal_config,
    run_launch,
)
from .shrink import script_arguments, write_tiny_model


@dataclass
class RehearsalRequest:
    launch: UserLaunch
    out: Path = Path("rehearsal")
    steps: int = 12
    save_steps: int = 4
    kill_at: int = 10
    seq_len: int = 64
    keep_model: bool = False
    dataset_path: str | None = None
    timeout_s: float = 300.0

    def __post_init__(self):
        if self.save_steps < 1 or self.steps < 2 * self.save_steps:
            raise ValueError(
                f"--steps {self.steps} --save-steps {self.save_steps}: need steps >= 2 x save_steps (a checkpoint to resume)"
            )
        if not self.save_steps < self.kill_at <= self.steps:
            raise ValueError(f"--kill-at {self.kill_at}: use a step after the first checkpoint, up to --steps.")


@dataclass
class Rehearsal:
    request: RehearsalRequest
    topology: Topology
    model: str
    notes: list[str]
    checks: list[checks.Check] = field(default_factory=list)
    runs: list[RunResult] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return all(check.status == "passed" for check in self.checks)


def _run(request: RehearsalRequest, topology: Topology, name: str, run_dir: Path, kill_at: int, extra=()):
    folder = request.out / "runs" / name
    args, _ = script_arguments(
        request.launch.script_args,
        run_dir,
        request.steps,
        request.save_steps,
        request.seq_len,
        None if request.keep_model else request.out / "model",
        request.out / "data",
        request.dataset_path,
    )
    target = [str(PROBE), str(folder / "probe"), str(kill_at), str(request.launch.script), *args, *extra]
    commands = launch_commands(topology, request.out / "accelerate_config.yaml", target)
    return run_launch(name, commands, folder / "probe", folder / "launch.log", topology.processes, request.timeout_s)


def rehearse(request: RehearsalRequest) -> Rehearsal:
    start = time.time()
    out = request.out
    for owned in ("runs", "model", "export"):
        shutil.rmtree(out / owned, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    topology = rehearsal_config(request.launch.config_file)
    (out / "accelerate_config.yaml").write_text(yaml.safe_dump(topology.config, sort_keys=False))
    model = "as given (--keep-model)"
    if not request.keep_model:
        _, model = write_tiny_model(request.launch.script_args, request.seq_len, out / "model")
    _, notes = script_arguments(request.launch.script_args, out, 1, 1, None, None, out, request.dataset_path)
    rehearsal = Rehearsal(request, topology, model, topology.notes + notes + request.launch.ignored)
    if topology.deepspeed_file is not None:
        build_deepspeed_ops()  # once per Python environment; not counted against the runs' time limit

    straight = _run(request, topology, "straight", out / "runs" / "straight" / "run", 0)
    killed_dir = out / "runs" / "killed" / "run"
    killed = _run(request, topology, "killed", killed_dir, request.kill_at)
    rehearsal.runs += [straight, killed]
    after_kill = [checks.checkpoint(killed, topology, request.save_steps), checks.kill_and_teardown(killed)]
    from ..training.resume.check import checkpoints_newest_first

    newest = checkpoints_newest_first(killed_dir)
    resumed, resumed_from = None, None
    if newest:
        resumed_from = int(newest[0].name.split("-")[1])
        resumed = _run(request, topology, "resumed", killed_dir, 0, ["--resume_from_checkpoint", str(newest[0])])
        rehearsal.runs.append(resumed)
    rehearsal.checks = [
        checks.rendezvous(straight, topology),
        checks.data_sharding(straight, topology),
        *after_kill,  # read before the resumed run adds its checkpoints to the folder
        checks.resume(straight, resumed, resumed_from),
        checks.consolidated_save(straight, topology, out),
    ]
    rehearsal.seconds = time.time() - start
    return rehearsal
