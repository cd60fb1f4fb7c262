"""Recorded NVML readings behind a stand-in for the `pynvml` module (its real constants and exceptions).

- H100_SXM: an 80 GB H100 SXM training at its power cap (nvidia-smi -q style values).
- GB10: a GB10 (DGX Spark) under a week-long bf16 run from the field notes: SM ~2460 MHz, 50-60 W,
  96 % utilization; memory info and the enforced power limit raise NotSupported (unified memory).
- GB10_STUCK: its twin stuck at ~600 MHz under load with no clocks-event reason set.
- GB10_STUCK_NO_UTIL: the same with the utilization query answering NotSupported (as some
  unified-memory boards do): load is then judged from NVML's reasons, which hold no `gpu_idle`.
- GB10_IDLE_NO_UTIL: a GB10 between jobs, clock down, utilization NotSupported, NVML's `gpu_idle`
  reason set: idle explains the low clock.
- GB10_BLIND: utilization and the clocks-event reasons both NotSupported: no verdict possible.
- H200_IDLE: the H200 lent to this project, idle (SM 345 of 1980 MHz, memory clock 3201 MHz,
  143771 MiB, read with nvidia-smi before a matmul test, /work/.library/device/KINDS.md); power
  draw and temperature are typical idle values (not recorded there), `gpu_idle` set as NVML does
  for an idle GPU.
"""

from types import SimpleNamespace

import pynvml

NOT_SUPPORTED = "not_supported"

H100_SXM = dict(
    name="NVIDIA H100 80GB HBM3",
    sm=1980,
    sm_max=1980,
    mem=2619,
    util=100,
    power_mw=688_500,
    limit_mw=700_000,
    temp=66,
    used=71.3 * 2**30,
    total=79.6 * 2**30,
    reasons=0x4,
)
GB10 = dict(
    name="NVIDIA GB10",
    sm=2460,
    sm_max=2520,
    mem=NOT_SUPPORTED,
    util=96,
    power_mw=55_000,
    limit_mw=NOT_SUPPORTED,
    temp=61,
    used=NOT_SUPPORTED,
    total=NOT_SUPPORTED,
    reasons=0x0,
)
GB10_STUCK = {**GB10, "sm": 600, "util": 98, "power_mw": 28_000}
GB10_STUCK_NO_UTIL = {**GB10_STUCK, "name": "NVIDIA GB10 (no utilization)", "util": NOT_SUPPORTED}
GB10_IDLE_NO_UTIL = {**GB10_STUCK_NO_UTIL, "name": "NVIDIA GB10 (idle)", "power_mw": 4_000, "reasons": 0x1}
GB10_BLIND = {**GB10_STUCK_NO_UTIL, "name": "NVIDIA GB10 (no reasons)", "reasons": NOT_SUPPORTED}
H200_IDLE = dict(
    name="NVIDIA H200",
    sm=345,
    sm_max=1980,
    mem=3201,
    util=0,
    power_mw=76_000,
    limit_mw=700_000,
    temp=31,
    used=0.5 * 2**30,
    total=143_771 * 2**20,
    reasons=0x1,
)


class FakeNvml(SimpleNamespace):
    """Answers the NVML calls NvmlSensors makes from one recorded reading; counts calls per function."""

    def __init__(self, reading: dict):
        super().__init__(**{k: getattr(pynvml, k) for k in dir(pynvml) if k.startswith(("NVML_", "NVMLError"))})
        self.reading, self.calls = reading, {}

    def _get(self, fn: str, key: str):
        self.calls[fn] = self.calls.get(fn, 0) + 1
        value = self.reading[key]
        if value == NOT_SUPPORTED:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return value

    def nvmlInit(self):
        pass

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetName(self, handle):
        return self.reading["name"].encode()

    def nvmlDeviceGetClockInfo(self, handle, clock):
        return self._get("clock", "sm" if clock == pynvml.NVML_CLOCK_SM else "mem")

    def nvmlDeviceGetMaxClockInfo(self, handle, clock):
        return self._get("max_clock", "sm_max")

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=self._get("util", "util"), memory=0)

    def nvmlDeviceGetPowerUsage(self, handle):
        return self._get("power", "power_mw")

    def nvmlDeviceGetEnforcedPowerLimit(self, handle):
        return self._get("power_limit", "limit_mw")

    def nvmlDeviceGetTemperature(self, handle, sensor):
        return self._get("temperature", "temp")

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(used=self._get("memory", "used"), total=self._get("memory", "total"))

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        return self._get("reasons", "reasons")
