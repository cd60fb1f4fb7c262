"""The warning for DataLoader workers a rank of a multi-process run starts unsafely (hf_pretrain/training/processes.py):
`fork` can hang right after the fork, `forkserver` outlives a killed rank; `spawn` is the fix it names."""

import multiprocessing
from types import SimpleNamespace

import pytest

from hf_pretrain.training import processes
from hf_pretrain.training.processes import workers_start_warning


def workers(world_size=2, num_workers=1, context=None):
    return SimpleNamespace(
        world_size=world_size, dataloader_num_workers=num_workers, dataloader_multiprocessing_context=context
    )


@pytest.mark.parametrize(
    "args, risk",
    [
        (workers(context="fork"), "can hang right after the fork"),
        (workers(context="forkserver"), "a rank that dies leaves them and the server running"),
        (workers(context="spawn"), None),  # a fresh interpreter, a child of the rank
        (workers(world_size=1, context="fork"), None),  # one process: no gloo/NCCL threads
        (workers(num_workers=0, context="fork"), None),  # loaded in the rank itself
    ],
)
def test_risky_workers_of_a_rank_are_warned_of_with_the_fix(args, risk):
    warning = workers_start_warning(args)
    assert (warning is None) == (risk is None)
    if risk:
        assert risk in warning and "dataloader_multiprocessing_context='spawn'" in warning


@pytest.mark.parametrize(
    "set_globally, default, risk",
    [
        (None, "fork", "can hang"),  # Linux before Python 3.14
        (None, "forkserver", "leaves them and the server running"),  # Linux from Python 3.14
        (None, "spawn", None),  # macOS, Windows
        ("spawn", "fork", None),  # multiprocessing.set_start_method("spawn") by the script
    ],
)
def test_left_unset_the_start_method_is_the_interpreters(monkeypatch, set_globally, default, risk):
    monkeypatch.setattr(processes.multiprocessing, "get_start_method", lambda allow_none=False: set_globally)
    monkeypatch.setattr(processes.multiprocessing, "get_all_start_methods", lambda: [default, "spawn"])
    warning = workers_start_warning(workers(context=None))
    assert (warning is None) == (risk is None)
    if risk:
        assert risk in warning


def test_reading_the_interpreters_start_method_leaves_it_as_it_was():
    before = multiprocessing.get_start_method(allow_none=True)  # None until a process of the session starts one
    workers_start_warning(workers(context=None))
    assert multiprocessing.get_start_method(allow_none=True) == before  # not fixed by reading it


@pytest.mark.parametrize("context, rank, warned", [("fork", 0, 1), ("spawn", 0, 0), ("fork", 1, 0)])
def test_the_trainers_of_a_run_warn_once_on_rank_0(tmp_path, monkeypatch, caplog, context, rank, warned):
    from transformers.utils import logging as hf_logging

    from hf_pretrain import PretrainForCausalLM, PretrainingArguments, PretrainTrainer
    from hf_pretrain.training import trainer
    from tests.conftest import small_config

    # The arguments of a rank of two, without the processes (the launched-world check would see one)
    monkeypatch.setattr(PretrainingArguments, "world_size", property(lambda self: 2))
    monkeypatch.setattr(PretrainingArguments, "process_index", property(lambda self: rank))
    monkeypatch.setattr(trainer, "check_launched_world_size", lambda world_size: None)
    args = PretrainingArguments(
        output_dir=str(tmp_path),
        report_to="none",
        use_cpu=True,
        dataloader_num_workers=1,
        dataloader_multiprocessing_context=context,
    )
    hf_logging.enable_propagation()
    try:
        PretrainTrainer(model=PretrainForCausalLM(small_config()), args=args)
    finally:
        hf_logging.disable_propagation()
    assert sum("dataloader_num_workers=1 started" in r.getMessage() for r in caplog.records) == warned
