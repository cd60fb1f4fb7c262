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
