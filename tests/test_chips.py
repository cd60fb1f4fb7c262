"""The one chip table: every reader (telemetry, the memory estimator, the planner) resolves a chip through it."""

import pytest
import torch

from hf_pretrain.chips import CHIPS, device_memory_bytes, find_chip, known_chips, link_gbps, match, spec_tflops
from hf_pretrain.distributed.memory import estimate_memory
from hf_pretrain.plan import PlanRequest
from hf_pretrain.plan.hardware import MFU_ASSUMPTIONS, resolve_hardware
from hf_pretrain.precision.recipes import RECIPES
from hf_pretrain.presets import get_preset

MiB = 1024**2


def test_every_chip_resolves_to_itself_no_key_shadows_a_later_one():
    # "most specific first": an "h100" row above "h100 pcie" would swallow the PCIe card
    assert len({chip.key for chip in CHIPS}) == len(CHIPS)
    for chip in CHIPS:
        assert find_chip(chip.key) is chip
        assert find_chip(f"NVIDIA {chip.key.upper()}") is chip


@pytest.mark.parametrize("key", sorted(MFU_ASSUMPTIONS))
def test_every_device_the_planner_knows_resolves_through_the_one_table(key):
    chip = find_chip(key)
    assert chip is not None and chip.tflops.get("bf16"), f"{key}: in plan/hardware.py but not in chips.py"
    hw = resolve_hardware(PlanRequest(key, hours=1, device_memory_gb=None if chip.memory_mib else 80))
    assert hw.peak_tflops == spec_tflops(key, "bf16") == chip.tflops["bf16"]
    if chip.memory_mib:
        assert hw.memory_bytes == device_memory_bytes(key) == chip.memory_bytes(key)


@pytest.mark.parametrize("name", ["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB", "NVIDIA L4", "gb10"])
def test_the_estimator_the_planner_and_telemetry_read_the_same_row(name):
    chip = find_chip(name)
    estimate = estimate_memory(get_preset("tiny"), 0, 1, device=name)
    assert estimate.device_bytes == chip.memory_bytes(name) == device_memory_bytes(name)
    assert resolve_hardware(PlanRequest(name, hours=1, mfu=0.3)).memory_bytes == estimate.device_bytes


def test_one_matching_rule_for_peaks_and_memory():
    # hyphens read as spaces for both facts (peaks used to match the raw name and found the SXM H100 here)
    assert spec_tflops("NVIDIA H100-PCIe", "bf16") == 756.5 == spec_tflops("NVIDIA H100 PCIe", "bf16")
    assert device_memory_bytes("NVIDIA A100-SXM4-40GB") == 40 * 1024 * MiB
    assert device_memory_bytes("a100") == 80 * 1024 * MiB  # the first size is the default
    assert find_chip("NVIDIA L4").key == "l4" and find_chip("NVIDIA L40S").key == "l40s"
    assert match("NVIDIA H100 NVL", {"h100": 1}) == 1 and match("TPU v5", {"h100": 1}) is None
    assert find_chip("TPU v5") is None and device_memory_bytes("TPU v5") is None
    assert device_memory_bytes("NVIDIA H800") is None  # a chip with a peak but no memory figure: unknown, not 0


def test_links_are_each_way_per_gpu_and_unavailable_is_not_zero():
    """The spec sheets' NVLink figures are both directions added (H100 SXM 900 GB/s): the table holds each way."""
    assert link_gbps("NVIDIA H100 80GB HBM3") == 450.0 == link_gbps("NVIDIA H200")
    assert link_gbps("NVIDIA A100-SXM4-80GB") == 300.0 and link_gbps("NVIDIA A100-PCIE-40GB") == 32.0
    assert link_gbps("NVIDIA H100 PCIe") == 64.0 and link_gbps("NVIDIA B200") == 900.0
    assert device_memory_bytes("NVIDIA A100-PCIE-40GB") == device_memory_bytes("NVIDIA A100-SXM4-40GB")
    for name in ("gb10", "mi300x", "TPU v5"):  # unified memory, a per-peer mesh, an unknown chip
        assert link_gbps(name) is None
    assert all(chip.link_gbps is None or chip.link_gbps > 0 for chip in CHIPS)
    assert "h100" in known_chips("link") and "gb10" not in known_chips("link")


def test_every_recipe_column_is_a_chip_column():
    columns = {column for chip in CHIPS for column in chip.tflops}
    assert {r.spec_key for r in RECIPES.values() if r.spec_key != "fp32"} <= columns
    assert set(known_chips("memory")) < set(known_chips("peak")) == set(known_chips())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_this_gpu_resolves_and_its_memory_figure_is_what_torch_sees():
    name = torch.cuda.get_device_name()
    chip = find_chip(name)
    if chip is None:
        pytest.skip(f"{name!r} is not in chips.py: add its row (peaks and memory)")
    assert chip.tflops.get("bf16"), name
    total = torch.cuda.get_device_properties(0).total_memory
    if chip.memory_mib:  # nvidia-smi's total is within 2 % of torch's (the driver reserves a little)
        assert abs(device_memory_bytes(name) / total - 1) < 0.02, (name, device_memory_bytes(name), total)
