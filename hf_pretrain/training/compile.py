"""torch.compile of `PretrainForCausalLM`: the whole model, or each decoder block ("regional").

Two scopes, chosen with `PretrainingArguments.torch_compile_scope` next to transformers' `--torch_compile`
(`torch_compile_backend`, `torch_compile_mode` keep their meaning):

- `model` (default): accelerate's `torch.compile(model)`, what `Trainer` does. One graph for the whole
  forward; the compile time grows with depth (every block is traced and lowered again).
- `blocks`: each decoder layer is compiled in place (`nn.Module.compile`, as torchtitan compiles each
  `TransformerBlock`); the outer loop, the masks, the embedding and the loss stay eager. The layers share
  one code object, so Dynamo traces a block once per kind of block (full / sliding window, dense / MoE)
  and the compile time stays flat with depth (docs/benchmarks.md).

Why not accelerate's own regional compilation (`TorchDynamoPlugin(use_regional_compilation=True)`):
`compile_regions` returns a shallow copy of the model with `torch.compile(child)` wrappers for every other
child, so `lm_head` becomes an `OptimizedModule` (the chunked loss needs a bare `nn.Linear` and would fall back
to full logits) and the attention plan the preflight pins lives on the original, not on the copy. In-place
`compile()` keeps every module's type, hooks and attributes, which is also what DeepSpeed needs (accelerate
uses in-place compile for DeepSpeed engines for the same reason).

What the model does so that Dynamo sees no graph break (tests/training/test_compile.py checks with
`torch._dynamo.explain`): the attention kernels are planned outside the graph (`PretrainModel._plan_for`;
PretrainTrainer pins the plan before the first step, a standalone user runs one eager forward or pins with
`set_attention_plan(plan, pin=True)`), and the MoE dispatch counts pairs per expert with a static-shape
`index_add_`. The MoE layer's one host sync (`tolist()` of the per-expert sizes) is traced as unbacked
sizes when `torch._dynamo.config.capture_scalar_outputs` is on (torchtitan sets it for its MoE too):
`prepare_compile` turns it on for models with experts.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

SCOPES = ("model", "blocks")


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated decoder layers (transformers' `GradientCheckpointingLayer` subclasses) of `model`."""
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def compile_blocks(model: nn.Module, **compile_kwargs) -> int:
    """Compile each decoder layer of `model` in place; returns how many (already compiled ones are left as they are)."""
    blocks = decoder_blocks(model)
    if not blocks:
        raise ValueError(
            f"torch_compile_scope='blocks': {type(model).__name__} has no transformers GradientCheckpointingLayer "
            "decoder layers to compile; use torch_compile_scope='model'."
        )
    prepare_compile(model)
    for block in blocks:
        if getattr(block, "_compiled_call_impl", None) is None:
            block.compile(**compile_kwargs)
    return len(blocks)


def prepare_compile(model: nn.Module) -> None:
    """Settings the model needs before Dynamo traces it: unbacked sizes for the MoE dispatch."""
    if getattr(getattr(model, "config", None), "num_experts", 0):
        torch._dynamo.config.capture_scalar_outputs = True


def accelerator_args_for(args, accelerator_args: dict) -> dict:
    """The Trainer's accelerator arguments; with scope 'blocks' (layers compiled in place) accelerate compiles nothing."""
    if args.torch_compile and getattr(args, "torch_compile_scope", "model") == "blocks":
        from accelerate.utils import TorchDynamoPlugin

        accelerator_args["dynamo_plugin"] = TorchDynamoPlugin(backend="no")
    return accelerator_args


def compile_kwargs(args) -> dict:
    """`torch.compile` options from TrainingArguments' `torch_compile_backend` / `torch_compile_mode`."""
    kwargs = {"backend": args.torch_compile_backend or "inductor"}
    if args.torch_compile_mode:
        kwargs["mode"] = args.torch_compile_mode
    return kwargs
