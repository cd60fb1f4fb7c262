"""Every tensor alive in a process, in bytes: the measure the memory estimator is checked against on a CPU (which
has no `max_memory_allocated`): tests/distributed/test_memory.py and benchmarks/sequence_parallel.py.

`live_bytes()`: found through `gc` (gradients included), deduplicated by storage. A DTensor (FSDP2's sharded
parameters and gradients) is a wrapper whose own storage stands in for the full tensor: its local shard is
counted. A walk of every Python object: milliseconds to a second, never on a training path.
"""

from __future__ import annotations

import gc

import torch


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return getattr(tensor, "_local_tensor", tensor)


def live_bytes(exclude: set[int] = frozenset()) -> int:
    """`exclude`: storages (`data_ptr()`) left out, e.g. the parameters'."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        try:
            tensors = [obj] if torch.is_tensor(obj) else []
        except Exception:  # objects that fail isinstance checks (lazy modules of other libraries)
            continue
        for tensor in tensors + [t.grad for t in tensors if t.is_leaf and t.grad is not None]:
            storage = _local(tensor).untyped_storage()
            if storage.data_ptr() not in exclude:
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())
