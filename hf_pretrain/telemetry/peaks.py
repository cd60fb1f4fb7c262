"""Peak FLOPs of a chip: the vendor's spec sheet, and a ceiling measured on the chip itself.

MFU needs a denominator. The spec peaks are dense tensor-core TFLOP/s per GPU by precision column
(`bf16`, `fp8`, `fp4`), read from the one chip table, `hf_pretrain/chips.py` (`spec_tflops`). A chip
missing from the table gets no spec MFU at all (reported as unavailable, with one message asking for
`peak_tflops`), never a made-up 0.00. The measured ceiling is what a large matmul in the run's
GEMM precision reaches on this very device at start-up: a spec can be unreachable (power-capped
boxes, consumer cards), and MFU against the measured ceiling says how much of the *reachable*
speed the run uses. Both are logged, on one basis: the same precision for both denominators.

FP8: the ceiling of an fp8 recipe is measured with fp8 GEMMs (`torch._scaled_mm` on e4m3 operands,
bf16 output, unit scales: the kernel torchao's float8 linears call), which run about twice as fast
as bf16 ones; a bf16 ceiling would let an fp8 run's MFU pass 1.0. It accumulates as the run's
own torchao recipe accumulates its forward GEMM: the config is built by the very call the
conversion makes (`Float8LinearConfig.from_recipe_name(scaling)`, precision/convert.py), so a
torchao whose `tensorwise` and `rowwise` recipes differ is followed by construction (both use fast
accumulation in torchao 0.12-0.18; their backward GEMMs accumulate exactly, which is slower on
Hopper): the fastest fp8 GEMM the recipe runs. Only chips with fp8 tensor
cores have such a GEMM (CUDA compute capability >= 8.9: Ada, Hopper, Blackwell): anywhere else
(`precision.recipes.fp8_matmul_native` is False: a CPU, an A100) fp8 is emulated by up-casting, there is no fp8
ceiling to measure, and `ceiling_dtype` returns None (no `mfu_measured` for that run). FP4 has no
plain matmul in PyTorch (its GEMMs need block scales): no measured ceiling either.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..precision.recipes import fp8_dtype, fp8_matmul_native


def ceiling_dtype(precision: str, device: torch.device | str) -> torch.dtype | None:
    """The matmul dtype whose ceiling is the denominator of `mfu_measured` for a run's GEMM precision.

    `precision` is `telemetry.throughput.precision_of(args, model)` (`fp32`, `bf16`, `fp16`, `fp8`, `fp4`).
    None when this device has no native matmul in that precision (fp8 off fp8 tensor cores, fp4).
    """
    if precision == "fp8":
        return fp8_dtype() if fp8_matmul_native(device) else None
    if precision == "fp4":
        return None
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)


def device_name(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    import platform

    return platform.processor() or platform.machine() or device.type


@dataclass
class MeasuredCeiling:
    tflops: float
    size: int
    dtype: str
    seconds: float


def fp8_forward_fast_accum(scaling: str | None = None) -> bool:
    """Whether the forward GEMM of torchao's float8 recipe `scaling` (`tensorwise`, `rowwise`: the config
    `Float8LinearConfig.from_recipe_name(scaling)` that precision/convert.py converts with) accumulates in fast
    mode. True without a torchao recipe (`scaling` None: Transformer Engine's forward GEMM accumulates fast too)
    or without torchao."""
    if scaling is None:
        return True
    try:
        from torchao.float8 import Float8LinearConfig
    except ImportError:
        return True
    return Float8LinearConfig.from_recipe_name(scaling).gemm_config_output.use_fast_accum


def measure_matmul_tflops(
    device: torch.device | str,
    dtype: torch.dtype,
    size: int | None = None,
    seconds: float = 0.5,
    scaling: str | None = None,
) -> MeasuredCeiling:
    """TFLOP/s of repeated square matmuls in `dtype` on `device` for about `seconds` (after one warm-up).

    A float8 `dtype` runs `torch._scaled_mm` (e4m3 x e4m3 -> bf16, unit scales, the second operand
    column-major as the kernel wants it, accumulating as the forward GEMM of torchao's recipe `scaling` does:
    `fp8_forward_fast_accum`); other dtypes a plain `a @ b` (`scaling` unused).
    """
    device = torch.device(device)
    size = size or (8192 if device.type == "cuda" else 1024)
    if dtype.is_floating_point and dtype.itemsize == 1:  # float8
        a = torch.randn(size, size, device=device).to(dtype)
        b = torch.randn(size, size, device=device).to(dtype).t()  # column-major
        one = torch.ones((), device=device)
        fast = fp8_forward_fast_accum(scaling)

        def matmul():
            return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=fast)
    else:
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)

        def matmul():
            return a @ b

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    matmul()
    sync()
    runs, start = 0, time.perf_counter()
    while True:
        matmul()
        runs += 1
        if runs % 4 == 0:
            sync()
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                break
    return MeasuredCeiling(2 * size**3 * runs / elapsed / 1e12, size, str(dtype).removeprefix("torch."), elapsed)


_CEILINGS: dict[tuple[str, torch.dtype, str | None], float] = {}


def matmul_ceiling(device: torch.device | str, dtype: torch.dtype, scaling: str | None = None) -> float:
    """`measure_matmul_tflops(device, dtype, scaling=scaling).tflops`, measured once per device, dtype and torchao
    fp8 recipe in a process: every `train()` of a script reads the same chip, and the measurement takes half a
    second."""
    key = (str(torch.device(device)), dtype, scaling)
    if key not in _CEILINGS:
        _CEILINGS[key] = measure_matmul_tflops(device, dtype, scaling=scaling).tflops
    return _CEILINGS[key]
