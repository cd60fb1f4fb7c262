"""The user's launch, turned into the rehearsal's: the same accelerate config on two CPU processes, and the runs.

`parse_launch` reads the real command (`accelerate launch --config_file C SCRIPT ARGS`, or the
`launch.sh` that `hf-pretrain plan` writes) with accelerate's own parser. `rehearsal_config` keeps
what the config decides (distributed type, the DeepSpeed JSON, the FSDP settings, the number of
machines) and changes only what a CPU needs:
- 2 processes; over several machines, 2 "nodes" of one process each on 127.0.0.1, each started by
  its own `accelerate launch --machine_rank r` as on real nodes (static rendezvous, a free port);
- `use_cpu: false` with `MULTI_GPU` (accelerate's MULTI_CPU goes through mpirun; PretrainingArguments
  puts GPU-less ranks on gloo), no `gpu_ids`, fp32 (`mixed_precision: 'no'`; under DeepSpeed the key
  is dropped, the JSON's "auto" follows the arguments); DeepSpeed over machines uses the `standard`
  launcher (torchrun per node) instead of pdsh; sequence parallelism (`parallelism_config_sp_size`) and
  DeepSpeed AutoTP (`tensor_parallel.autotp_size` of the JSON) kept, at most the 2 processes (a degree of 4 or 8
  rehearsed as 2, said in a note; a shrunk AutoTP is a copy of the JSON in the rehearsal's folder,
  `write_config`): the all-to-all, the sharded layers, the loader that gives a group the same rows and the loss
  over the group run as in the real launch. The ranks of one TP or SP group are consecutive (accelerate's data
  rank is process index // tp; DeepSpeed's SP groups are ranks [i x sp, (i + 1) x sp)), which the data-sharding
  check relies on (`Topology.group_size`).

`run_launch` starts a run, its output in one log, every process in its own session, and bounds it:
a run whose ranks all finished training but that does not exit is a hang (reported, then killed);
after the planted SIGKILL the launch must tear down within `teardown_s`. While it waits it prints
what it waits for every `progress_s` (the ranks' step, read from their records; the launch's last
log line before any rank trains). Whatever ends it (its end, a hang, an error, SIGTERM / SIGINT /
SIGHUP turned into `Interrupted` by `interrupted_by_signals`), it leaves no process behind: every
process seen under a launcher is killed with its process group (torchrun starts each worker in a
session of its own, so the launcher's group alone would leave the ranks running under PID 1).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

PROBE = Path(__file__).with_name("probe.py")
POLL_S = 0.5
PROGRESS_S = 10.0  # seconds between two lines saying what a run waits for
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # what ends a rehearsal early, and its launches with it
ERROR = re.compile(r"^([\w.]*(Error|Exception)\b|error:)")
RANK_PREFIX = re.compile(r"^\[(default)?rank\d+\]:\s*")  # torch.distributed's prefix on a rank's traceback lines


@dataclass
class UserLaunch:
    config_file: Path
    script: Path
    script_args: list[str]
    ignored: list[str] = field(default_factory=list)  # accelerate flags the rehearsal does not apply

    @property
    def command(self) -> str:
        return shlex.join(
            ["accelerate", "launch", "--config_file", str(self.config_file), str(self.script)] + self.script_args
        )


def read_launch_file(path: str | os.PathLike) -> list[str]:
    """The `accelerate launch ...` line of a shell script (e.g. plan/launch.sh), split as the shell would."""
    if not Path(path).is_file():
        what = "is a folder" if Path(path).is_dir() else "does not exist"
        raise ValueError(
            f"--launch-file {path} {what}; pass the launch.sh that `hf-pretrain plan` wrote (or its path)."
        )
    for line in Path(path).read_text().splitlines():
        words = shlex.split(line, comments=True)
        if words[:2] == ["accelerate", "launch"]:
            return words
    raise ValueError(f"--launch-file {path}: no line starts with `accelerate launch`; pass the command instead.")


def parse_launch(words: list[str]) -> UserLaunch:
    """`[accelerate launch] --config_file C SCRIPT ARGS` -> UserLaunch (the script defaults to examples/pretrain.py)."""
    from accelerate.commands.launch import launch_command_parser

    if words[:2] == ["accelerate", "launch"]:
        words = words[2:]
    kept, ignored, skip = [], [], False
    for i, word in enumerate(words):  # the machine rank is the rehearsal's to set (plan writes "${MACHINE_RANK:-0}")
        if skip:
            skip = False
        elif word == "--machine_rank" and i + 1 < len(words):
            skip = True
        else:
            kept.append(word)
    if not any(w.endswith(".py") for w in kept):
        kept.append("examples/pretrain.py")
    try:
        parsed = launch_command_parser().parse_args(kept)
    except SystemExit:  # argparse printed what it could not read
        raise ValueError(f"cannot read the launch {shlex.join(words)!r} as `accelerate launch` arguments") from None
    if not parsed.config_file:
        raise ValueError("the launch has no --config_file: rehearse needs the accelerate config of the real run.")
    config = Path(parsed.config_file)
    if not config.is_file():
        raise ValueError(f"--config_file {config}: no such file.")
    script = Path(parsed.training_script)
    if not script.is_file():
        raise ValueError(f"training script {script}: no such file (run rehearse from where you launch).")
    for flag in ("num_processes", "num_machines", "mixed_precision", "main_process_ip", "main_process_port"):
        if getattr(parsed, flag, None) not in (None, False):
            ignored.append(f"--{flag} {getattr(parsed, flag)} of the launch not applied (the rehearsal sets it)")
    return UserLaunch(config, script, list(parsed.training_script_args), ignored)


@dataclass
class Topology:
    config: dict  # the rehearsal's accelerate config
    nodes: int
    strategy: str  # e.g. "DDP", "DeepSpeed ZeRO-3 (ds_configs/zero3.json)", "FSDP2"
    deepspeed_file: Path | None = None
    notes: list[str] = field(default_factory=list)
    sp: int = 1  # the rehearsal's Ulysses SP degree
    tp: int = 1  # the rehearsal's AutoTP degree
    deepspeed_json: dict | None = None  # the DeepSpeed config with its AutoTP shrunk (`write_config` writes it)

    @property
    def processes(self) -> int:
        return self.config["num_processes"]

    @property
    def group_size(self) -> int:
        """Ranks that train the same rows: a TP group, or an SP group (each its part of the sequence)."""
        return self.tp * self.sp

    def describe(self) -> str:
        """e.g. "DeepSpeed ZeRO-1 (ds_configs/zero1_autotp.json), tensor parallelism 2: 1 data-parallel group"."""
        kinds = [f"{what} parallelism {n}" for what, n in (("tensor", self.tp), ("sequence", self.sp)) if n > 1]
        if not kinds:
            return self.strategy
        groups = self.processes // self.group_size
        plural = "s" if groups > 1 else ""
        return f"{self.strategy}, {' x '.join(kinds)}: {groups} data-parallel group{plural}"


def _strategy(config: dict, deepspeed_file: Path | None) -> str:
    kind = config.get("distributed_type", "NO")
    if kind == "DEEPSPEED":
        stage = json.loads(deepspeed_file.read_text()).get("zero_optimization", {}).get("stage", 0)
        return f"DeepSpeed ZeRO-{stage} ({deepspeed_file})"
    if kind == "FSDP":
        return f"FSDP{config.get('fsdp_config', {}).get('fsdp_version', 1)}"
    return "DDP"


def rehearsal_config(path: Path, processes: int = 2) -> Topology:
    """The user's accelerate config at `path`, made to run as `processes` CPU ranks here."""
    user = yaml.safe_load(path.read_text()) or {}
    config, notes = dict(user), []
    kind = config.get("distributed_type", "NO")
    if kind in ("NO", "MULTI_CPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU"):
        notes.append(f"distributed_type {kind} rehearsed as MULTI_GPU on gloo (the processes DDP would run)")
        config["distributed_type"] = kind = "MULTI_GPU"
    nodes = 2 if int(user.get("num_machines", 1)) > 1 else 1
    config.update(num_processes=processes, num_machines=nodes, machine_rank=0, use_cpu=False, rdzv_backend="static")
    if nodes > 1:
        config.update(main_process_ip="127.0.0.1", same_network=False)
        notes.append(f"{user.get('num_machines')} machines rehearsed as 2 nodes of 1 process on 127.0.0.1")
    for key in ("gpu_ids", "dynamo_config", "downcast_bf16", "main_training_function"):
        config.pop(key, None)
    if user.get("mixed_precision", "no") != "no":
        notes.append(f"mixed_precision {user['mixed_precision']} -> fp32 (CPU)")
    config["mixed_precision"] = "no"
    deepspeed_file = None
    if kind == "DEEPSPEED":
        deepspeed = dict(config.get("deepspeed_config") or {})
        name = deepspeed.get("deepspeed_config_file")
        if not name:
            raise ValueError(f"{path}: deepspeed_config has no deepspeed_config_file; rehearse runs the JSON you ship.")
        deepspeed_file = Path(name) if Path(name).is_file() else path.parent / name
        if not deepspeed_file.is_file():
            raise ValueError(f"{path}: deepspeed_config_file {name} not found (from here or beside the config).")
        deepspeed["deepspeed_config_file"] = str(deepspeed_file.resolve())
        if nodes > 1:
            deepspeed["deepspeed_multinode_launcher"] = "standard"
        config["deepspeed_config"] = deepspeed
        config.pop("mixed_precision")  # accelerate refuses it beside a JSON; the JSON's "auto" follows the arguments
    sp = _sequence_parallel(config, processes, notes)
    tp, shrunk = _tensor_parallel(deepspeed_file, processes, notes)
    return Topology(config, nodes, _strategy(config, deepspeed_file), deepspeed_file, notes, sp, tp, shrunk)


