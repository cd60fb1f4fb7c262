"""hf_pretrain: pretrain Llama-style models from scratch on the Hugging Face stack.

`import hf_pretrain` imports neither torch nor transformers, so `hf-pretrain --help` and argument
errors answer at once; every public name is imported on first use (PEP 562). The model is
registered with transformers' auto classes (`AutoConfig`, `AutoModelForCausalLM` load an
`hf_pretrain` checkpoint after `import hf_pretrain`) as soon as transformers' auto module is
imported: `_RegisterWithAutoClasses` waits for it. Written by hand: transformers has no entry point
through which a package registers its model without importing it (and torch) first.

Two import-time messages of other packages are filtered here, and only these: on a machine without
CUDA, torchao's "Failed to load ..." of its CUDA-only kernels (it still works, and a GPU machine
keeps the message), and torch's pytree deprecation note about torchao's enums. They say nothing
about the user's run and scroll every command's first screen. transformers imports torchao, so
a script that wants them gone imports hf_pretrain before transformers.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import logging
import sys

from .lazy import lazy_getattr


class _ImportNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.name == "torchao":
            import torch  # loaded already: torchao is importing

            return not (message.startswith("Failed to load") and not torch.cuda.is_available())
        return "register_constant() on Enum subclasses is deprecated" not in message


for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).addFilter(_ImportNoise())


class _RegisterWithAutoClasses(importlib.abc.MetaPathFinder):
    """Registers the model (imports `hf_pretrain.modeling`) right after `transformers.models.auto` is imported."""

    AUTO = "transformers.models.auto"

    def find_spec(self, name, path, target=None):
        if name != self.AUTO:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_register(module):
            exec_module(module)
            importlib.import_module(".modeling", __name__)  # its import registers; a no-op while it is importing

        spec.loader.exec_module = exec_and_register
        return spec


if _RegisterWithAutoClasses.AUTO in sys.modules:
    importlib.import_module(".modeling", __name__)
elif not any(isinstance(finder, _RegisterWithAutoClasses) for finder in sys.meta_path):
    sys.meta_path.insert(0, _RegisterWithAutoClasses())

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


__getattr__ = lazy_getattr(__name__, _HOMES)


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
