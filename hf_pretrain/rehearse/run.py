"""`rehearse`: the three runs of a rehearsal and its checklist.

1. straight: the launch for `steps` steps, checkpoints every `save_steps`, the final save. It answers
   rendezvous, data sharding, the consolidated save (exported and loaded in plain transformers), and
   is the reference of the resume;
2. killed: the same launch in another folder; the last rank SIGKILLs itself in step `kill_at`; the
   launch must tear down; its checkpoints must be complete;
3. resumed: the same launch again from the killed run's newest checkpoint
   (`--resume_from_checkpoint PATH`): the same samples and the same losses as the straight run;
4. restarted: the launch with one restart allowed and `--resume_from_checkpoint auto`; the last rank SIGKILLs
   itself in step `kill_at` of the first attempt: the launcher must restart it and the run resume by itself;
5. hung: the same, the last rank SIGSTOPs itself instead: the hang watchdog must notice (its timeouts shortened
   to `HANG_FLAGS`), the launcher restart, the run resume.
Each run's ranks write their records (probe.py) under OUT/runs/<run>/probe, the launch's output in
OUT/runs/<run>/launch.log, the script's output_dir is OUT/runs/<run>/run.

On the console (`say`): a line as each stage (the tiny model, DeepSpeed's op build, each run) starts and
ends, and, every `progress_s` while a run goes on, what it waits for (`launch.run_launch`), as while DeepSpeed's
op builds (`launch.build_deepspeed_ops`: minutes the first time); the checklist follows at the end.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import checks
from .launch import (
    PROBE,
    PROGRESS_S,
    RunResult,
    Topology,
    UserLaunch,
    build_deepspeed_ops,
    launch_commands,
    read_records,
    rehearsal_config,
    restart_environment,
    run_launch,
    write_config,
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
    recovery: bool = True  # the restarted and hung runs
    progress_s: float = PROGRESS_S  # seconds between two lines of a run's progress

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


# The hung run's watchdog: a stopped rank noticed within seconds, not the default minutes (steps here take well
# under a second; the floor covers start-up and saves).
HANG_FLAGS = ["--hang_timeout_min_s", "20", "--hang_timeout_floor_s", "120"]


def say(line: str) -> None:
    print(f"[rehearse] {line}", flush=True)


RUNS = {  # what each run does, said as it starts
    "straight": "the launch as given: rendezvous, data sharding, checkpoints, the final save",
    "killed": "the same, the last rank SIGKILLed in step {kill_at}: the launch must tear down",
    "resumed": "the killed run resumed from {checkpoint}: the straight run's samples and losses",
    "restarted": "one restart allowed, the last rank SIGKILLed in step {kill_at}: it must restart and resume",
    "hung": "one restart allowed, the last rank SIGSTOPped in step {kill_at}: the watchdog must notice",
}


def _run(request: RehearsalRequest, topology: Topology, name: str, run_dir: Path, kill_at, extra=(), restarts=False):
    """One launch; with `restarts` it may run twice (a restart after the fault), so it gets twice the time."""
    folder = request.out / "runs" / name
    checkpoint = next((v for f, v in zip(extra, extra[1:]) if f == "--resume_from_checkpoint"), "")
    what = RUNS[name].format(kill_at=request.kill_at, checkpoint=Path(checkpoint).name)
    say(f"{name}: started: {what} ({topology.processes} processes; log {folder / 'launch.log'})")
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
    commands = launch_commands(topology, request.out / "accelerate_config.yaml", target, restarts)
    env = restart_environment(topology) if restarts else None
    timeout = request.timeout_s * (2 if restarts else 1)
    log, probe = folder / "launch.log", folder / "probe"
    result = run_launch(name, commands, probe, log, topology.processes, timeout, env=env, progress_s=request.progress_s)
    stopped = f"; stopped: {result.hung}" if result.hung else ""
    say(f"{name}: ended in {result.seconds:.0f} s, exit codes {result.returncodes}{stopped}")
    return result


def _recovery_runs(request: RehearsalRequest, topology: Topology) -> list[RunResult]:
    """The restarted and hung runs; each RunResult's records are its last attempt's, `fault` the planted one."""
    runs = []
    for name, kind, extra in (("restarted", "kill", []), ("hung", "stop", HANG_FLAGS)):
        run_dir = request.out / "runs" / name / "run"
        flags = ["--resume_from_checkpoint", "auto", *extra]
        run = _run(request, topology, name, run_dir, f"restart-{kind}:{request.kill_at}", flags, restarts=True)
        probe = request.out / "runs" / name / "probe"
        attempts = sorted(probe.glob("attempt*"), key=lambda p: int(p.name.removeprefix("attempt")))
        run.records = read_records(attempts[-1]) if attempts else []
        run.attempts = len(attempts)
        fault = probe / "fault.json"
        run.fault = json.loads(fault.read_text()) if fault.exists() else None
        runs.append(run)
    return runs


def rehearse(request: RehearsalRequest) -> Rehearsal:
    start = time.time()
    out = request.out
    for owned in ("runs", "model", "export"):
        shutil.rmtree(out / owned, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    topology = rehearsal_config(request.launch.config_file)
    write_config(topology, out)
    model = "as given (--keep-model)"
    if not request.keep_model:
        say(f"model: writing the launch's model at rehearsal size to {out / 'model'}")
        _, model = write_tiny_model(
            request.launch.script_args, request.seq_len, out / "model", topology.sp, topology.tp
        )
        say(f"model: {model}")
    _, notes = script_arguments(request.launch.script_args, out, 1, 1, None, None, out, request.dataset_path)
    rehearsal = Rehearsal(request, topology, model, topology.notes + notes + request.launch.ignored)
    if topology.deepspeed_file is not None:
        say("DeepSpeed: building its CPU comm op (once per Python environment; minutes the first time)")
        build_deepspeed_ops(out / "deepspeed_build.log", progress_s=request.progress_s)  # not in the runs' limit
        say("DeepSpeed: its CPU comm op is built")

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
    recovery = _recovery_runs(request, topology) if request.recovery else []
    rehearsal.runs += recovery
    say("checks: reading the runs' records")
    rehearsal.checks = [
        checks.rendezvous(straight, topology),
        checks.data_sharding(straight, topology),
        *after_kill,  # read before the resumed run adds its checkpoints to the folder
        checks.resume(straight, resumed, resumed_from),
        checks.consolidated_save(straight, topology, out),
    ]
    if recovery:
        restarted, hung = recovery
        rehearsal.checks += [
            checks.unattended_recovery(straight, restarted, request.kill_at),
            checks.hang_recovery(straight, hung, request.kill_at),
        ]
    rehearsal.seconds = time.time() - start
    return rehearsal
