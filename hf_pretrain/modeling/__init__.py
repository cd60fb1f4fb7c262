"""The model and nothing else: config, attention entry point, decoder, export. Importing it registers the model with
transformers' auto classes (`configuration.py` and `model.py` register their own class)."""

from .configuration import PretrainConfig
from .model import PretrainForCausalLM, PretrainModel

__all__ = ["PretrainConfig", "PretrainForCausalLM", "PretrainModel"]
