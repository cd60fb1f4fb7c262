"""hf_pretrain: pretrain Llama-style models from scratch on the Hugging Face stack.

The public names are imported on first use (PEP 562), so `hf-pretrain --help` and the commands that
need no model start without importing transformers.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_HOMES = {
    "PretrainConfig": ".modeling",
    "PretrainForCausalLM": ".modeling",
    "PretrainModel": ".modeling",
    "export_hf": ".modeling.export",
    "PRESETS": ".presets",
    "get_preset": ".presets",
    "PretrainingArguments": ".training",
    "PretrainTrainer": ".training",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'hf_pretrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
