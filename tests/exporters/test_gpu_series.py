"""GPU series from fake GPUs (tests/fake_nvml.py: the fake libnvidia-ml under the real pynvml):
the host exporter's device series, and the job's own GPU memory served from its recording."""

from __future__ import annotations

import os
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.sampling.gpu_fixtures import HOST_PIDS, fake_nvml
from torchdoctor.exporters.prometheus import HostCollector, JobCollector, registry_for
from torchdoctor.recording import RecordingWriter
from torchdoctor.sampling.gpus import GpuReader
from torchdoctor.sampling.job import JobReader
from torchdoctor.sampling.sampler import Sampler

GIB = 1024**3


def _series(collector) -> dict[str, list]:
    text = generate_latest(registry_for(collector)).decode()
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


def _machine(used_by_us: int):
    gpus = [
        fake_nvml.FakeGpu(utilization_gpu=73, utilization_memory=20, memory_used=30 * GIB,
                          compute_processes=[(os.getpid(), used_by_us)]),
        fake_nvml.FakeGpu(uuid="GPU-AB12CD34-0000-4000-8000-000000000001",
                          clock_event_reasons=0x40 | 0x4, ecc_volatile=(7, 1)),
    ]  # fmt: skip
    return GpuReader(fake_nvml.FakeNvml(gpus), pid_namespace=HOST_PIDS)


def test_host_exporter_serves_each_device() -> None:
    reader = _machine(2 * GIB)
    try:
        series = _series(HostCollector(None, reader, lambda: [], findings=False))
    finally:
        reader.close()
    assert series["torchdoctor_gpu_up"][0].value == 1
    util = {s.labels["gpu"]: s.value for s in series["torchdoctor_gpu_utilization_ratio"]}
    assert util == {"0": 0.73, "1": 0.0}
    total = series["torchdoctor_gpu_memory_total_bytes"]
    assert [s.value for s in total] == [80 * GIB, 80 * GIB]
    assert series["torchdoctor_gpu_power_watts"][0].value == 61.0
    assert series["torchdoctor_gpu_sm_clock_hertz"][0].value == 1410e6
    (info,) = [s for s in series["torchdoctor_gpu_info"] if s.labels["gpu"] == "1"]
    # As NVML spells it, so that it joins with dcgm-exporter's series on `uuid`.
    assert info.labels["uuid"] == "GPU-AB12CD34-0000-4000-8000-000000000001"
    assert info.labels["name"] == "NVIDIA A100-SXM4-80GB"
    assert info.labels["driver_version"] == "550.54.15"
    active = {
        (s.labels["gpu"], s.labels["reason"])
        for s in series["torchdoctor_gpu_clock_event_reason_active"]
        if s.value == 1
    }
    assert active == {("0", "gpu_idle"), ("1", "hw_thermal_slowdown"), ("1", "sw_power_cap")}
    ecc = {
        (s.labels["gpu"], s.labels["kind"]): s.value
        for s in series["torchdoctor_gpu_ecc_errors_total"]
    }
    assert ecc[("1", "corrected")] == 7 and ecc[("1", "uncorrected")] == 1
    assert {s.labels["gpu"]: s.value for s in series["torchdoctor_gpu_xid_errors_total"]} == {
        "0": 0,
        "1": 0,
    }


def test_job_endpoint_serves_the_jobs_gpu_memory(tmp_path: Path) -> None:
    reader = _machine(3 * GIB)
    path = tmp_path / "gpujob.sqlite"
    writer = RecordingWriter(path, {"started_at": 0.0, "gpus": {"available": True}})
    sampler = Sampler(None, JobReader(os.getpid()), reader)
    try:
        writer.write_snapshot(sampler.snapshot())
        writer.flush()
        series = _series(JobCollector(path, findings=False))
    finally:
        sampler.close()
        reader.close()
        writer.close()
    used = {s.labels["gpu"]: s.value for s in series["torchdoctor_job_gpu_memory_used_bytes"]}
    assert used == {"0": 3 * GIB, "1": 0}  # a device the job does not use: a measured zero
    assert {s.labels["gpu"] for s in series["torchdoctor_gpu_memory_used_bytes"]} == {"0", "1"}
