"""`hf-pretrain plan`: what to train with a budget, and the files that launch it.

An application on the top floor: it reads the package's facts (FLOPs per token, chip peaks, the memory
estimator, presets' shape recipe, schedules) and nothing in the package imports it back.

- `scaling.py`: the published fits (Chinchilla tokens per parameter, DeepSeek LLM's batch and learning rate in
  compute, repeated-data epochs) and the shape family;
- `planner.py`: `PlanRequest` -> `make_plan` -> `Plan` (or `PlanRefused` with the reason);
- `output.py`: the table, `plan.json`, the accelerate config and the launch command;
- `network.py`: the data-parallel traffic across nodes (`--network-gbps`) and what of it the compute hides;
- `resilience.py`: the checkpoint interval; `restart.py`: restart or resume on a faster path mid-run;
- `cli.py`: `hf-pretrain plan` flags.
"""

from .output import table, write_plan
from .planner import Plan, PlanRefused, PlanRequest, make_plan

__all__ = ["Plan", "PlanRefused", "PlanRequest", "make_plan", "table", "write_plan"]
