"""Every tensor alive in a process, in bytes: the measure the memory estimator is checked against.

The count itself, `live_bytes()`: hf_pretrain/distributed/live_tensors.py (benchmarks/sequence_parallel.py uses it too).
`run_inventory(script, *args)`: an inventory script (ds_inventory.py, fsdp2_inventory.py) under
torchrun on 2 CPU ranks; the JSON line rank 0 prints.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


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
