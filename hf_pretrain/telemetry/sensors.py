"""Device sensors: NVML for NVIDIA GPUs (through nvidia-ml-py), process readings for the CPU.

NVML is read field by field. A field the device does not expose (NVML answers `NotSupported`,
e.g. memory on unified-memory GB10 boxes, or power limits on some boards) is recorded in
`unavailable` once, with NVML's reason, and never read or reported again: a missing counter is
"unavailable", never a 0 that a chart would draw as a fact. Other NVML errors of one read are
treated the same way for that field only.

Reading keys (all optional; present only when the device exposes them):
`gpu_sm_clock_mhz`, `gpu_sm_clock_max_mhz`, `gpu_mem_clock_mhz`, `gpu_power_w`,
`gpu_power_limit_w`, `gpu_power_of_limit` (draw / limit, shown next to utilization),
`gpu_utilization_pct`, `gpu_temperature_c`, `gpu_memory_used_gib`, `gpu_memory_total_gib`,
`gpu_throttle_reasons` (decoded names, "none" when no reason is set), `gpu_throttled` (1 when a
reason that limits the clock is set: numeric, for trackers that drop text), and on every device
`process_rss_gib`, `cpu_utilization_pct` (this process, all cores = 100 x cores).
"""

from __future__ import annotations

import os

import psutil

GIB = 2**30

# NVML clocks-event (throttle) reason bits, named as nvidia-smi names them.
THROTTLE_REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
# Reasons that explain a low clock under load (idle and sync boost do not).
LIMITING_REASONS = {
    "sw_power_cap",
    "hw_slowdown",
    "sw_thermal_slowdown",
    "hw_thermal_slowdown",
    "hw_power_brake_slowdown",
    "applications_clocks_setting",
}


def decode_throttle_reasons(mask: int) -> list[str]:
    """Names of the reason bits set in an NVML clocks-event mask (unknown bits as hex)."""
    names = [name for bit, name in THROTTLE_REASONS.items() if mask & bit]
    unknown = mask & ~sum(THROTTLE_REASONS)
    return names + ([hex(unknown)] if unknown else [])


class CpuSensors:
    """This process: resident memory and CPU utilisation since the previous read."""

    def __init__(self):
        self.process = psutil.Process(os.getpid())
        self.process.cpu_percent(None)  # start the interval
        self.unavailable: dict[str, str] = {}

    def read(self) -> dict[str, float | str]:
        return {
            "process_rss_gib": self.process.memory_info().rss / GIB,
            "cpu_utilization_pct": self.process.cpu_percent(None),
        }


class NvmlSensors(CpuSensors):
    """One GPU through NVML; `nvml` is the `pynvml` module (injectable: tests pass recorded readings)."""

    def __init__(self, index: int = 0, nvml=None, uuid: str | None = None):
        super().__init__()
        if nvml is None:
            import pynvml as nvml
        self.nvml = nvml
        nvml.nvmlInit()
        # NVML numbers devices its own way (CUDA_VISIBLE_DEVICES does not apply): find ours by UUID when known.
        self.handle = nvml.nvmlDeviceGetHandleByUUID(uuid) if uuid else nvml.nvmlDeviceGetHandleByIndex(index)
        self.name = _text(nvml.nvmlDeviceGetName(self.handle))

    def _field(self, key: str, read):
        if key in self.unavailable:
            return None
        try:
            return read()
        except self.nvml.NVMLError as err:
            self.unavailable[key] = str(err) or type(err).__name__
            return None

    def _reasons(self) -> int:
        # nvidia-ml-py >= 12.535 names it "clocks event reasons"; older releases "throttle reasons".
        get = (
            getattr(self.nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
            or self.nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        )
        return get(self.handle)

    def read(self) -> dict[str, float | str]:
        n, h = self.nvml, self.handle
        fields = {
            "gpu_sm_clock_mhz": lambda: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM),
            "gpu_sm_clock_max_mhz": lambda: n.nvmlDeviceGetMaxClockInfo(h, n.NVML_CLOCK_SM),
            "gpu_mem_clock_mhz": lambda: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_MEM),
            "gpu_utilization_pct": lambda: n.nvmlDeviceGetUtilizationRates(h).gpu,
            "gpu_power_w": lambda: n.nvmlDeviceGetPowerUsage(h) / 1000,
            "gpu_power_limit_w": lambda: n.nvmlDeviceGetEnforcedPowerLimit(h) / 1000,
            "gpu_temperature_c": lambda: n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU),
            "gpu_memory_used_gib": lambda: n.nvmlDeviceGetMemoryInfo(h).used / GIB,
            "gpu_memory_total_gib": lambda: n.nvmlDeviceGetMemoryInfo(h).total / GIB,
            "gpu_throttle_reasons": lambda: ",".join(decode_throttle_reasons(self._reasons())) or "none",
        }
        reading = {key: value for key, read in fields.items() if (value := self._field(key, read)) is not None}
        if "gpu_throttle_reasons" in reading:
            reading["gpu_throttled"] = float(bool(set(reading["gpu_throttle_reasons"].split(",")) & LIMITING_REASONS))
        if "gpu_power_w" in reading and reading.get("gpu_power_limit_w"):
            reading["gpu_power_of_limit"] = reading["gpu_power_w"] / reading["gpu_power_limit_w"]
        return {**reading, **super().read()}


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def open_sensors(device) -> CpuSensors:
    """NVML sensors for a CUDA device when NVML loads, else CPU readings with GPU sensors unavailable."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        try:
            index = device.index if device.index is not None else torch.cuda.current_device()
            uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
            return NvmlSensors(index, uuid=f"GPU-{uuid}" if uuid else None)
        except Exception as err:  # no driver library, or NVML not initialised
            sensors = CpuSensors()
            sensors.unavailable["gpu"] = f"NVML unavailable: {err}"
            return sensors
    sensors = CpuSensors()
    sensors.unavailable["gpu"] = f"no GPU sensors on a {device.type} device"
    return sensors