def _shrunk_degree(degree: int, processes: int) -> int:
    """The largest divisor of `processes` that divides `degree`, or all of them for a degree beyond them."""
    if degree >= processes:
        return processes
    return max(d for d in range(1, processes + 1) if not processes % d and not degree % d)


def _sequence_parallel(config: dict, processes: int, notes: list[str]) -> int:
    """The SP degree of the launch, shrunk to a divisor of the rehearsal's processes (written back to `config`)."""
    keys = config.get("parallelism_config") or {}
    sp = int(keys.get("parallelism_config_sp_size", 1))
    if sp > 1 and processes % sp:
        shrunk = _shrunk_degree(sp, processes)
        config["parallelism_config"] = {**keys, "parallelism_config_sp_size": shrunk}
        notes.append(f"sequence parallelism {sp} rehearsed as {shrunk} ({processes} processes)")
        sp = shrunk
    return sp


def _tensor_parallel(deepspeed_file: Path | None, processes: int, notes: list[str]) -> tuple[int, dict | None]:
    """The AutoTP degree of the launch's DeepSpeed JSON, shrunk to the rehearsal's processes; with the JSON to
    write when it was shrunk (None: the user's file runs as shipped)."""
    if deepspeed_file is None:
        return 1, None
    ds = json.loads(deepspeed_file.read_text())
    tp = int((ds.get("tensor_parallel") or {}).get("autotp_size", 1) or 1)
    if tp <= 1 or not processes % tp:
        return tp, None
    shrunk = _shrunk_degree(tp, processes)
    notes.append(f"tensor parallelism {tp} (AutoTP) rehearsed as {shrunk} ({processes} processes)")
    return shrunk, {**ds, "tensor_parallel": {**ds["tensor_parallel"], "autotp_size": shrunk}}


