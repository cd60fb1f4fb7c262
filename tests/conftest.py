import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# One intra-op thread in the tests and every process they start: the models are tiny, and two ranks of two
# spinning OpenMP threads each on a 2-core machine run 10x slower than one thread each.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

from hf_pretrain import PretrainConfig  # noqa: E402
from hf_pretrain.rehearse.launch import build_deepspeed_ops, environment  # noqa: E402

# DeepSpeed's JIT-built CPU comm op, cached per Python environment (see rehearse/launch.py): every process the tests
# start inherits the cache, so a fresh environment builds the op once, not inside a test's time limit.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", environment()["TORCH_EXTENSIONS_DIR"])


@pytest.fixture(scope="session")
def deepspeed_ops():
    build_deepspeed_ops()


@pytest.fixture(autouse=True)
def _deepspeed_ops_before_multiprocess_tests(request):
    if request.node.get_closest_marker("distributed"):
        request.getfixturevalue("deepspeed_ops")


def small_config(**overrides) -> PretrainConfig:
    shape = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return PretrainConfig(**{**shape, **overrides})


def quick_args(output_dir, **overrides):
    """PretrainingArguments for a short test run: no reporting, no checkpoints, no progress bar, a log per step."""
    from hf_pretrain import PretrainingArguments

    defaults = dict(report_to="none", save_strategy="no", disable_tqdm=True, logging_steps=1)
    return PretrainingArguments(output_dir=str(output_dir), **{**defaults, **overrides})


def training_logs(output_dir) -> list[dict]:
    """The training logs of a run as the user sees them (telemetry.jsonl): with the measured values that
    PretrainTrainer keeps out of state.log_history."""
    from hf_pretrain.telemetry.jsonl import read_jsonl

    return [record for record in read_jsonl(output_dir) if "loss" in record]


def pytest_collection_modifyitems(config, items):
    """Tests marked `early` run first: measurements of a child process's memory read 10-35 % high, for reasons not
    yet found, once the session has run the data tests (children started from a fresh process read right)."""
    items.sort(key=lambda item: item.get_closest_marker("early") is None)  # stable: the rest keep their order
