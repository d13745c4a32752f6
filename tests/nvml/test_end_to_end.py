"""torchdoctor's GPU half against two fake GPUs at the C ABI: the commands users run, in child
processes whose own ``import pynvml`` loads tests/nvml/fake_nvml.c through LD_LIBRARY_PATH.

The job is tests/helpers/fake_cuda_job.py: it "allocates" on the devices CUDA_VISIBLE_DEVICES
names, in the shared fake machine, so NVML lists the job's real PID with its memory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import fake_nvml
from tests.conftest import TORCHDOCTOR
from tests.fake_nvml import GIB
from torchdoctor import open_recording

PY = sys.executable
FAKE_JOB = str(Path(__file__).resolve().parents[1] / "helpers" / "fake_cuda_job.py")
UUIDS = ["GPU-7e1c0d2a-4b3f-4c5d-8e6f-a10000000000", "GPU-7e1c0d2a-4b3f-4c5d-8e6f-a10000000001"]
HW_THERMAL = fake_nvml.nvmlClocksEventReasonGpuIdle * 0x40  # nvmlClocksEventReasonHwThermalSlowdown


@pytest.fixture
def machine(tmp_path):
    """Two 40 GiB GPUs, busy and hot: GPU 1 throttles for heat."""
    path = str(tmp_path / "machine.json")
    fake_nvml.write_machine(
        path,
        [
            {"uuid": UUIDS[0], "memory_total": 40 * GIB, "utilization_gpu": 97, "numa_node": 0,
             "clock_event_reasons": 0},
            {"uuid": UUIDS[1], "memory_total": 40 * GIB, "utilization_gpu": 96, "numa_node": 0,
             "clock_event_reasons": 0x40, "temperature_c": 91, "sm_clock_mhz": 900},
        ],
    )  # fmt: skip
    return path


def td(env, *args, timeout=180):
    return subprocess.run(
        [*TORCHDOCTOR, *args], capture_output=True, text=True, timeout=timeout, env=env
    )


class Holder:
    """Another user's process holding memory on one GPU until its stdin closes. It is not a
    child of this test process: pytest may have imported torch (other test modules do), and
    `top` rightly shows a torch process with its children as one job."""

    def __init__(self, machine: str, gpu: int, gib: float) -> None:
        code = (
            "import os, sys\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    sys.stdout.close(); sys.stdin.read(); os._exit(0)\n"
            "print(pid, flush=True)\n"
        )
        parent = subprocess.Popen(
            [PY, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.pid = int(parent.stdout.readline())
        parent.wait()  # the holder is re-parented away from us
        self.stdin = parent.stdin
        assert fake_nvml.allocate(machine, UUIDS[gpu], int(gib * GIB), pid=self.pid)

    def wait(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while os.path.exists(f"/proc/{self.pid}") and time.monotonic() < deadline:
            with open(f"/proc/{self.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return  # ended; its new parent reaps it
            time.sleep(0.05)


def holder(machine: str, gpu: int, gib: float) -> Holder:
    return Holder(machine, gpu, gib)


def test_run_records_each_process_s_vram_joined_to_the_job_and_diagnoses_the_gpus(
    machine, tmp_path
):
    other = holder(machine, 1, 5)
    rec = tmp_path / "job.sqlite"
    env = {**fake_nvml.machine_env(machine), "CUDA_VISIBLE_DEVICES": ",".join(UUIDS)}
    run = subprocess.Popen(
        [*TORCHDOCTOR, "run", "--quiet", "--interval", "0.2", "--out", str(rec), "--",
         PY, FAKE_JOB, "--gib", "6", "--hold", "5", "--say-allocated"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        run.stdout.readline()  # the job's devices
        assert run.stdout.readline().strip() == "allocated"
        # GPU 0 falls off the bus while the job runs; its memory reports an uncorrectable error.
        fake_nvml.update_gpu(machine, UUIDS[0], xids=[79], ecc_volatile=[0, 2])
        _, stderr = run.communicate(timeout=120)
        assert run.returncode == 0, stderr
    finally:
        other.stdin.close()
        other.wait()
        if run.poll() is None:
            run.kill()
    with open_recording(rec) as r:
        gpus = r.meta["gpus"]
        assert gpus["available"] and [g["uuid"] for g in gpus["gpus"]] == UUIDS
        (trainer,) = [p for p in r.processes() if p["role"] == "trainer"]
        rows = r.rows("gpu_process_samples")
        ours = {(row["gpu_index"], row["used_memory"]) for row in rows if row["in_job"]}
        assert ours == {(0, 6 * GIB), (1, 6 * GIB)}
        assert {row["pid"] for row in rows if row["in_job"]} == {trainer["pid"]}
        foreign = [row for row in rows if not row["in_job"]]
        assert foreign and {(row["pid"], row["gpu_index"]) for row in foreign} == {(other.pid, 1)}
        samples = r.rows("gpu_samples", where={"index": 1})
        assert max(s["memory_used"] for s in samples) == 11 * GIB  # ours and theirs
        assert any(s["clock_event_reasons"] == ["hw_thermal_slowdown"] for s in samples)
        gpu0 = r.rows("gpu_samples", where={"index": 0})
        assert sum((s["xid_errors"] or []).count(79) for s in gpu0) == 1  # recorded once
        assert max(s["ecc_uncorrected"] for s in gpu0) == 2
    diagnosis = td(env, "diagnose", "--json", str(rec))
    assert diagnosis.returncode in (0, 1), diagnosis.stderr
    findings = json.loads(diagnosis.stdout)["findings"]
    throttled = [f for f in findings if f["id"] == "gpu-throttled"]
    assert [f["title"] for f in throttled] == ["GPU 1 runs throttled (hw_thermal_slowdown)"]
    (broken,) = [f for f in findings if f["id"] == "gpu-hardware-errors"]
    assert broken["severity"] == "critical" and broken["title"].startswith("GPU 0 reported Xid 79")
    assert "nvidia-bug-report.sh" in broken["recommendation"]


def test_top_and_doctor_see_the_job_and_another_user_s_process(machine):
    env = {**fake_nvml.machine_env(machine), "CUDA_VISIBLE_DEVICES": UUIDS[0]}
    job = subprocess.Popen([PY, FAKE_JOB, "--gib", "37", "--hold", "120", "--say-allocated"],
                           env=env, stdout=subprocess.PIPE, text=True)  # fmt: skip
    other = holder(machine, 1, 2)
    try:
        job.stdout.readline()  # its devices
        assert job.stdout.readline().strip() == "allocated"
        top = td(env, "top", "--once", "--json", "--interval", "0.3")
        assert top.returncode == 0, top.stderr
        data = json.loads(top.stdout)
        assert data["gpu"]["available"] and [g["uuid"] for g in data["gpus"]] == UUIDS
        assert data["gpus"][0]["memory_pct"] > 90 and data["gpus"][0]["level"] == "alert"
        procs = {p["pid"]: p for p in data["gpu_processes"]}
        assert procs[job.pid]["used_memory"] == 37 * GIB
        assert procs[other.pid]["used_memory"] == 2 * GIB and not procs[other.pid]["job"]

        doctor = td(fake_nvml.machine_env(machine), "doctor", "--json", "--only", "gpus")
        checks = {c["name"]: c for c in json.loads(doctor.stdout)["checks"]}
        assert checks["gpus.visible"]["details"]["visible"] == [0, 1]
        processes = checks["gpus.processes"]
        assert processes["status"] == "warning", processes
        assert f"PID {other.pid}" in " ".join(processes["details"].get("rows", [])) or (
            f"PID {other.pid}" in processes["saw"]
        )
    finally:
        other.stdin.close()
        other.wait()
        job.kill()
        job.wait()
