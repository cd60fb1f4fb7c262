"""Public names imported on first use (PEP 562): a package's `__init__` says where each of its names lives, and
`import` of the package stays cheap (no torch, no transformers) until a name is used, so the command line answers
`--help` and argument errors at once."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def lazy_getattr(package: str, homes: dict[str, str]) -> Callable[[str], object]:
    """The module `__getattr__` of `package`: `homes` maps a public name to the submodule (relative) that defines it."""

    def __getattr__(name: str):
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(homes[name], package), name)
        setattr(sys.modules[package], name, value)  # found once: the next access is a plain attribute
        return value

    return __getattr__
