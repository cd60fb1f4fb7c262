import json

import pytest
import torch

from hf_pretrain.telemetry.hardware import HardwareSensorsCallback
from hf_pretrain.telemetry.jsonl import JsonlCallback, read_jsonl
from hf_pretrain.telemetry.sensors import NvmlSensors, decode_throttle_reasons, open_sensors
from hf_pretrain.telemetry.underclock import underclock_warning
from tests.telemetry.nvml_fixtures import GB10, GB10_STUCK, H100_SXM, FakeNvml


def test_throttle_reasons_decode_like_nvidia_smi():
    assert decode_throttle_reasons(0) == []
    assert decode_throttle_reasons(0x4 | 0x40) == ["sw_power_cap", "hw_thermal_slowdown"]
    assert decode_throttle_reasons(0x1 | 0x4000) == ["gpu_idle", "0x4000"]


def test_h100_reading_is_decoded_with_power_next_to_its_limit():
    reading = NvmlSensors(nvml=FakeNvml(H100_SXM)).read()
    assert reading["gpu_sm_clock_mhz"] == 1980 and reading["gpu_sm_clock_max_mhz"] == 1980
    assert reading["gpu_power_w"] == pytest.approx(688.5) and reading["gpu_power_limit_w"] == 700
    assert reading["gpu_power_of_limit"] == pytest.approx(0.98357, abs=1e-4)
    assert reading["gpu_memory_used_gib"] == pytest.approx(71.3) and reading["gpu_memory_total_gib"] == pytest.approx(
        79.6
    )
    assert reading["gpu_throttle_reasons"] == "sw_power_cap" and reading["process_rss_gib"] > 0


def test_unexposed_sensors_are_unavailable_once_and_never_zero():
    nvml = FakeNvml(GB10)
    sensors = NvmlSensors(nvml=nvml)
    first = sensors.read()
    assert first["gpu_utilization_pct"] == 96 and first["gpu_power_w"] == 55 and first["gpu_throttle_reasons"] == "none"
    for missing in (
        "gpu_memory_used_gib",
        "gpu_memory_total_gib",
        "gpu_power_limit_w",
        "gpu_mem_clock_mhz",
        "gpu_power_of_limit",
    ):
        assert missing not in first
    assert sensors.unavailable["gpu_memory_used_gib"] == "Not Supported"
    calls = dict(nvml.calls)
    second = sensors.read()
    assert second.keys() == first.keys()
    assert (
        nvml.calls["memory"] == calls["memory"] and nvml.calls["power_limit"] == calls["power_limit"]
    )  # not asked again
    assert nvml.calls["power"] == calls["power"] + 1


def test_callback_warns_once_per_unavailable_sensor_and_logs_only_real_values(caplog):
    callback = HardwareSensorsCallback(every=1, sensors=NvmlSensors(nvml=FakeNvml(GB10)))
    callback.device = "cpu"
    callback.read()
    first = callback.metrics_for_log(None)
    callback.read()
    second = callback.metrics_for_log(None)
    assert "gpu_memory_used_gib: Not Supported" in first["sensors_unavailable"] and "sensors_unavailable" not in second
    measured = {k: v for k, v in second.items() if k.startswith("gpu_") and k != "gpu_throttled"}
    assert measured and all(v not in (0, "0") for v in measured.values())  # only what the device really reported
    assert second["gpu_throttled"] == 0.0  # a real reading: no limiting reason set
    warnings = [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()]
    assert sum("gpu_memory_used_gib" in w for w in warnings) == 1


def test_underclock_callback_warns_once_per_episode_and_names_the_rank():
    from types import SimpleNamespace

    from transformers import TrainerControl, TrainerState

    from hf_pretrain.telemetry.underclock import UnderclockCallback

    sensors = HardwareSensorsCallback(every=1, sensors=NvmlSensors(nvml=FakeNvml(GB10_STUCK)))
    sensors.device = "cpu"
    sensors.read()
    callback, state, args = UnderclockCallback(sensors), TrainerState(), SimpleNamespace(process_index=1)
    for step in (1, 2, 3):
        state.global_step = step
        callback.on_step_end(args, state, TrainerControl())
    assert len(callback.warnings) == 1 and callback.warnings[0][0] == 1  # one episode, from its first step
    logged = callback.metrics_for_log(state)
    assert logged["underclock_rank"] == 1 and "rank 1" in logged["underclock_warning"]
    assert callback.metrics_for_log(state) == {}
    sensors.sensors = NvmlSensors(nvml=FakeNvml(GB10))  # the clock recovers, then drops again: a second episode
    sensors.read()
    callback.on_step_end(args, state, TrainerControl())
    sensors.sensors = NvmlSensors(nvml=FakeNvml(GB10_STUCK))
    sensors.read()
    callback.on_step_end(args, state, TrainerControl())
    assert len(callback.warnings) == 2