def write_config(topology: Topology, out: Path) -> Path:
    """The rehearsal's accelerate config in `out` (and its DeepSpeed JSON beside it when AutoTP was shrunk)."""
    if topology.deepspeed_json is not None:
        shrunk = out / "deepspeed_config.json"
        shrunk.write_text(json.dumps(topology.deepspeed_json, indent=2))
        topology.config["deepspeed_config"]["deepspeed_config_file"] = str(shrunk.resolve())
    path = out / "accelerate_config.yaml"
    path.write_text(yaml.safe_dump(topology.config, sort_keys=False))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment() -> dict[str, str]:
    """The launch's environment: the repository importable, one thread per rank, offline hubs; and DeepSpeed's
    JIT-built ops (its CPU shared-memory all-reduce, built at its first `init_distributed`) cached per Python
    environment. torch keeps one cache per user and rebuilds an op whenever another environment built it last
    (minutes on 2 cores each time); an explicit TORCH_EXTENSIONS_DIR is kept."""
    root = str(Path.cwd())
    path = os.environ.get("PYTHONPATH")
    prefix = hashlib.sha256(sys.prefix.encode()).hexdigest()[:10]
    extensions = os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path.home() / ".cache" / "torch_extensions" / prefix)
    return {
        "TORCH_EXTENSIONS_DIR": extensions,
        **os.environ,
        "PYTHONPATH": root + (os.pathsep + path if path else ""),
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }


