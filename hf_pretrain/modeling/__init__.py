"""The model and nothing else: config, attention entry point, decoder, export."""

from transformers import AutoConfig, AutoModelForCausalLM

from .configuration import PretrainConfig
from .model import PretrainForCausalLM, PretrainModel

AutoConfig.register(PretrainConfig.model_type, PretrainConfig)
AutoModelForCausalLM.register(PretrainConfig, PretrainForCausalLM)

__all__ = ["PretrainConfig", "PretrainForCausalLM", "PretrainModel"]