def test_cpu_path_reads_the_process_for_real_and_marks_gpu_unavailable():
    sensors = open_sensors(torch.device("cpu"))
    reading = sensors.read()
    assert reading["process_rss_gib"] > 0.01 and reading["cpu_utilization_pct"] >= 0
    assert not any(k.startswith("gpu_") for k in reading) and "gpu" in sensors.unavailable


def test_underclock_rule_on_recorded_readings():
    stuck = NvmlSensors(nvml=FakeNvml(GB10_STUCK)).read()
    warning = underclock_warning(stuck, threshold=0.6, rank=1, host="node-b")
    assert "rank 1 (node-b): SM clock 600/2520 MHz (24%)" in warning and "no throttle reason" in warning
    assert "unplug" in warning and "power supply" in warning
    assert underclock_warning(NvmlSensors(nvml=FakeNvml(GB10)).read()) is None  # healthy
    assert underclock_warning({**stuck, "gpu_throttle_reasons": "hw_thermal_slowdown"}) is None  # explained
    assert underclock_warning({**stuck, "gpu_utilization_pct": 3}) is None  # idle, not under load
    assert underclock_warning({"process_rss_gib": 1.0}) is None  # no GPU sensors: nothing to judge


def test_a_missing_utilization_is_unknown_and_idle_explains_a_low_clock():
    from tests.telemetry.nvml_fixtures import GB10_BLIND, GB10_IDLE_NO_UTIL, GB10_STUCK_NO_UTIL, H200_IDLE

    # utilization not reported, NVML's reasons hold no gpu_idle: under load, and stuck
    no_util = NvmlSensors(nvml=FakeNvml(GB10_STUCK_NO_UTIL)).read()
    assert "gpu_utilization_pct" not in no_util and no_util["gpu_throttle_reasons"] == "none"
    warning = underclock_warning(no_util, rank=1, host="node-b")
    assert "SM clock 600/2520 MHz" in warning and "utilization not reported" in warning
    # the same clock with NVML's gpu_idle reason: idle explains it (the old rule took the missing reading as 100 %)
    assert underclock_warning(NvmlSensors(nvml=FakeNvml(GB10_IDLE_NO_UTIL)).read()) is None
    # neither utilization nor reasons: no verdict either way
    blind = NvmlSensors(nvml=FakeNvml(GB10_BLIND)).read()
    assert "gpu_throttle_reasons" not in blind and underclock_warning(blind) is None
    # an idle H200 at 345 of 1980 MHz (17 %): idle by utilization and by NVML's reason
    idle = NvmlSensors(nvml=FakeNvml(H200_IDLE)).read()
    assert idle["gpu_throttle_reasons"] == "gpu_idle" and underclock_warning(idle) is None
    assert underclock_warning({**idle, "gpu_throttle_reasons": "none"}) is None  # 0 % utilization alone says idle
    busy = {**idle, "gpu_throttle_reasons": "none", "gpu_utilization_pct": 100}
    assert "SM clock 345/1980 MHz (17%) under load (100 % utilization)" in underclock_warning(busy)


def test_spec_names_do_not_match_inside_other_names():
    from hf_pretrain.chips import spec_tflops

    assert spec_tflops("NVIDIA L40", "bf16") == 181.0 and spec_tflops("NVIDIA L4", "bf16") == 121.0
    assert spec_tflops("NVIDIA GB200", "bf16") == 2500.0 and spec_tflops("NVIDIA B200", "bf16") == 2250.0


def test_jsonl_stream_keeps_every_log_line(tmp_path):
    from transformers import TrainerControl, TrainerState

    callback, state = JsonlCallback(tmp_path), TrainerState()
    state.global_step = 3
    callback.on_log(None, state, TrainerControl(), logs={"loss": 1.5, "grad_norm": float("nan"), "note": "x"})
    records = read_jsonl(tmp_path)
    assert records[0]["step"] == 3 and records[0]["loss"] == 1.5 and records[0]["grad_norm"] == "nan"
    assert json.loads((tmp_path / "telemetry.jsonl").read_text())["note"] == "x"


def test_jsonl_reader_skips_what_a_dying_run_leaves(tmp_path):
    (tmp_path / "telemetry.jsonl").write_text('{"step": 1, "loss": 2.0}\n[1, 2]\n{"loss": 3.0}\n{"step": 2, "lo')
    assert read_jsonl(tmp_path) == [{"step": 1, "loss": 2.0}]
