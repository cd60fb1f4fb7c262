"""The `env` row: the device, torch, CUDA, transformers, which packages are missing and which loss path runs."""

from __future__ import annotations

import torch

from .common import Context, transformers_note, version

GOAL = "-"
PACKAGES = ("datasets", "torchao", "liger-kernel", "flash-attn", "transformer-engine", "deepspeed")


def run(ctx: Context) -> dict:
    from hf_pretrain.modeling.loss import implementation

    name = torch.cuda.get_device_name(ctx.device) if ctx.cuda else "cpu (dry run)" if ctx.dry_run else "cpu"
    capability = ".".join(map(str, torch.cuda.get_device_capability(ctx.device))) if ctx.cuda else None
    packages = {p: version(p) for p in (*PACKAGES, "pyarrow", "fsspec")}
    absent = [p for p in PACKAGES if packages[p] is None]
    loss = implementation(ctx.device)
    text = f"{name}" + (f" (sm {capability})" if capability else "") + f", torch {torch.__version__}"
    text += f", CUDA {torch.version.cuda}" if torch.version.cuda else ""
    text += f", {transformers_note()}, chunked loss: {loss if loss != 'none' else 'none (full logits)'}"
    text += f"; not installed: {', '.join(absent)}" if absent else ""
    details = {"packages": packages, "capability": capability, "chunked_loss": loss}
    return {"result": text, "value": None, "pass": None, "details": details}
