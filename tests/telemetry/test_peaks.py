import pytest
import torch

from hf_pretrain.chips import CHIPS, spec_tflops
from hf_pretrain.telemetry.peaks import measure_matmul_tflops


@pytest.mark.parametrize(
    "name, precision, peak",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
        ("NVIDIA H100 PCIe", "bf16", 756.5),
        ("NVIDIA H100 NVL", "fp8", 1671.0),
        ("NVIDIA H200", "bf16", 989.4),
        ("NVIDIA H800", "bf16", 989.4),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
        ("NVIDIA A800 80GB PCIe", "bf16", 312.0),
        ("NVIDIA L40S", "fp8", 733.0),
        ("NVIDIA L4", "bf16", 121.0),
        ("NVIDIA B200", "fp4", 9000.0),
        ("NVIDIA GB200", "bf16", 2500.0),
        ("NVIDIA GB10", "bf16", 125.0),
        ("NVIDIA GeForce RTX 4090", "bf16", 165.2),
        ("NVIDIA GeForce RTX 5090", "bf16", 209.5),
        ("AMD Instinct MI300X", "bf16", 1307.4),
    ],
)
def test_spec_table_matches_device_names(name, precision, peak):
    assert spec_tflops(name, precision) == peak


def test_unknown_chip_or_precision_is_unavailable_not_zero():
    assert spec_tflops("Some Future Accelerator", "bf16") is None
    assert spec_tflops("NVIDIA A100-SXM4-80GB", "fp8") is None  # A100 has no FP8 tensor cores
    assert spec_tflops("x86_64", "fp32") is None
    assert all(v > 0 for chip in CHIPS for v in chip.tflops.values())


def test_field_notes_run_mfu_arithmetic():
    # ~15e18 FLOPs in 6 days 21 hours on one GB10: ~25 TFLOP/s sustained,
    # ~20 % of the 125 TFLOP/s spec and ~25 % of the 98.6 TFLOP/s measured ceiling.
    sustained = 15e18 / ((6 * 24 + 21) * 3600) / 1e12
    assert sustained == pytest.approx(25.25, abs=0.05)
    assert sustained / spec_tflops("NVIDIA GB10", "bf16") == pytest.approx(0.20, abs=0.005)
    assert sustained / 98.6 == pytest.approx(0.256, abs=0.005)


def test_measured_ceiling_is_positive_and_sized():
    ceiling = measure_matmul_tflops("cpu", torch.float32, size=256, seconds=0.05)
    assert ceiling.tflops > 0 and ceiling.size == 256 and ceiling.dtype == "float32"


def test_the_ceiling_is_measured_once_per_device_and_dtype(monkeypatch):
    from hf_pretrain.telemetry import peaks

    calls = []
    monkeypatch.setattr(peaks, "_CEILINGS", {})
    monkeypatch.setattr(
        peaks,
        "measure_matmul_tflops",
        lambda device, dtype, scaling=None: calls.append(dtype) or peaks.MeasuredCeiling(1.5, 8, "x", 0.1),
    )
    assert [peaks.matmul_ceiling("cpu", torch.float32) for _ in range(3)] == [1.5] * 3
    peaks.matmul_ceiling("cpu", torch.bfloat16)
    assert calls == [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_the_fp8_ceiling_accumulates_as_the_recipes_forward_gemm(monkeypatch, scaling):
    """The fp8 ceiling is timed with the forward accumulation of the config the recipe converts with
    (`Float8LinearConfig.from_recipe_name(scaling)`, as precision/convert.py), not `_scaled_mm`'s default (exact,
    slower on Hopper) nor a default config's."""
    float8 = pytest.importorskip("torchao.float8")
    from types import SimpleNamespace

    from hf_pretrain.telemetry import peaks

    assert float8.Float8LinearConfig.from_recipe_name(scaling).gemm_config_output.use_fast_accum is True
    calls, names = [], []

    def scaled_mm(a, b, **kwargs):
        calls.append(kwargs)
        return torch.zeros(a.shape[0], b.shape[1], dtype=torch.bfloat16)

    def from_recipe_name(name):  # a recipe that accumulates exactly: the ceiling must follow it
        names.append(name)
        return SimpleNamespace(gemm_config_output=SimpleNamespace(use_fast_accum=False))

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    monkeypatch.setattr(float8.Float8LinearConfig, "from_recipe_name", from_recipe_name)
    peaks.measure_matmul_tflops("cpu", torch.float8_e4m3fn, size=16, seconds=0.0, scaling=scaling)
    assert names == [scaling] and calls and all(c.get("use_fast_accum") is False for c in calls)


def test_the_run_times_its_fp8_ceiling_with_its_own_recipe(monkeypatch):
    """The throughput callback hands the run's torchao recipe (`precision_scaling`, tensorwise by default) to the
    ceiling; Transformer Engine's fp8 and the non-fp8 runs hand none."""
    from types import SimpleNamespace

    from transformers import TrainerControl, TrainerState

    from hf_pretrain import PretrainForCausalLM
    from hf_pretrain.telemetry import throughput
    from tests.conftest import small_config

    measured = []
    monkeypatch.setattr(throughput, "ceiling_dtype", lambda precision, device: torch.float8_e4m3fn)
    monkeypatch.setattr(throughput, "matmul_ceiling", lambda device, dtype, *scaling: measured.append(scaling) or 1.0)
    model = PretrainForCausalLM(small_config())
    for precision, scaling in (("fp8", "rowwise"), ("fp8", None), ("te-fp8", "current"), ("bf16", None)):
        run = dict(precision=precision, precision_scaling=scaling)
        args = SimpleNamespace(device=torch.device("cpu"), world_size=1, bf16=False, fp16=False, **run)
        callback = throughput.ThroughputCallback(seq_len=32, measure_ceiling=True)
        callback.on_train_begin(args, TrainerState(), TrainerControl(), model=model)
    assert measured == [("rowwise",), ("tensorwise",), (), ()]


def test_the_ceiling_follows_the_dtype_the_gemms_run_in(monkeypatch):
    """A model cast to bf16 and trained without `bf16=True` runs bf16 GEMMs: its ceiling is a bf16 one (an fp32
    ceiling with TF32 off would put mfu_measured ~10x too high on a GPU)."""
    from types import SimpleNamespace

    from transformers import TrainerControl, TrainerState

    from hf_pretrain import PretrainForCausalLM
    from hf_pretrain.telemetry import throughput
    from tests.conftest import small_config

    measured = []
    monkeypatch.setattr(throughput, "matmul_ceiling", lambda device, dtype: measured.append(dtype) or 1.0)
    args = SimpleNamespace(device=torch.device("cpu"), world_size=1, bf16=False, fp16=False, precision=None)
    model = PretrainForCausalLM(small_config())
    for weights, precision in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        callback = throughput.ThroughputCallback(seq_len=32, measure_ceiling=True)
        callback.on_train_begin(args, TrainerState(), TrainerControl(), model=model.to(weights))
        assert measured[-1] == weights and throughput.precision_of(args, model) == precision
    # autocast and the recipe still decide first: bf16 autocast over fp32 weights, fp8 linears
    assert throughput.precision_of(SimpleNamespace(precision=None, bf16=True, fp16=False), model) == "bf16"
    assert throughput.precision_of(SimpleNamespace(precision="fp8", bf16=False, fp16=False), model) == "fp8"
