"""hf_pretrain: pretrain Llama-style models from scratch on the Hugging Face stack."""

from .modeling import PretrainConfig, PretrainForCausalLM, PretrainModel
from .modeling.export import export_hf
from .presets import PRESETS, get_preset
from .training import PretrainingArguments, PretrainTrainer

__version__ = "0.1.0"

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
