"""Training: the Trainer subclass and its arguments."""

from .arguments import PretrainingArguments
from .trainer import PretrainTrainer

__all__ = ["PretrainTrainer", "PretrainingArguments"]
