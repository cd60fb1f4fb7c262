"""`hf-pretrain` prints help and nothing else; the package root imports nothing heavy until a name is used."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(*argv):
    return subprocess.run([sys.executable, "-m", "hf_pretrain.cli", *argv], cwd=ROOT, capture_output=True, text=True)


def test_help_is_help_only():
    result = run("--help")
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout.startswith("usage: hf-pretrain {doctor,") and "estimate-memory --preset" in result.stdout


@pytest.mark.parametrize("command", ["estimate-memory", "trial", "advise-restart"])
def test_command_help_has_no_import_noise(command):
    result = run(command, "--help")
    assert result.returncode == 0 and result.stderr == "", result.stderr[:500]
    assert result.stdout.startswith(f"usage: hf-pretrain {command}")


def test_data_help_lists_the_commands_and_exits_0():
    result = run("data", "--help")  # it printed the usage and exited 2
    assert result.returncode == 0 and result.stderr == "", result.stderr[:500]
    assert result.stdout.startswith("usage: hf-pretrain data {clean,")
    assert "hf-pretrain data prepare pipeline.json" in result.stdout
    result = run("data", "pack", "--help")
    assert result.returncode == 0 and result.stdout.startswith("usage: hf-pretrain data pack")
    result = run("data")
    assert result.returncode == 2 and result.stderr.startswith("usage: hf-pretrain data {clean,")


def test_unknown_command_is_an_error_with_the_usage():
    result = run("trian")
    assert result.returncode == 2 and result.stderr.startswith("usage: hf-pretrain")


def test_importing_the_package_registers_the_model_quietly_and_loads_the_trainer_on_use():
    code = (
        "import sys, hf_pretrain\n"
        "from transformers import AutoConfig\n"
        "print(type(AutoConfig.for_model('hf_pretrain')).__name__, 'datasets' in sys.modules)\n"
        "print(hf_pretrain.PretrainTrainer.__name__)"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.stdout.split() == ["PretrainConfig", "False", "PretrainTrainer"], result.stderr[-500:]
    assert "Failed to load" not in result.stderr and "register_constant" not in result.stderr


HEAVY = ("torch", "transformers", "datasets")


@pytest.mark.parametrize(
    "argv", [[], ["--help"], ["data", "--help"], ["data", "dedup", "--help"], ["data", "dedup"], ["eval", "--help"]]
)
def test_help_and_argument_errors_import_nothing_heavy(argv):
    code = (
        "import sys, contextlib, io\n"
        "import hf_pretrain.cli as cli\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        f"    try: cli.main({argv!r})\n"
        "    except SystemExit: pass\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.split("\n")[-2] == "[]", result.stdout + result.stderr[-2000:]


def test_ctrl_c_is_one_line_and_a_relaunch_finishes_the_work(tmp_path):
    """Ctrl-C (SIGINT to the process group, as a terminal sends it) in the middle of `data prepare`: exit 130, one
    line saying what a relaunch does, no traceback, no process left; the relaunch then completes."""
    import json
    import os
    import signal
    import time

    from tests.data.test_workers import corpus

    corpus(tmp_path / "raw", copies=24)
    config = {"input": str(tmp_path / "raw"), "output_dir": str(tmp_path / "out"), "tokenizer": {"vocab_size": 300}}
    (tmp_path / "p.json").write_text(json.dumps({**config, "pack": {"seq_len": 64}}))
    command = [sys.executable, "-m", "hf_pretrain.cli", "data", "prepare", str(tmp_path / "p.json")]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    launch = subprocess.Popen(command, cwd=ROOT, start_new_session=True, **pipes)
    deadline = time.monotonic() + 120
    while not (tmp_path / "out" / "logs" / "01-documents").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # inside the documents stage's task (it takes seconds on this corpus)
    os.killpg(launch.pid, signal.SIGINT)
    _, err = launch.communicate(timeout=120)
    assert launch.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert err.rstrip().splitlines()[-1] == (
        "interrupted: hf-pretrain data stopped by Ctrl-C; run the same command again: it reuses every task that completed."
    )
    assert not (tmp_path / "out" / "05-pack" / "stats.json").exists()
    assert subprocess.run(command, cwd=ROOT, capture_output=True).returncode == 0
    assert (tmp_path / "out" / "05-pack" / "stats.json").exists()
