"""`UnderclockCallback`: an SM clock far below its maximum, under load, with no reason given.

The failure it catches: one of two machines sat at ~600 MHz (its twin at ~2190 MHz) for days, no
throttle flag set, because the USB-C power-delivery controller of its adapter was stuck; a plain
reboot did not clear it, unplugging from the wall did. The rule (`underclock_warning`, the one
function this callback and the straggler exchange both call): under load the SM clock is below
`threshold` x its maximum, and NVML sets no reason that would explain it (power cap, thermal or
hardware slowdown, application clocks, idle). "Under load" is a utilization reading >=
`min_utilization` %, or, where the device does not report utilization, NVML's reasons without
`gpu_idle`; a reading that is missing is unknown, never taken as 100 % or as idle.
The warning names the rank and host and what to check; it is logged once per episode as
`underclock_warning` (and so lands in the JSONL stream and the run report) and printed.

Logs (only when it fires; the first episode since the previous log): `underclock_warning` (text)
and `underclock_rank` (numeric, for trackers that drop text). Other ranks' under-clock reaches
rank 0's logs through the straggler exchange.
"""

from __future__ import annotations

import socket

from transformers.utils import logging

from ..callback import PretrainCallback
from .hardware import HardwareSensorsCallback
from .sensors import LIMITING_REASONS

logger = logging.get_logger(__name__)


def underclock_warning(
    reading: dict, threshold: float = 0.6, min_utilization: float = 50.0, rank: int = 0, host: str | None = None
) -> str | None:
    """The warning for one sensor reading, or None when the clock is fine, idle, explained, or cannot be judged.

    The one rule, for this rank's reading (`UnderclockCallback`) and another rank's gathered one
    (`StragglerCallback`). A key the device did not report is *unknown*, never a default:
    - no SM clock or maximum: nothing to judge;
    - clock >= `threshold` x maximum: fine;
    - a limiting throttle reason (power cap, thermal or hardware slowdown, application clocks): explained;
    - NVML's `gpu_idle` reason, or a utilization reading below `min_utilization`: idle, which explains
      a low clock;
    - utilization not reported: under load only if NVML reports its reasons and `gpu_idle` is not
      among them; with neither reported there is no verdict (None).
    """
    clock, peak = reading.get("gpu_sm_clock_mhz"), reading.get("gpu_sm_clock_max_mhz")
    if clock is None or not peak or clock >= threshold * peak:
        return None
    reasons = reading.get("gpu_throttle_reasons")  # None: NVML did not say
    names = set(str(reasons).split(",")) if reasons is not None else set()
    if names & LIMITING_REASONS or "gpu_idle" in names:
        return None
    utilization = reading.get("gpu_utilization_pct")
    if utilization is not None and utilization < min_utilization:
        return None
    if utilization is None and reasons is None:
        return None
    load = (
        f"under load ({utilization:.0f} % utilization)"
        if utilization is not None
        else "under load (utilization not reported; NVML sets no idle reason)"
    )
    power = reading.get("gpu_power_w")
    power_text = f", {power:.0f} W" if power is not None else ""
    return (
        f"rank {rank} ({host or socket.gethostname()}): SM clock {clock:.0f}/{peak:.0f} MHz "
        f"({clock / peak:.0%}) {load}{power_text}, no throttle reason set. Check the power supply and its "
        "adapter (a stuck USB-C power-delivery controller does this); a reboot may not clear it: unplug the machine "
        "from the wall, wait a minute, plug it back in (cold power cycle)."
    )


class UnderclockCallback(PretrainCallback):
    keep_in_history = False  # read off clocks and sensors: differs between identical runs
    arguments = {"underclock_threshold": 0.6}

    @classmethod
    def from_arguments(cls, trainer, built=()) -> UnderclockCallback | None:
        sensors = next((c for c in built if isinstance(c, HardwareSensorsCallback)), None)
        return cls(sensors, cls.settings(trainer.args)["underclock_threshold"]) if sensors else None

    def __init__(
        self,
        sensors: HardwareSensorsCallback,
        threshold: float = arguments["underclock_threshold"],
        min_utilization: float = 50.0,
    ):
        self.sensors = sensors
        self.threshold = threshold
        self.min_utilization = min_utilization
        self.warnings: list[tuple[int, str]] = []  # (step, text), for the run report
        self._active = False
        self._pending: dict[str, str] = {}

    def on_step_end(self, args, state, control, **kwargs):
        warning = underclock_warning(self.sensors.latest, self.threshold, self.min_utilization, args.process_index)
        if warning and not self._active:
            self.warnings.append((state.global_step, warning))
            self._pending = self._pending or {"underclock_warning": warning, "underclock_rank": args.process_index}
            logger.warning(warning)
        self._active = warning is not None

    def metrics_for_log(self, state) -> dict[str, str]:
        pending, self._pending = self._pending, {}
        return pending