BUILD_DEEPSPEED_OPS = """
from deepspeed.accelerator import get_accelerator
builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
if builder is not None:
    builder.load()
"""


def build_deepspeed_ops(log: Path | None = None, timeout_s: float = 1200.0, progress_s: float = PROGRESS_S) -> None:
    """Build DeepSpeed's CPU shared-memory comm op before the runs (each rank builds it at `init_distributed`
    otherwise, inside the run's time limit: minutes on 2 busy cores the first time, cached after). The build's
    output goes to `log` (None: a temporary file); every `progress_s` a line says how long it has been building
    and the build's last line. A lock left by a build that was killed would make every later build wait forever:
    one older than `timeout_s` is removed."""
    if log is None:
        with tempfile.TemporaryDirectory() as folder:
            return build_deepspeed_ops(Path(folder) / "deepspeed_build.log", timeout_s, progress_s)
    env = environment()
    for lock in Path(env["TORCH_EXTENSIONS_DIR"]).glob("*/lock"):
        if time.time() - lock.stat().st_mtime > timeout_s:
            lock.unlink(missing_ok=True)
    start = last = time.time()
    with log.open("w") as out, signals_held():  # a build started is a build stopped by the `finally` below
        process = subprocess.Popen(
            [sys.executable, "-c", BUILD_DEEPSPEED_OPS],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        while process.poll() is None and time.time() - start <= timeout_s:
            time.sleep(min(POLL_S, max(progress_s, 0.05)))
            if process.poll() is None and time.time() - last >= progress_s:
                last = time.time()
                print(
                    f"[rehearse] DeepSpeed: building its CPU comm op, {last - start:.0f} s so far "
                    f"(the build's last line: {_last_line(log)})",
                    flush=True,
                )
    finally:
        _stop([process])  # its compilers too, past the time limit or on a signal
    if process.returncode != 0:
        within = f" within {timeout_s:.0f} s" if time.time() - start > timeout_s else ""
        raise RuntimeError(f"DeepSpeed's CPU comm op does not build here{within}: {_last_line(log)} (log {log})")


# A launch with restarts allowed: one restart, a rendezvous the restarted ranks can join (c10d, a new store per
# attempt: training/recovery/attempts.py), the launcher's check of its workers twice a second.
RESTARTS = ["--max_restarts", "1", "--monitor_interval", "0.5", "--rdzv_backend", "c10d"]


def restart_environment(topology: Topology) -> dict[str, str]:
    """The environment a launch with restarts needs: a new rendezvous store per attempt; one node's endpoint."""
    from ..training.recovery.attempts import RESTARTABLE

    endpoint = {"PET_RDZV_ENDPOINT": f"127.0.0.1:{free_port()}"} if topology.nodes == 1 else {}
    return {**RESTARTABLE, **endpoint}


def launch_commands(
    topology: Topology, config_file: Path, target: list[str], restarts: bool = False
) -> list[list[str]]:
    """One `accelerate launch` per node, all on one free port (with `restarts`: one restart allowed)."""
    port = str(free_port())
    base = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config_file)]
    base += RESTARTS if restarts else []
    if topology.nodes == 1:
        return [[*base, "--main_process_port", port, *target]]
    return [
        [*base, "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1", "--main_process_port", port, *target]
        for rank in range(topology.nodes)
    ]


