"""Tensor and context parallelism on CPU processes are refused in one line, before any work (docs/distributed.md):
accelerate refuses a ParallelismConfig under DistributedType.MULTI_CPU, and torch's context parallel has no CPU
SDPA sharding rule. DeepSpeed Ulysses sequence parallelism is left to accelerate (it runs on gloo)."""

import pytest
from accelerate import ParallelismConfig

from tests.conftest import quick_args


@pytest.mark.parametrize("field", ["tp_size", "cp_size"])
def test_tensor_and_context_parallelism_are_refused_on_a_cpu(tmp_path, field):
    with pytest.raises(ValueError, match=rf"^parallelism_config\.{field}=2 needs GPUs: .*; set {field}=1 on a CPU"):
        quick_args(tmp_path, use_cpu=True, parallelism_config=ParallelismConfig(**{field: 2}))


def test_the_launch_config_parallelism_is_refused_too(tmp_path, monkeypatch):
    """`accelerate launch` with parallelism_config_tp_size in its config: accelerate builds it from the environment."""
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "2")
    with pytest.raises(ValueError, match=r"^parallelism_config\.tp_size=2 needs GPUs"):
        quick_args(tmp_path, use_cpu=True)


def test_sequence_parallelism_and_a_trivial_config_pass(tmp_path):
    for config in (ParallelismConfig(sp_size=2), ParallelismConfig(tp_size=1, cp_size=1)):
        assert quick_args(tmp_path, use_cpu=True, parallelism_config=config).parallelism_config is config
