"""Repeat tests in fresh pytest sessions and count, per test, how often it passed: the check that a multi-process
test is not flaky (a test that fails 1 run in 4 rejects good work).

Each round is one new `pytest` process over the selection (module fixtures, launches and process exits all happen
anew), its results read from a JUnit XML file. The tally goes to `--out/tally.json` after every round (a run cut
short keeps what it counted) and the output of every failing round to `--out/round-K.log`.

    python -m tests.repeat_tests --rounds 30 -m distributed            # every multi-process test, 30 times
    python -m tests.repeat_tests --rounds 30 tests/evaluation/test_generation_probe.py
    python -m tests.repeat_tests --rounds 30 -m distributed --until 04:00   # stop starting rounds after 04:00

Prints one line per round and, at the end, each test's passes / runs and its longest streak of passes in a row.
This is a tool for developers, not part of `make test` (30 rounds of the multi-process tests take hours on 2 cores).

The record goes to `--out` (default `runs/repeat/`, ignored by git: a record is a run's log, never a commit; its
result goes into a closing note or a doc as one sentence, "N rounds in a row on <commit>"). A tally can be continued
in a later session: `OUT/meta.json` records the selection and a fingerprint of the code the tests run (the git
blobs of `hf_pretrain/`, `tests/`, `examples/`, `ds_configs/`, `setup.cfg`, `pyproject.toml`, not this tool;
"dirty" with uncommitted changes there), and `--resume` goes on counting only while both are the same.

    python -m tests.repeat_tests --resume -m distributed
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE = ("hf_pretrain", "tests", "examples", "ds_configs", "setup.cfg", "pyproject.toml")


NOT_CODE = ("tests/repeat_tests.py",)  # this tool


def code_fingerprint() -> str:
    """The git blobs of what the tests run (`CODE` less `NOT_CODE`), hashed; "dirty" with uncommitted changes there."""
    git = ["git", "-C", str(ROOT)]
    status = subprocess.run([*git, "status", "--porcelain", "--", *CODE], capture_output=True, text=True, check=True)
    if any(not any(part in line for part in NOT_CODE) for line in status.stdout.splitlines()):
        return "dirty"
    listing = subprocess.run([*git, "ls-tree", "-r", "HEAD", "--", *CODE], capture_output=True, text=True, check=True)
    blobs = [line for line in listing.stdout.splitlines() if not any(part in line for part in NOT_CODE)]
    return hashlib.sha256("\n".join(blobs).encode()).hexdigest()[:16]


def load_tally(out: Path, selection: list[str], fingerprint: str) -> tuple[dict, int]:
    """The tally and the rounds already counted in `out`, if they were counted on this code and selection."""
    meta = json.loads((out / "meta.json").read_text()) if (out / "meta.json").exists() else {}
    if not meta:
        raise SystemExit(f"--resume: {out} has no meta.json (no tally to go on with); drop --resume.")
    if meta["selection"] != selection:
        reason = f"another selection (then: {' '.join(meta['selection'])[:300]})"
    elif fingerprint == "dirty" or meta["fingerprint"] != fingerprint:
        reason = f"other code ({meta['fingerprint']} then, {fingerprint} now; commit the changes, or start anew)"
    else:
        return json.loads((out / "tally.json").read_text()), meta["rounds"]
    raise SystemExit(f"--resume: {out} was counted with {reason}; start a new tally (another --out, no --resume).")


def run_round(selection: list[str], xml: Path, log: Path) -> tuple[dict[str, str], float, int]:
    """One fresh pytest session: {test id: passed | failed | error | skipped}, its seconds, its exit code."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *selection]
    start = time.monotonic()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    seconds = time.monotonic() - start
    outcomes = read_junit(xml) if xml.exists() else {}
    if result.returncode not in (0, 5) or any(o in ("failed", "error") for o in outcomes.values()):
        log.write_text(result.stdout + result.stderr)
    return outcomes, seconds, result.returncode


def read_junit(xml: Path) -> dict[str, str]:
    outcomes = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        tags = {child.tag for child in case}
        outcomes[name] = next((t for t in ("failure", "error", "skipped") if t in tags), "passed")
        outcomes[name] = {"failure": "failed"}.get(outcomes[name], outcomes[name])
    return outcomes


def update(tally: dict, outcomes: dict[str, str]) -> None:
    for name, outcome in outcomes.items():
        entry = tally.setdefault(name, {"runs": 0, "passed": 0, "failed": 0, "skipped": 0, "streak": 0, "best": 0})
        entry["runs"] += 1
        entry[{"error": "failed"}.get(outcome, outcome)] += 1
        entry["streak"] = entry["streak"] + 1 if outcome == "passed" else 0
        entry["best"] = max(entry["best"], entry["streak"])


def deadline_after(now: datetime.datetime, clock: str | None) -> datetime.datetime | None:
    """The first HH:MM at or after `now` (so 01:30 given at 22:00 is tomorrow's)."""
    if not clock:
        return None
    hour, minute = (int(part) for part in clock.split(":"))
    deadline = now.replace(hour=hour, minute=minute, second=0, microsecond=0)
    return deadline if deadline >= now else deadline + datetime.timedelta(days=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30, help="rounds to run (more rounds, with --resume)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "repeat")
    parser.add_argument("--until", help="HH:MM (local time): start no round after it")
    parser.add_argument("--resume", action="store_true", help="go on counting the tally in --out (same code only)")
    args, selection = parser.parse_known_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    fingerprint = code_fingerprint()
    tally, done = load_tally(args.out, selection, fingerprint) if args.resume else ({}, 0)
    deadline = deadline_after(datetime.datetime.now(), args.until)
    for k in range(done + 1, done + args.rounds + 1):
        if deadline and datetime.datetime.now() >= deadline:
            print(f"stopped before round {k}: past {args.until}")
            break
        outcomes, seconds, code = run_round(selection, args.out / f"round-{k}.xml", args.out / f"round-{k}.log")
        if not outcomes:
            print(f"round {k}: pytest exited {code} with no results (see {args.out / f'round-{k}.log'})")
            return 2
        update(tally, outcomes)
        failed = sorted(name for name, outcome in outcomes.items() if outcome in ("failed", "error"))
        print(
            f"round {k}: {len(outcomes) - len(failed)}/{len(outcomes)} ok in {seconds:.0f} s"
            + "".join(f"\n  FAILED {name}" for name in failed),
            flush=True,
        )
        (args.out / "tally.json").write_text(json.dumps(tally, indent=1, sort_keys=True))
        meta = {"fingerprint": fingerprint, "rounds": k, "selection": selection}
        (args.out / "meta.json").write_text(json.dumps(meta, indent=1))
    for name, entry in sorted(tally.items()):
        print(f"{entry['passed']:3d}/{entry['runs']:<3d} passed, best streak {entry['best']:3d}  {name}")
    return 1 if any(entry["failed"] for entry in tally.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
