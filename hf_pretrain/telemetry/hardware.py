"""`HardwareSensorsCallback`: GPU clocks, power, temperature, memory and utilization, or CPU readings.

Logs at every logging step the latest reading of `telemetry/sensors.py` (the keys are listed
there), plus `torch_peak_memory_gib` (the framework's own peak allocation on a CUDA device). The
sensor is read every `every` optimizer steps, outside the step (never inside a kernel's timing).
A sensor the device does not expose is reported once as a warning naming the field and NVML's
reason (and once in the logs as `sensors_unavailable`), then left out of the logs; it is never
logged as 0. GPU "utilization" only counts time
with a kernel running, so `gpu_power_of_limit` (draw / limit) sits beside it: 96 % utilization at
60 % of the power limit is a chip waiting on something.
"""

from __future__ import annotations

import torch
from transformers.utils import logging

from ..callback import PretrainCallback
from .sensors import CpuSensors, open_sensors

logger = logging.get_logger(__name__)


class HardwareSensorsCallback(PretrainCallback):
    keep_in_history = False  # read off clocks and sensors: differs between identical runs
    arguments = {"telemetry": True}  # the switch of all telemetry: sensors, under-clock, straggler, JSONL

    @classmethod
    def from_arguments(cls, trainer, built=()) -> HardwareSensorsCallback | None:
        args = trainer.args
        if not cls.settings(args)["telemetry"]:
            return None
        return cls(every=args.logging_steps if args.logging_strategy == "steps" else 10)

    def __init__(self, every: int = 10, sensors: CpuSensors | None = None):
        self.every = max(1, every)
        self.sensors = sensors
        self.latest: dict[str, float | str] = {}
        self._reported: set[str] = set()
        self._newly_unavailable: dict[str, str] = {}

    def on_train_begin(self, args, state, control, **kwargs):
        if self.sensors is None:
            self.sensors = open_sensors(args.device)
        self.device = args.device
        self.read()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every == 0:
            self.read()

    def read(self) -> dict[str, float | str]:
        self.latest = self.sensors.read()
        if torch.device(self.device).type == "cuda":
            self.latest["torch_peak_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        for field, reason in self.sensors.unavailable.items():
            if field not in self._reported:
                self._reported.add(field)
                self._newly_unavailable[field] = reason
                logger.warning(
                    f"sensor {field}: unavailable ({reason}); it is left out of the logs, not reported as 0."
                )
        return self.latest

    def metrics_for_log(self, state) -> dict[str, float | str]:
        metrics = dict(self.latest)
        if self._newly_unavailable:  # once, so the JSONL stream and the report say what was never measured
            metrics["sensors_unavailable"] = "; ".join(f"{k}: {v}" for k, v in self._newly_unavailable.items())
            self._newly_unavailable = {}
        return metrics
