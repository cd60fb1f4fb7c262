"""hf_pretrain: pretrain Llama-style models from scratch on the Hugging Face stack.

The model (and its registration with transformers' Auto classes) and the presets load with the
package. The trainer and its arguments load on first use (`hf_pretrain.PretrainTrainer`): they pull
in the data chain and with it `datasets`, which the model, the telemetry, the memory estimator and
the precision recipes do not need (a GPU box without `datasets` can still run those).
"""

from importlib import import_module
from typing import TYPE_CHECKING

from .modeling import PretrainConfig, PretrainForCausalLM, PretrainModel
from .modeling.export import export_hf
from .presets import PRESETS, get_preset

if TYPE_CHECKING:
    from .training import PretrainingArguments, PretrainTrainer

__version__ = "0.1.0"

_LAZY = {"PretrainingArguments": ".training", "PretrainTrainer": ".training"}

__all__ = [
    "PRESETS",
    "PretrainConfig",
    "PretrainForCausalLM",
    "PretrainModel",
    "PretrainTrainer",
    "PretrainingArguments",
    "export_hf",
    "get_preset",
]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
