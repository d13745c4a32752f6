"""A report of a recording made by the real readers: real /proc, a real child process, and the
GPU reader over the fake NVML (the one fake of the suite) with a GPU that falls off the bus."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchdoctor.recording import RecordingWriter, open_recording
from torchdoctor.recording.metadata import run_metadata
from torchdoctor.report.data import build_report_data
from torchdoctor.sampling.gpus import GpuReader
from torchdoctor.sampling.host import HostReader
from torchdoctor.sampling.hostinfo import read_host_info
from torchdoctor.sampling.job import JobReader
from torchdoctor.sampling.pidns import PidNamespace
from torchdoctor.sampling.sampler import Sampler
from torchdoctor.thresholds import Thresholds

TESTS = Path(__file__).resolve().parents[1]
INTERVAL = 0.5
SNAPSHOTS = 40
LOST_AT = 25  # GPU 1 answers GpuIsLost from this snapshot on


def fake_nvml():
    loaded = sys.modules.get("fake_nvml")
    if loaded is not None:
        return loaded
    spec = importlib.util.spec_from_file_location("fake_nvml", TESTS / "fake_nvml.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["fake_nvml"] = module
    spec.loader.exec_module(module)
    return module


def shift(snapshot, t: float):
    """The snapshot as if taken at ``t``: the readers ran back to back, the chart needs time."""
    snapshot.t = t
    for record in [snapshot.host, *snapshot.processes, *snapshot.gpus, *snapshot.gpu_processes]:
        if record is not None:
            record.t = t
    return snapshot


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    nvml = fake_nvml()
    machine = nvml.scenario("two_gpus")
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    machine.gpus[0].compute_processes = [(child.pid, 0)]
    try:
        gpus = GpuReader(nvml_module=machine, pid_namespace=PidNamespace(procfs_is_host=True))
        path = tmp_path_factory.mktemp("real") / "real.sqlite"
        meta = run_metadata(
            mode="run",
            command=[sys.executable, "-c", "import sys; sys.stdin.read()"],
            root_pid=child.pid,
            interval_s=INTERVAL,
            env=dict(os.environ),
            host_info=read_host_info(),
            gpu_status=gpus.status,
            instrumented=False,
        )
        writer = RecordingWriter(path, meta)
        sampler = Sampler(HostReader(), JobReader(child.pid), gpus)
        t0 = meta["started_at"]
        for k in range(SNAPSHOTS):
            for i, gpu in enumerate(machine.gpus):
                gpu.utilization_gpu = 20 + k * 2 if i == 0 else 90
                gpu.memory_used = (10 + k) * nvml.GIB
            machine.gpus[0].compute_processes = [(child.pid, (8 + k) * nvml.GIB)]
            if k == LOST_AT:
                machine.gpus[1].lost_after_calls = 0
            writer.write_snapshot(shift(sampler.snapshot(), t0 + k * INTERVAL))
        writer.close({"ended_at": t0 + SNAPSHOTS * INTERVAL, "exit_status": 0})
        gpus.close()
    finally:
        child.stdin.close()
        child.wait(timeout=10)
    with open_recording(path) as rec:
        yield build_report_data(rec, Thresholds(), diagnose=lambda rec, th: []), child.pid


def test_gpu_charts_follow_what_nvml_reported_and_break_where_a_gpu_was_lost(recorded):
    data, _ = recorded
    charts = {c.id: c for c in data.charts}
    util = {s.label: s for s in charts["gpu-util"].series}
    assert set(util) == {"GPU 0 (NVIDIA A100-SXM4-80GB)", "GPU 1 (NVIDIA A100-SXM4-80GB)"}
    gpu0 = util["GPU 0 (NVIDIA A100-SXM4-80GB)"]
    assert gpu0.samples == SNAPSHOTS and gpu0.peak == 20 + 2 * (SNAPSHOTS - 1)
    lost = util["GPU 1 (NVIDIA A100-SXM4-80GB)"]
    assert lost.samples == LOST_AT  # no made-up readings after the GPU fell off the bus
    assert all(v is None for t, v in lost.points if t >= LOST_AT * INTERVAL)
    vram = {s.label: s for s in charts["vram"].series}
    job = vram["GPU 0 (NVIDIA A100-SXM4-80GB): this job"]
    assert job.peak == pytest.approx(100 * (8 + SNAPSHOTS - 1) / 80)


def test_host_and_process_figures_come_from_proc(recorded):
    data, pid = recorded
    charts = {c.id: c for c in data.charts}
    memory = {s.label: s for s in charts["memory"].series}
    assert memory["machine used"].samples == SNAPSHOTS
    assert memory["job RSS (shared pages counted per process)"].peak > 1024 * 1024
    (row,) = data.processes
    assert row.pid == pid and row.role == "trainer" and row.peak_threads >= 1
    sections = {s.title: dict(s.rows) for s in data.meta}
    assert sections["GPUs"]["NVML"] == "available"
    assert sections["GPUs"]["driver"] == "550.54.15"
    assert sections["Machine"]["logical CPUs"] == str(os.cpu_count())
    summary = {f.label: f.value for f in data.summary}
    assert summary["VRAM (peak)"] == f"{100 * (10 + SNAPSHOTS - 1) / 80:.3g} %"
