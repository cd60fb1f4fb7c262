"""The `env` row: the device, torch, CUDA, transformers, which packages are missing and which loss path runs.

The packages carried to the GPU machine (`IMPORTS`, benchmarks/gpu_wheels.sh) are really imported here, not
only looked up in their metadata: a wheel that installs but refuses the machine's stack (datasets against its
pyarrow or fsspec, transformers against its tokenizers or huggingface-hub, torchao built for another torch)
fails at import, and would otherwise first show as an error deep inside the MFU row. Each import's outcome is
`ok`, `not installed`, or the exception's class and message, in the row's text and its details: what to
re-carry is said at once. A failing import is reported, never raised.
"""

from __future__ import annotations

import importlib

import torch

from .common import Context, transformers_note, version

GOAL = "-"
PACKAGES = ("datasets", "torchao", "liger-kernel", "flash-attn", "transformer-engine", "deepspeed")
IMPORTS = {"datasets": "datasets", "transformers": "transformers", "torchao": "torchao", "liger-kernel": "liger_kernel"}


def try_import(module: str) -> str:
    """`ok`, `not installed` (the module itself is absent), or `<exception class>: <message>` of its import."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name == module:
            return "not installed"
        return f"{type(err).__name__}: {str(err)[:300]}"  # a dependency of an installed package is missing
    except Exception as err:  # a wheel that refuses this stack: reported, the other rows still run
        return f"{type(err).__name__}: {str(err)[:300]}"
    return "ok"


def imports() -> dict[str, str]:
    """The import outcome of every carried package, by distribution name."""
    return {package: try_import(module) for package, module in IMPORTS.items()}


def run(ctx: Context) -> dict:
    from hf_pretrain.modeling.loss import implementation

    name = torch.cuda.get_device_name(ctx.device) if ctx.cuda else "cpu (dry run)" if ctx.dry_run else "cpu"
    capability = ".".join(map(str, torch.cuda.get_device_capability(ctx.device))) if ctx.cuda else None
    packages = {p: version(p) for p in (*PACKAGES, "pyarrow", "fsspec")}
    absent = [p for p in PACKAGES if packages[p] is None]
    imported = imports()
    broken = [f"{p} ({outcome})" for p, outcome in imported.items() if outcome not in ("ok", "not installed")]
    loss = implementation(ctx.device)
    text = f"{name}" + (f" (sm {capability})" if capability else "") + f", torch {torch.__version__}"
    text += f", CUDA {torch.version.cuda}" if torch.version.cuda else ""
    text += f", {transformers_note()}, chunked loss: {loss if loss != 'none' else 'none (full logits)'}"
    text += f"; not installed: {', '.join(absent)}" if absent else ""
    text += f"; import failed: {'; '.join(broken)}" if broken else ""
    details = {"packages": packages, "imports": imported, "capability": capability, "chunked_loss": loss}
    return {"result": text, "value": None, "pass": None, "details": details}
