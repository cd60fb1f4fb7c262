"""Every tensor alive in a process, in bytes: the measure the memory estimator is checked against.

`live_bytes()`: found through `gc` (gradients included), deduplicated by storage. A DTensor (FSDP2's sharded
parameters and gradients) is a wrapper whose own storage stands in for the full tensor: its local shard is
counted. `run_inventory(script, *args)`: an inventory script (ds_inventory.py, fsdp2_inventory.py) under
torchrun on 2 CPU ranks; the JSON line rank 0 prints.
"""

import gc
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return getattr(tensor, "_local_tensor", tensor)


def live_bytes() -> int:
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        try:
            tensors = [obj] if torch.is_tensor(obj) else []
        except Exception:  # objects that fail isinstance checks (lazy modules of other libraries)
            continue
        for tensor in tensors + [t.grad for t in tensors if t.is_leaf and t.grad is not None]:
            storage = _local(tensor).untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def run_inventory(script: str, *args: str) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}"]
    cmd += [str(Path(__file__).with_name(script)), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