@dataclass
class RunResult:
    name: str
    returncodes: list[int | None]
    seconds: float
    log: Path
    records: list[dict]
    hung: str | None = None  # why the rehearsal had to stop the run
    killed: dict | None = None  # killed.json: the rank and step of the planted SIGKILL
    teardown_s: float | None = None  # from the SIGKILL to the last launcher's exit
    attempts: int = 1  # a launch with restarts: how many attempts ran
    fault: dict | None = None  # a launch with restarts: fault.json, the planted SIGKILL or SIGSTOP

    @property
    def ok(self) -> bool:
        return self.hung is None and all(code == 0 for code in self.returncodes)

    def tail(self, lines: int = 8) -> str:
        """The last lines of the log, progress bars left out."""
        text = self.log.read_text(errors="replace").splitlines() if self.log.exists() else []
        return "\n".join([line[-300:] for line in text if line.strip() and "it/s]" not in line][-lines:])

    def error(self) -> str:
        """The last error line of the log (the root cause a rank raised), or ''."""
        text = self.log.read_text(errors="replace").splitlines() if self.log.exists() else []
        lines = [RANK_PREFIX.sub("", line.strip()) for line in text]
        errors = [line for line in lines if ERROR.match(line) and "ChildFailedError" not in line]
        return errors[-1][:400] if errors else ""


def read_records(record_dir: Path) -> list[dict]:
    records = []
    for path in sorted(record_dir.glob("rank-*.json")):
        with contextlib.suppress(ValueError):
            records.append(json.loads(path.read_text()))
    return sorted(records, key=lambda r: r["rank"])


class Interrupted(BaseException):
    """SIGTERM, SIGINT or SIGHUP reached the rehearsal: raised in its main thread so every `finally` runs (a
    BaseException, like KeyboardInterrupt, so that no `except Exception` swallows it)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def interrupted_by_signals(signals=SIGNALS):
    """Turn `signals` into `Interrupted` inside the block (main thread only); the former handlers after it."""

    def handler(signum, frame):
        raise Interrupted(signum)

    previous = {s: signal.signal(s, handler) for s in signals}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


@contextlib.contextmanager
def signals_held():
    """Hold SIGTERM / SIGINT / SIGHUP back (delivered at the block's end): a launcher started but not yet in the
    list, or a second signal in the middle of the clean-up, would leave processes behind."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def descendants(processes: list[subprocess.Popen]) -> list:
    """Every live process under the launchers still running (psutil, which tells a reused PID apart)."""
    import psutil  # a dependency of accelerate

    found = []
    for process in processes:
        if process.poll() is None:  # not reaped: its PID is still this launcher's
            with contextlib.suppress(psutil.NoSuchProcess):
                found += psutil.Process(process.pid).children(recursive=True)
    return found


def _stop(processes: list[subprocess.Popen], seen=()) -> None:
    """SIGKILL each launcher still running, every process under it or `seen` under it before (an orphan whose
    launcher exited), and the process group of each (torchrun starts its workers in their own sessions; a
    worker's own children share its group), then reap the launchers."""
    with signals_held():
        _kill_all(processes, seen)


def _kill_all(processes: list[subprocess.Popen], seen) -> None:
    import psutil

    own_group = os.getpgrp()
    tree = [*seen, *descendants(processes)]
    groups = {process.pid for process in processes if process.poll() is None}  # start_new_session: pgid == pid
    for child in tree:
        with contextlib.suppress(psutil.Error, OSError):
            if child.is_running():
                groups.add(os.getpgid(child.pid))
    for group in groups - {own_group}:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)
    for child in tree:
        with contextlib.suppress(psutil.Error):
            child.kill()
    for process in processes:
        process.wait()


def latest_records(record_dir: Path) -> tuple[list[dict], int | None]:
    """The ranks' records of a run so far: its newest attempt's under a launch with restarts (and that attempt's
    number), else the run's own."""
    attempts = sorted(record_dir.glob("attempt*"), key=lambda p: int(p.name.removeprefix("attempt")))
    if attempts:
        return read_records(attempts[-1]), int(attempts[-1].name.removeprefix("attempt"))
    return read_records(record_dir), None


