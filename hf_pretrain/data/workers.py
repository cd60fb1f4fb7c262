"""Worker processes that die with their parent: a killed data step leaves no process behind.

`datasets` runs `map(num_proc=N)` and `from_generator(num_proc=N)` in a `multiprocess.Pool`, with a
`Manager` server process for progress, all forked from the main process. When the main process is
killed with SIGKILL (`kill -9`, the OOM killer), nothing tells them: a pool worker blocks for ever
reading the task pipe, whose write end it holds itself (inherited through fork), so it never sees
end-of-file, and the manager waits for requests (docs/known-failure-modes.md).

`children_die_with_parent()`, a context manager and decorator (re-entrant), arms a fork hook
(`os.register_at_fork`): a process forked from the main thread while it is armed asks the kernel
to kill it when its parent dies (Linux `prctl(PR_SET_PDEATHSIG, SIGKILL)`), and exits at once if
the parent died before it asked. The armed state is inherited, so the forks of a worker are armed
too and a whole tree goes down from the top. The data command line, the pipeline and every
block's `run` are armed; wrap your own multi-process data code in it the same way.

Trade-offs and limits:
- Linux only (`prctl`); elsewhere it does nothing.
- Forks from other threads are left alone: the kernel sends the signal when the parent *thread*
  exits, so a child of a short-lived thread would die with that thread.
- Processes that do not fork from Python (`subprocess`, the spawn and forkserver start methods) do
  not run fork hooks and are not covered; `datasets` forks on Linux.
- A killed worker leaves its half-written temporary cache file in the `datasets` cache folder; a
  relaunched `prepare` runs the unfinished step again from its start.

Written by hand: multiprocess's `Pool(initializer=...)` could do the same, but `datasets` creates
the pool and takes no initializer; psutil-based watchers would need a process of their own.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_state = {"depth": 0, "registered": False, "arm_child": False, "parent": 0, "prctl": None}


def _before_fork() -> None:
    _state["arm_child"] = _state["depth"] > 0 and threading.current_thread() is threading.main_thread()
    _state["parent"] = os.getpid()


def _after_fork_in_child() -> None:
    if not _state["arm_child"]:
        return
    _state["prctl"](PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != _state["parent"]:  # the parent died before the call: nobody will send the signal
        os._exit(1)


def _register() -> bool:
    if _state["registered"]:
        return True
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)  # resolved here, never in a freshly forked child
    _state["prctl"] = libc.prctl
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
    _state["registered"] = True
    return True


@contextlib.contextmanager
def children_die_with_parent():
    """Processes forked (from the main thread) inside this block are killed when their parent dies."""
    if not _register():
        yield
        return
    _state["depth"] += 1
    try:
        yield
    finally:
        _state["depth"] -= 1
