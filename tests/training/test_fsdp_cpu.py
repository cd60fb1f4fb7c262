"""`fsdp_on_cpu`: what it does to accelerate's process-wide state (the real 2-process runs: tests/distributed/test_fsdp2.py)."""

from types import SimpleNamespace

import pytest
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType

from hf_pretrain.training.fsdp import fsdp_on_cpu, fsdp_version


@pytest.fixture
def cpu_group(monkeypatch):
    state = {"distributed_type": DistributedType.MULTI_CPU}
    monkeypatch.setattr(PartialState, "_shared_state", state)
    monkeypatch.setattr(AcceleratorState, "_shared_state", {})
    return state


def test_fsdp2_on_a_cpu_group_reads_as_a_gpu_group_while_the_accelerator_is_built(cpu_group, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    with fsdp_on_cpu(SimpleNamespace(fsdp=None)):
        assert cpu_group["distributed_type"] == DistributedType.MULTI_GPU
        AcceleratorState._shared_state["distributed_type"] = DistributedType.FSDP  # what accelerate then decides
    assert cpu_group["distributed_type"] == DistributedType.FSDP  # later AcceleratorState() copies keep FSDP


def test_nothing_changes_without_fsdp_or_when_accelerate_did_not_apply_it(cpu_group, monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    with fsdp_on_cpu(SimpleNamespace(fsdp=None)):
        assert cpu_group["distributed_type"] == DistributedType.MULTI_CPU
    with fsdp_on_cpu(SimpleNamespace(fsdp=True, fsdp_config={"version": 2})):
        assert cpu_group["distributed_type"] == DistributedType.MULTI_GPU
    assert cpu_group["distributed_type"] == DistributedType.MULTI_CPU  # accelerate did not pick FSDP: put back


def test_fsdp1_on_cpu_ranks_is_refused_naming_the_setting(cpu_group, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(ValueError, match="fsdp_version=1 on CPU processes.*fsdp_version: 2"):
        fsdp_on_cpu(SimpleNamespace(fsdp=None)).__enter__()
    assert fsdp_version(SimpleNamespace(fsdp=True, fsdp_config={})) == 2  # transformers' default