def waiting_for(records: list[dict], attempt: int | None, world_size: int, log: Path, fault: dict | None) -> str:
    """What a running launch waits for, in words: its ranks' step (their records), the planted fault's outcome, or,
    before any rank trains, the launch's last log line. `attempt`: None without restarts."""
    if fault and not attempt:  # planted in this launch (the first attempt of one with restarts)
        if fault.get("kind") == "stop":
            what, then = "stopped", "the hang watchdog to notice and the launch to restart the ranks"
        else:
            what, then = "killed", "the launch to " + ("restart the ranks" if attempt is not None else "tear down")
        return f"rank {fault['rank']} {what} in step {fault['step']} (planted); waiting for {then}"
    where = f"attempt {attempt}: " if attempt else ""
    if not records:
        return f"{where}waiting for the ranks to start training (the launch's last line: {_last_line(log)})"
    if len(records) == world_size and all(r["finished"] for r in records):
        return f"{where}every rank finished training; waiting for the script (its final save) and the launch to end"
    step = max(max(map(int, r["losses"]), default=r.get("start_step", 0)) for r in records)
    return f"{where}step {step} of {records[0].get('max_steps', '?')} ({len(records)} of {world_size} ranks reporting)"


def _last_line(log: Path) -> str:
    text = log.read_text(errors="replace") if log.exists() else ""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:120] if lines else "none yet"


def run_launch(
    name: str,
    commands: list[list[str]],
    record_dir: Path,
    log: Path,
    world_size: int,
    timeout_s: float,
    exit_grace_s: float = 120.0,
    teardown_s: float = 90.0,
    env: dict[str, str] | None = None,
    progress_s: float = PROGRESS_S,
) -> RunResult:
    """Run one launch to its end, or stop it: past `timeout_s`, `exit_grace_s` after every rank finished training
    without exiting, or `teardown_s` after the planted SIGKILL without the launchers exiting. Every `progress_s`
    a line says what it waits for. No process of the launch outlives it, whatever ends it."""
    record_dir.mkdir(parents=True, exist_ok=True)
    start, hung, killed_at, finished_at = time.time(), None, None, None
    processes: list[subprocess.Popen] = []
    seen: list = []
    last_line = start
    try:
        with log.open("w") as out:
            for command in commands:
                with signals_held():  # a launcher started is a launcher in the list
                    processes.append(
                        subprocess.Popen(
                            command,
                            stdout=out,
                            stderr=subprocess.STDOUT,
                            env={**environment(), **(env or {})},
                            start_new_session=True,
                        )
                    )
            while any(p.poll() is None for p in processes):
                time.sleep(POLL_S)
                seen += [p for p in descendants(processes) if p not in seen]
                now = time.time()
                killed_file = record_dir / "killed.json"
                if killed_at is None and killed_file.exists():
                    killed_at = now
                records, attempt = latest_records(record_dir)
                if finished_at is None and len(records) == world_size and all(r["finished"] for r in records):
                    finished_at = now
                if now - last_line >= progress_s:
                    fault = _read_json(killed_file) or _read_json(record_dir / "fault.json")
                    state = waiting_for(records, attempt, world_size, log, fault)
                    print(f"[rehearse] {name}: {now - start:.0f} s, {state}", flush=True)
                    last_line = now
                if killed_at is not None and now - killed_at > teardown_s:
                    hung = f"the launch did not tear down within {teardown_s:.0f} s after a rank was killed"
                elif finished_at is not None and now - finished_at > exit_grace_s:
                    hung = f"every rank finished training but the launch had not exited {exit_grace_s:.0f} s later"
                elif now - start > timeout_s:
                    hung = f"the run did not end within {timeout_s:.0f} s"
                if hung:
                    break
        end = time.time()
    finally:
        _stop(processes, seen)
    killed = _read_json(record_dir / "killed.json")
    teardown = end - killed["time"] if killed and not hung else None
    codes = [p.returncode for p in processes]
    return RunResult(name, codes, end - start, log, read_records(record_dir), hung, killed, teardown)


def _read_json(path: Path) -> dict | None:
    with contextlib.suppress(FileNotFoundError, ValueError):
        return json.loads(path.read_text())
    return None
