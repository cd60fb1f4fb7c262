"""The chip side of a plan: dense peak, memory and MFU, each with where it came from.

- Peak: the chip table (`chips.py`), in the recipe's `spec_key` column (the precision its matmuls run in, the
  column MFU reads too), or `--peak-tflops`.
- Memory: the chip table's memory (nvidia-smi's total), or `--device-memory-gb`.
- MFU: `--mfu`; else measured by `hf-pretrain trial` (`--trial trial.json`: the MFU against spec of the
  recommended recipe, or of `--precision`; a trial measures its own model on one GPU, so it is a guide to the
  planned run, not a measurement of it); else `MFU_ASSUMPTIONS`, recorded runs of shared/FIELD-NOTES.md
  recomputed with modeling/accounting.py. A chip with no recorded figure gets no made-up MFU: the plan asks for one.
- Link: the chip table's GB/s each way from a GPU to the rest of its node (NVLink, PCIe), or `--link-gbps`; both
  priced at `LINK_EFFICIENCY` of the line rate.
- Network: `--network-gbps` only, GB/s each way *per GPU* between nodes (a node's NICs over its GPUs: 8 x 400 Gb/s
  InfiniBand NDR for 8 GPUs is 50). It is the cluster's, not the chip's, so no table holds it: without it, traffic
  across nodes is unavailable (not zero) and the plan says so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..chips import device_memory_bytes, known_chips, link_gbps, match, spec_tflops
from ..distributed.memory import GiB
from ..precision.recipes import RECIPES

# The recipes a plan can run: those training in bf16 autocast (the recorded MFUs below are bf16 runs'; fp32 is
# not planned).
PLANNED_RECIPES = tuple(name for name, recipe in RECIPES.items() if recipe.autocast == "bf16")
# MFU against the spec bf16 peak that recorded runs reached (shared/FIELD-NOTES.md), with FLOPs counted by
# modeling/accounting.py. Keys are matched against device names by `chips.match` (most specific first).
MFU_ASSUMPTIONS: dict[str, tuple[float, str]] = {
    "gb10": (0.35, "field notes A: one GB10, 0.9B model, 5.2B tokens in 165 h = 35 % of 125 TFLOP/s"),
    "dgx spark": (0.35, "field notes A: one GB10, 0.9B model, 5.2B tokens in 165 h = 35 % of 125 TFLOP/s"),
    "h200": (0.40, "H100's published 1B-class MFU (llm-foundry 41.8 %, OLMo-core 39-40 %); same compute as H100"),
    "h100": (0.40, "1B-class models on H100: llm-foundry 41.8 %, OLMo-core 39-40 % (field notes)"),
    "h800": (0.40, "H100's published 1B-class MFU (llm-foundry 41.8 %, OLMo-core 39-40 %); same compute as H100"),
    "a100": (0.22, "field notes B: 8 x A100, 7B at 4K tokens, ~1.1B tokens/day = 22 % of 312 TFLOP/s"),
}
# Low precision, against its own (2x, 4x) peak: fp8 steps ~1.3x bf16's (OLMo-core 7B; torchtitan 1.28x), NVFP4
# ~7 % slower than fp8 (field notes A).
LOW_PRECISION_MFU = {
    "fp8": (1.3 / 2, "fp8 steps ~1.3x bf16's against a 2x peak"),
    "fp4": (1.3 * 0.93 / 4, "NVFP4 ~7 % slower than fp8 against a 4x peak"),
}


LINK_EFFICIENCY = 0.8  # the share of the link's line rate an NCCL all-to-all reaches (module docstring)
# The network between nodes is the cluster's, not the chip's: no table holds it, only --network-gbps gives it.
NETWORK_EXAMPLE = "GB/s each way per GPU, e.g. 50 for 8 x 400 Gb/s InfiniBand NDR per 8-GPU node"
NETWORK_UNKNOWN = f"not given: pass --network-gbps, {NETWORK_EXAMPLE}"


class PlanRefused(ValueError):
    """The budget or hardware cannot give a run; the message says why and what would."""


@dataclass
class Hardware:
    device: str
    gpus_per_node: int
    nodes: int
    precision: str  # the recipe
    peak_tflops: float  # dense, per GPU, in the recipe's peak precision
    peak_source: str
    memory_bytes: int
    memory_source: str
    mfu: float
    mfu_source: str
    link_gbps: float | None = None  # GB/s each way, one GPU to the rest of its node; None: unavailable
    link_source: str = "unavailable"
    network_gbps: float | None = None  # GB/s each way, one GPU's share of the network between nodes; None: unknown
    network_source: str = "unavailable"

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def sustained_flops(self) -> float:
        """Model FLOP/s of all GPUs together at the MFU."""
        return self.world * self.peak_tflops * 1e12 * self.mfu


def _trial_row(path: str, recipe: str | None) -> dict:
    try:
        result = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise PlanRefused(
            f"--trial {path}: unreadable ({err}); pass the trial.json `hf-pretrain trial` wrote."
        ) from None
    recipe = recipe or result.get("recommendation")
    rows = {row["recipe"]: row for row in result.get("rows", [])}
    row = rows.get(recipe)
    if row is None or row.get("status") != "ok":
        ran = [r for r, row in rows.items() if row.get("status") == "ok"]
        raise PlanRefused(f"--trial {path}: no completed row for recipe {recipe!r} (completed: {ran or 'none'}).")
    if row.get("mfu_spec_warning"):
        raise PlanRefused(
            f"--trial {path}: the {recipe} row's MFU was withheld as impossible ({row['mfu_spec_warning']}). Fix the "
            "peak or the timing it names and run `hf-pretrain trial` again, or pass --mfu."
        )
    if row.get("mfu_spec") and not 0 < row["mfu_spec"] <= 1:
        raise PlanRefused(
            f"--trial {path}: the {recipe} row's mfu_spec {row['mfu_spec']:g} is not in (0, 1]; pass --mfu."
        )
    if not row.get("mfu_spec"):
        raise PlanRefused(
            f"--trial {path}: the {recipe} row has no MFU against a spec peak (mfu_spec n/a: the trial ran on a "
            "chip without a spec peak, e.g. a CPU). Run `hf-pretrain trial` on the target GPU, or pass --mfu."
        )
    return row


def resolve_hardware(request) -> Hardware:
    """Peak, memory and MFU of the request's chip, each with where it came from."""
    recipe, trial_row = request.precision, None
    if request.trial:
        trial_row = _trial_row(request.trial, request.precision)
        recipe = trial_row["recipe"]
    recipe = recipe or "bf16"
    if recipe not in PLANNED_RECIPES:
        raise PlanRefused(f"--trial recommends {recipe!r}, which the planner does not plan; pass --precision bf16.")
    peak_precision = RECIPES[recipe].spec_key
    peak = request.peak_tflops or spec_tflops(request.device, peak_precision)
    if peak is None:
        raise PlanRefused(
            f"--device {request.device!r} has no dense {peak_precision} peak in the chip table (chips.py) "
            f"(known: {known_chips('peak')}); pass --peak-tflops, or a recipe the chip runs (--precision bf16)."
        )
    peak_source = "--peak-tflops" if request.peak_tflops else f"dense {peak_precision} spec, chips.py"
    if request.device_memory_gb:
        memory, memory_source = int(request.device_memory_gb * GiB), "--device-memory-gb"
    else:
        memory, memory_source = device_memory_bytes(request.device), "the chip table (chips.py)"
    if memory is None:
        raise PlanRefused(
            f"--device {request.device!r}: its memory is not in the chip table (chips.py); pass --device-memory-gb."
        )
    if request.mfu is not None:
        mfu, mfu_source = request.mfu, "--mfu (your assumption)"
    elif trial_row is not None:
        mfu = trial_row["mfu_spec"]
        mfu_source = f"measured by hf-pretrain trial ({request.trial}, {recipe}; its model, one GPU)"
    else:
        assumed = match(request.device, MFU_ASSUMPTIONS)
        if assumed is None:
            raise PlanRefused(
                f"--device {request.device!r}: no recorded MFU for this chip; measure one with `hf-pretrain trial` "
                "(--trial trial.json) or pass --mfu (e.g. 0.35)."
            )
        mfu, mfu_source = assumed
        if peak_precision in LOW_PRECISION_MFU:
            factor, why = LOW_PRECISION_MFU[peak_precision]
            mfu, mfu_source = mfu * factor, f"{mfu_source}; x {factor:.3f}: {why}"
        mfu_source = f"assumption: {mfu_source}"
    link, link_source = request.link_gbps, "--link-gbps"
    if link is None:
        link = link_gbps(request.device)
        link_source = "chips.py" if link else f"no link figure for {request.device!r} in chips.py"
    return Hardware(
        request.device,
        request.gpus,
        request.nodes,
        recipe,
        peak,
        peak_source,
        memory,
        memory_source,
        mfu,
        mfu_source,
        link,
        link_source,
        request.network_gbps,
        "--network-gbps" if request.network_gbps else NETWORK_UNKNOWN,
    )
