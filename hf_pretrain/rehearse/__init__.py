"""`hf-pretrain rehearse`: the user's multi-node launch, dress-rehearsed on this CPU before renting GPUs.

An application on the top floor, like `plan/`: nothing in the package imports it back.
- `launch.py`: the user's `accelerate launch` command parsed, its accelerate config made to run as
  two gloo processes (two "nodes" over loopback when it names several machines), the runs bounded;
- `shrink.py`: the model at rehearsal size (same layer pattern, windows, GQA, MoE, vocabulary) and the
  overriding script arguments;
- `probe.py`: the launch target that runs the user's script with a watcher in every rank (samples,
  losses, the planted SIGKILL);
- `checks.py`: the checklist; `run.py`: the three runs; `report.py`: the screen and rehearsal.md;
- `cli.py`: `hf-pretrain rehearse` flags.
"""

from .run import Rehearsal, RehearsalRequest, rehearse

__all__ = ["Rehearsal", "RehearsalRequest", "rehearse"]
