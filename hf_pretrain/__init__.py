"""hf_pretrain: pretrain Llama-style models from scratch on the Hugging Face stack.

`import hf_pretrain` registers the model with transformers' auto classes (`AutoConfig`,
`AutoModelForCausalLM` load an `hf_pretrain` checkpoint after it); the other public names are
imported on first use (PEP 562), so the model loads without `datasets` or the trainer.

Two import-time messages of other packages are filtered here, and only these: on a machine without
CUDA, torchao's "Failed to load ..." of its CUDA-only kernels (it still works, and a GPU machine
keeps the message), and torch's pytree deprecation note about torchao's enums. They say nothing
about the user's run and scroll every command's first screen.
"""

from __future__ import annotations

import importlib
import logging

import torch


class _ImportNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.name == "torchao":
            return not (message.startswith("Failed to load") and not torch.cuda.is_available())
        return "register_constant() on Enum subclasses is deprecated" not in message


for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).addFilter(_ImportNoise())

from . import modeling  # noqa: E402  (registers the auto classes)

__version__ = "0.1.0"

_HOMES = {
    "export_hf": ".modeling.export",
    "PRESETS": ".presets",
    "get_preset": ".presets",
    "PretrainingArguments": ".training",
    "PretrainTrainer": ".training",
}

PretrainConfig = modeling.PretrainConfig
PretrainForCausalLM = modeling.PretrainForCausalLM
PretrainModel = modeling.PretrainModel

__all__ = sorted(["PretrainConfig", "PretrainForCausalLM", "PretrainModel", *_HOMES])


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'hf_pretrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
