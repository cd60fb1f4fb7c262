"""The memory preflight refuses, before the first step, a run larger than the memory left for it (a real limit)."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hf_pretrain.distributed.memory import GiB, estimate_memory
from hf_pretrain.modeling.attention import Environment, plan_attention
from hf_pretrain.preflight.memory import (
    MemoryCheck,
    MemoryPreflightError,
    RunShape,
    enforce_memory_policy,
    kernel_memory,
)
from tests.conftest import small_config

ROOT = Path(__file__).resolve().parents[2]

# A real PretrainTrainer whose run needs more memory than its address space has left (ulimit -v, set here): without
# the preflight the first step fails to allocate (or, without the limit, the kernel kills it for memory).
SCRIPT = textwrap.dedent(
    """
    import resource, sys
    import psutil, torch
    from datasets import Dataset
    from hf_pretrain import PretrainForCausalLM, PretrainTrainer
    from hf_pretrain.data import PackedDocumentCollator
    from hf_pretrain.preflight.memory import MemoryPreflightError
    from tests.conftest import quick_args, small_config

    seq = 2048
    rows = [{"input_ids": [(i * 7 + j) % 120 + 1 for j in range(seq)]} for i in range(32)]
    model = PretrainForCausalLM(small_config(max_position_embeddings=seq))
    args = quick_args(sys.argv[1], max_steps=2, per_device_train_batch_size=32, measure_peak_tflops=False)
    trainer = PretrainTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows),
                              data_collator=PackedDocumentCollator(eos_token_id=0))
    room = int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_AS, (psutil.Process().memory_info().vms + room, resource.RLIM_INFINITY))
    try:
        trainer.train()
    except MemoryPreflightError as error:
        print(error, "| steps:", trainer.state.global_step)
        sys.exit(3)
    """
)


def test_a_run_larger_than_the_memory_left_is_refused_before_the_first_step(tmp_path):
    config = small_config(max_position_embeddings=2048)
    plan = plan_attention(config, Environment.detect("cpu", torch.float32, training=True), packed=True)
    need = RunShape("fp32", 2048, 32, **kernel_memory(config, plan)).estimate(config).total
    room = need // 2  # half of what the run needs
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "run"), str(room)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    out = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 3, out + result.stderr[-3000:]
    assert out.startswith("memory preflight: sequences of 2048 tokens x micro-batch 32 (fp32) need about ")
    assert "the address-space limit (ulimit -v)" in out and "it would be killed for want of memory" in out
    assert "Fix: --per_device_train_batch_size " in out and out.endswith("| steps: 0")


def test_dense_masks_of_sdpa_layers_are_priced_and_flash_kernels_have_none():
    config = small_config(max_position_embeddings=4096)
    packed = plan_attention(config, Environment.detect("cpu", torch.float32, training=True), packed=True)
    plain = plan_attention(config, Environment.detect("cpu", torch.float32, training=True), packed=False)
    assert kernel_memory(config, packed) == {"flash_attention": True, "dense_mask_layers": 4}
    assert kernel_memory(config, plain) == {"flash_attention": True, "dense_mask_layers": 0}
    masked = estimate_memory(config, 0, 1, "fp32", 4096, 2, dense_mask_layers=4)
    assert masked.attention_mask == 2 * 4096**2 * (1 + 4 * 4)
    assert masked.total - estimate_memory(config, 0, 1, "fp32", 4096, 2).total == masked.attention_mask


def check(need_gib: float, free_gib: float, micro: int = 8) -> MemoryCheck:
    config = small_config()
    shape = RunShape("fp32", 256, micro)
    return MemoryCheck(config, shape, int(need_gib * GiB), int(free_gib * GiB), "available host memory")


def test_policies_refuse_warn_or_ignore_a_run_that_does_not_fit():
    warned = []
    with pytest.raises(MemoryPreflightError, match=r"need about 2\.0 GiB per process .* 1\.0 GiB free"):
        enforce_memory_policy(check(2, 1), "error", warned.append)
    enforce_memory_policy(check(2, 1), "warn", warned.append)
    enforce_memory_policy(check(2, 1), "ignore", warned.append)
    enforce_memory_policy(check(0.9, 1), "error", warned.append)  # tight: a warning, not a refusal
    enforce_memory_policy(check(0.5, 1), "error", warned.append)  # roomy: nothing
    assert len(warned) == 2 and "would be killed" in warned[0] and "little room" in warned[1]
    with pytest.raises(ValueError, match="memory_preflight='maybe' is invalid"):
        enforce_memory_policy(check(2, 1), "maybe", warned.append)


def test_the_fixes_named_fit_what_is_free():
    config = small_config(max_position_embeddings=4096)
    shape = RunShape("fp32", 4096, 16, dense_mask_layers=4)
    need = shape.estimate(config).total
    fixes = MemoryCheck(config, shape, need, need // 3, "host").fixes()
    micro = int(fixes[0].split()[1])
    assert fixes[0].startswith("--per_device_train_batch_size ") and 1 <= micro < 16
    from dataclasses import replace

    assert replace(shape, micro_batch=micro).estimate(config).total <= need // 3
    assert any(f.startswith("sequences of ") for f in fixes)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_device_free_memory_is_the_limit_and_an_oversized_run_is_refused(tmp_path):
    from datasets import Dataset

    from hf_pretrain import PretrainForCausalLM, PretrainTrainer
    from hf_pretrain.data import PackedDocumentCollator
    from hf_pretrain.preflight.memory import free_memory
    from tests.conftest import quick_args

    free, where = free_memory("cuda")
    assert free == torch.cuda.mem_get_info()[0] and torch.cuda.get_device_name() in where
    seq = 32768  # 64 rows of 32K tokens a micro-batch through 8 layers of width 2048: ~2 TB, beyond any one GPU
    rows = [{"input_ids": [(i + j) % 120 + 1 for j in range(seq)]} for i in range(64)]
    wide = dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=16, num_key_value_heads=16)
    model = PretrainForCausalLM(small_config(max_position_embeddings=seq, num_hidden_layers=8, **wide)).cuda()
    args = quick_args(tmp_path, max_steps=1, per_device_train_batch_size=64, bf16=True, measure_peak_tflops=False)
    trainer = PretrainTrainer(
        model=model, args=args, train_dataset=Dataset.from_list(rows), data_collator=PackedDocumentCollator(0)
    )
    with pytest.raises(MemoryPreflightError, match=r"need about .* GiB per process .* GiB free \(free on "):
        trainer.train()
    assert trainer.state.global_step == 0
