"""Launched by test_multiprocess_resume.py under `accelerate launch`: a run whose epoch does not divide evenly.

Usage: python tests/distributed/resume_run.py OUTPUT_DIR PER_DEVICE_BATCH
       [straight | kill:STEP | resume | write-fail:STEP | restart-kill-in-write:STEP | restart-stop:STEP
        | restart-loop-kill:STEP]
       [DEEPSPEED_JSON]
44 rows at a global micro-batch of 12: every epoch ends with a short batch that accelerate (even_batches)
completes with the epoch's first samples. Checkpoints every 3 steps, 15 steps, one dataloader worker,
spawned once per run (forked by a rank it can hang: hf_pretrain/training/processes.py).
`kill:STEP` SIGKILLs rank 1 at the end of STEP (a lost node), once the checkpoints due are in place; `resume`
continues from the newest checkpoint; `write-fail:STEP` makes rank 1's background write of checkpoint-STEP fail
(an I/O error). The `restart-` modes are launched with restarts allowed and resume with
"auto"; their fault happens in the first attempt only: `restart-kill-in-write:STEP` holds rank 1's background
write of checkpoint-STEP open and SIGKILLs rank 1 at the end of the next step (the write still open);
`restart-stop:STEP` SIGSTOPs rank 1 at the end of STEP (a hung rank: the watchdog must catch it).
`restart-loop-kill:STEP` SIGKILLs rank 1 at the end of STEP in every attempt (a fault no restart mends), with the
restart-loop guard at 2 attempts.
The `restart-` modes log telemetry (goodput across the attempts). Writes OUTPUT_DIR/losses-<run>-rank<r>.json with the loss of every step (run: straight, killed, resumed,
restarted<attempt>) and OUTPUT_DIR/fault.json with the rank, step and kind of the fault.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import TrainerCallback

from hf_pretrain import PretrainForCausalLM, get_preset
from hf_pretrain.training.recovery.attempts import restart_count
from tests.conftest import quick_args
from tests.training.faults import WriteFault, WriteFaultTrainer

ROWS, SEQ, STEPS, SAVE_STEPS = 44, 32, 15, 3


class Record(TrainerCallback):
    def __init__(self, path: Path, fault: tuple[str, int] | None = None, marker: Path | None = None):
        self.path, self.fault, self.marker, self.losses = path, fault, marker, {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses[state.global_step] = logs["loss"]
            self.path.write_text(json.dumps(self.losses))

    def on_step_end(self, args, state, control, **kwargs):
        if self.fault is None or args.process_index != 1 or state.global_step != self.fault[1]:
            return
        kind = self.fault[0]
        # kill, stop: once the checkpoints due are in place (saves are asynchronous); kill-in-write: while the write
        # of the save before this step is held open
        due_step = (state.global_step - 1) // SAVE_STEPS * SAVE_STEPS
        due = Path(args.output_dir) / f"checkpoint-{due_step}" if due_step else None
        ready = {"kill": due, "stop": due, "kill-in-write": self.marker}.get(kind)
        deadline = time.monotonic() + 120
        while ready is not None and not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        fault = {
            "rank": 1,
            "step": state.global_step,
            "kind": kind,
            "write_open": bool(self.marker and self.marker.exists()),
        }
        (self.path.parent / "fault.json").write_text(json.dumps(fault))
        os.kill(os.getpid(), signal.SIGSTOP if kind == "stop" else signal.SIGKILL)


def main(output_dir: str, per_device: int, mode: str = "", deepspeed: str | None = None) -> None:
    torch.manual_seed(0)
    data = torch.randint(3, 500, (ROWS, SEQ), generator=torch.Generator().manual_seed(1))
    kind, _, step = mode.partition(":")
    restarted = kind.startswith("restart-")
    args = quick_args(
        output_dir,
        max_steps=STEPS,
        per_device_train_batch_size=per_device,
        learning_rate=3e-3,
        measure_peak_tflops=False,
        telemetry=restarted,  # goodput across the restarts
        seed=0,
        save_strategy="steps",
        save_steps=SAVE_STEPS,
        dataloader_num_workers=1,
        dataloader_multiprocessing_context="spawn",
        dataloader_persistent_workers=True,
        deepspeed=deepspeed,
    )
    model = PretrainForCausalLM(get_preset("tiny", vocab_size=512, num_hidden_layers=2))
    run = "resumed" if mode == "resume" else "killed" if kind == "kill" else "straight"  # "" or "straight"
    run = f"restarted{restart_count()}" if restarted else run
    fault, write_fault, marker = None, None, Path(output_dir) / "write-open"
    if kind == "kill":
        fault = ("kill", int(step))
    elif kind == "write-fail":
        write_fault = (int(step), 1, WriteFault("fail"))
    elif kind == "restart-loop-kill":  # every attempt
        fault = ("kill", int(step))
        args.restart_same_failure_limit = 2
    elif restarted and restart_count() == 0:  # the first attempt only
        kind = kind.removeprefix("restart-")
        fault = (kind, int(step) + (kind == "kill-in-write"))
        if kind == "kill-in-write":
            write_fault = (int(step), 1, WriteFault("block", marker=str(marker)))
    if restarted:  # a hang is noticed within seconds here (the defaults: minutes)
        args.hang_timeout_min_s, args.hang_timeout_floor_s = 10.0, 120.0
    record = Record(Path(output_dir) / f"losses-{run}-rank{args.process_index}.json", fault, marker)
    dataset = Dataset.from_dict({"input_ids": data.tolist(), "labels": data.tolist()})
    trainer = WriteFaultTrainer(
        model=model, args=args, train_dataset=dataset, callbacks=[record], write_fault=write_fault
    )
    trainer.train(resume_from_checkpoint="auto" if restarted else True if mode == "resume" else None)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), *sys.argv[3:])
