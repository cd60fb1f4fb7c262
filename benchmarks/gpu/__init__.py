"""The checks of benchmarks/gpu_check.py, one module each (`GOAL`, `run(ctx) -> row`), and what they share
(`common.py`, the injected faults in `faults.py`)."""
