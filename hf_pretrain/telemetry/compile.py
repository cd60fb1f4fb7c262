"""`CompileCallback`: what torch.compile cost this run, in the first training logs and on the console.

Telemetry, not a preflight: compilation is lazy (Dynamo traces and Inductor lowers at the first forward and
backward), so its cost is only seen during the run, in the first optimizer step. The callback times the first
`STEPS` steps on the host (synchronising the accelerator at each step end, those steps only) and, once they are
done, logs once (`KEYS`):

- `compile_time_s`: first step minus the median of the next `STEPS - 1` (the compile of forward and
  backward, cold or from the FX graph cache: a second run on the same machine compiles faster)
- `compile_graphs`: graphs Dynamo produced so far (1 per kind of block for `torch_compile_scope='blocks'`,
  1 for the whole model; more means recompiles)
- `compile_graph_breaks`: graph breaks Dynamo recorded (0 for `PretrainForCausalLM`; a break splits a graph
  and leaves the code between the pieces eager)

and prints `compile: scope=blocks backend=inductor 12 blocks, 2.31 s to compile, 2 graphs, 0 graph breaks`.
Recompiles later in the run (an evaluation's other shapes) are not counted. Clock values: kept out of
`state.log_history` like the other timings. `training/compile.py` compiles; `training/wiring.py` adds this
callback when `torch_compile` is on.
"""

from __future__ import annotations

import statistics
import time

import torch

from ..callback import PretrainCallback

STEPS = 4
KEYS = ("compile_time_s", "compile_graphs", "compile_graph_breaks")


def dynamo_counts() -> tuple[int, int]:
    """(graphs, graph breaks) Dynamo has recorded in this process."""
    from torch._dynamo.utils import counters

    return int(counters["stats"].get("unique_graphs", 0)), int(sum(counters["graph_break"].values()))


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class CompileCallback(PretrainCallback):
    keep_in_history = False

    def __init__(self, scope: str, backend: str, blocks: int | None = None, print_report: bool = True):
        self.scope, self.backend, self.blocks, self.print_report = scope, backend, blocks, print_report
        self.times: list[float] = []
        self.report: dict | None = None
        self._pending: dict = {}
        self._start = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        if len(self.times) < STEPS:
            _synchronize()
            self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if len(self.times) >= STEPS:
            return
        _synchronize()
        self.times.append(time.perf_counter() - self._start)
        if len(self.times) == STEPS:
            graphs, breaks = dynamo_counts()
            compile_s = max(0.0, self.times[0] - statistics.median(self.times[1:]))
            self.report = {
                "compile_time_s": round(compile_s, 3),
                "compile_graphs": graphs,
                "compile_graph_breaks": breaks,
            }
            self._pending = dict(self.report)
            if self.print_report and state.is_world_process_zero:
                print(self.summary(), flush=True)

    def summary(self) -> str:
        blocks = f" {self.blocks} blocks," if self.blocks else ""
        r = self.report
        return (
            f"compile: scope={self.scope} backend={self.backend}{blocks} {r['compile_time_s']:.2f} s to compile, "
            f"{r['compile_graphs']} graphs, {r['compile_graph_breaks']} graph breaks"
        )

    def metrics_for_log(self, state) -> dict:
        pending, self._pending = self._pending, {}
        return pending
