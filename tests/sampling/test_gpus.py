"""GpuReader and the NVML choke point: real no-driver path, fake NVML scenarios, real processes."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys

import pytest
from tests.helpers.engines import engine, require_engine

from torchdoctor.sampling.gpus import GpuReader, decode_clock_event_reasons
from torchdoctor.sampling.job import JobReader
from torchdoctor.sampling.nvml import (
    FUNCTION_NOT_FOUND,
    GPU_LOST,
    NO_BINDINGS_REASON,
    NO_DRIVER,
    NOT_SUPPORTED,
    classify,
    is_stub_file,
)
from torchdoctor.sampling.sampler import Sampler

try:
    from gpu_fixtures import HOST_PIDS, TESTS_DIR, fake_nvml, job_tree, outsider
except ImportError:  # tests/sampling became a package
    from .gpu_fixtures import HOST_PIDS, TESTS_DIR, fake_nvml, job_tree, outsider

__all__ = ["job_tree", "outsider"]  # fixtures, used by name

GIB = 1024**3
MIB = 1024**2


def reader_for(fake, **kwargs) -> GpuReader:
    kwargs.setdefault("pid_namespace", HOST_PIDS)
    return GpuReader(fake, **kwargs)


def _driver_library_present() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


# -- NVML that does not work ------------------------------------------------------------------


@pytest.mark.skipif(_driver_library_present(), reason="a real NVIDIA driver library is here")
def test_real_bindings_without_driver_say_why_and_read_nothing():
    reader = GpuReader()  # the installed nvidia-ml-py, the machine's (absent) libnvidia-ml
    assert reader.status.available is False
    assert reader.status.reason == "no NVIDIA driver: libnvidia-ml.so.1 not found"
    assert reader.status.gpus == []
    assert reader.read({os.getpid()}) == ([], [])
    reader.close()


def test_missing_bindings_say_how_to_install_them(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` fail
    reader = GpuReader()
    assert reader.status.available is False
    assert reader.status.reason == NO_BINDINGS_REASON


def test_driver_not_loaded_is_unavailable_with_reason():
    fake = fake_nvml.scenario("no_driver")
    reader = reader_for(fake)
    assert (reader.status.available, reader.status.reason) == (False, "NVIDIA driver not loaded")
    assert reader.read(set()) == ([], [])
    assert fake.init_calls == 1
    assert sum(fake.calls.values()) == 0  # nothing called on a library that did not start


def test_stub_library_is_named_and_its_banner_kept_off_stdout(capfd):
    reader = reader_for(fake_nvml.scenario("stub_library"))
    assert reader.status.available is False
    assert reader.status.reason.startswith("stub library:")
    assert "stub library" not in capfd.readouterr().out


# Built like the CUDA toolkit's stubs/libnvidia-ml.so: every entry point prints the banner
# through libc's buffered stdout and fails.
_STUB_C = r"""
#include <stdio.h>
static void banner(void) {
    static int shown;
    if (!shown) {
        shown = 1;
        printf("\nWARNING:\n\nYou should always run with libnvidia-ml.so that is installed "
               "with your\nNVIDIA Display Driver. By default it's installed in /usr/lib and "
               "/usr/lib64.\nlibnvidia-ml.so in GDK package is a stub library that is "
               "attached only for\nbuild purposes.\n");
    }
}
int nvmlInitWithFlags(unsigned int flags) { banner(); return 999; }
int nvmlInit_v2(void) { banner(); return 999; }
int nvmlShutdown(void) { banner(); return 999; }
const char *nvmlErrorString(int result) { return ""; }
"""


@engine("cc", None if shutil.which("cc") else "needs a C compiler to build the stub")
@pytest.mark.parametrize("folder", ["stubs", "lib"])
def test_real_bindings_name_a_stub_library_and_keep_its_banner_off_stdout(tmp_path, folder):
    lib_dir = tmp_path / folder
    lib_dir.mkdir()
    source = tmp_path / "stub.c"
    source.write_text(_STUB_C)
    subprocess.run(
        ["cc", "-shared", "-fPIC", "-o", str(lib_dir / "libnvidia-ml.so.1"), str(source)],
        check=True,
    )
    env = dict(os.environ, LD_LIBRARY_PATH=str(lib_dir))
    # Python's default: C stdio fully buffered on a pipe (unbuffered would hide a missing flush).
    env.pop("PYTHONUNBUFFERED", None)
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "from torchdoctor.sampling.gpus import GpuReader\n"
            "print('reason:', GpuReader().status.reason)",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("reason: stub library:"), done.stdout  # nothing before it
    assert "WARNING" not in done.stdout + done.stderr


def test_stub_file_is_recognised_by_its_banner_wherever_it_was_copied(tmp_path):
    stub = tmp_path / "libnvidia-ml.so.1"
    stub.write_bytes(b"\x7fELF" + bytes(4096) + fake_nvml.STUB_BANNER.encode() + bytes(64))
    real_looking = tmp_path / "libnvidia-ml.so.550.54.15"
    real_looking.write_bytes(b"\x7fELF" + bytes(8192))
    assert is_stub_file(str(stub)) is True
    assert is_stub_file(str(real_looking)) is False
    assert is_stub_file(str(tmp_path / "missing.so")) is False


def test_other_output_during_init_still_reaches_stdout(capfd):
    fake = fake_nvml.FakeNvml([fake_nvml.FakeGpu()], init_banner="driver says hello\n")
    reader = reader_for(fake)
    assert reader.status.available is True
    assert capfd.readouterr().out == "driver says hello\n"


def test_classify_real_pynvml_errors():
    import pynvml

    def kind_of(code):
        return classify(pynvml.NVMLError(code)).kind

    assert kind_of(pynvml.NVML_ERROR_NOT_SUPPORTED) == NOT_SUPPORTED
    assert kind_of(pynvml.NVML_ERROR_GPU_IS_LOST) == GPU_LOST
    assert kind_of(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND) == FUNCTION_NOT_FOUND
    assert kind_of(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND) == NO_DRIVER
    assert classify(pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)).reason == "GPU is lost"
    # An unversioned pynvml wrapper on an old driver raises this instead of an NVMLError.
    mismatch = pynvml.NVMLLibraryMismatchError("Unversioned function called ...")
    assert classify(mismatch).kind == FUNCTION_NOT_FOUND
    assert classify(AttributeError("x"), "nvmlDeviceGetFoo").reason.startswith(
        "the installed nvidia-ml-py has no nvmlDeviceGetFoo"
    )


# -- the fake sits under the real bindings (its own tests: tests/nvml/) ------------------------


def test_fake_nvml_refuses_calls_before_init_like_the_real_one():
    fake = fake_nvml.scenario("two_gpus")
    with pytest.raises(fake.NVMLError_Uninitialized):
        fake.nvmlDeviceGetCount()


# -- two healthy GPUs -----------------------------------------------------------------------


def test_two_gpus_static_facts_and_units():
    fake = fake_nvml.scenario("two_gpus")
    gpu0 = fake.gpus[0]
    gpu0.utilization_gpu, gpu0.utilization_memory = 97, 41
    gpu0.memory_used = 30 * GIB
    gpu0.power_mw, gpu0.power_limit_mw = 312_500, 400_000
    gpu0.clock_event_reasons = (
        fake_nvml.nvmlClocksEventReasonSwPowerCap | fake_nvml.nvmlClocksEventReasonHwSlowdown
    )
    now = [10.0]
    reader = reader_for(fake, clock=lambda: now[0])
    status = reader.status
    assert (status.available, status.reason) == (True, None)
    assert (status.driver_version, status.cuda_driver_version) == ("550.54.15", "12.4")
    assert status.nvml_version == "12.550.54.15"
    assert [g.uuid for g in status.gpus] == [g.uuid for g in fake.gpus]
    info = status.gpus[0]
    assert (info.name, info.compute_capability) == ("NVIDIA A100-SXM4-80GB", "8.0")
    assert (info.memory_total, info.power_limit_w, info.unavailable) == (80 * GIB, 400.0, {})

    # PCIe byte counters move on between the reader's start and its first read, 2 s later.
    gpu0.pcie_rx_bytes += 6_000_000_000
    gpu0.pcie_tx_bytes += 1_000_000_000
    now[0] = 12.0
    samples, procs = reader.read(set())
    assert [s.index for s in samples] == [0, 1]
    s = samples[0]
    assert (s.utilization_gpu, s.utilization_memory) == (97.0, 41.0)
    assert (s.memory_used, s.memory_total) == (30 * GIB, 80 * GIB)  # v2: reserved not in used
    assert (s.power_w, s.power_limit_w) == (312.5, 400.0)  # mW -> W
    assert (s.pcie_rx_per_s, s.pcie_tx_per_s) == (3e9, 5e8)  # bytes/s over the interval
    assert fake.gpus[0].calls["nvmlDeviceGetPcieThroughput"] == 0  # no 20 ms bus sampling
    assert s.clock_event_reasons == ["sw_power_cap", "hw_slowdown"]
    assert (s.temperature_c, s.sm_clock_mhz) == (34.0, 1410.0)
    assert s.unavailable == {}
    assert procs == []
    reader.close()
    assert fake.refcount == 0
    assert reader.read(set()) == ([], [])


def test_pcie_falls_back_to_sampled_throughput_without_byte_counters():
    gpu = fake_nvml.FakeGpu(pcie_counters=False, pcie_rx_kb=2_000, pcie_tx_kb=3)
    samples, _ = reader_for(fake_nvml.FakeNvml([gpu])).read(set())
    assert (samples[0].pcie_rx_per_s, samples[0].pcie_tx_per_s) == (2_000 * 1024, 3 * 1024)
    assert samples[0].unavailable == {}


def test_pcie_counter_reset_gives_no_rate_rather_than_a_negative_one():
    fake = fake_nvml.scenario("two_gpus")
    now = [0.0]
    reader = reader_for(fake, slow_refresh_s=1.0, clock=lambda: now[0])
    now[0] = 1.0
    assert reader.read(set())[0][0].pcie_rx_per_s == 0.0  # idle bus: a measured zero
    fake.gpus[0].pcie_rx_bytes = 10  # driver reloaded: counters start again
    now[0] = 2.0
    s = reader.read(set())[0][0]
    assert s.pcie_rx_per_s is None
    assert s.unavailable["pcie_rx_per_s"] == "PCIe byte counter was reset"
    now[0] = 3.0
    fake.gpus[0].pcie_rx_bytes += 4096
    assert reader.read(set())[0][0].pcie_rx_per_s == 4096.0


def test_memory_falls_back_to_v1_on_a_driver_without_v2():
    fake = fake_nvml.FakeNvml([fake_nvml.FakeGpu(memory_used=GIB)], has_memory_v2=False)
    samples, _ = reader_for(fake).read(set())
    # v1 "used" includes the driver-reserved memory: still a measurement, not an unknown.
    assert samples[0].memory_used == GIB + fake.gpus[0].memory_reserved
    assert samples[0].unavailable == {}


def test_decode_clock_event_reasons_names_every_bit():
    assert decode_clock_event_reasons(0) == []
    assert decode_clock_event_reasons(0x1FF) == [
        "gpu_idle",
        "applications_clocks_setting",
        "sw_power_cap",
        "hw_slowdown",
        "sync_boost",
        "sw_thermal_slowdown",
        "hw_thermal_slowdown",
        "hw_power_brake_slowdown",
        "display_clock_setting",
    ]
    assert decode_clock_event_reasons(0x400 | 0x40) == ["hw_thermal_slowdown", "other_0x400"]


def test_slow_fields_refresh_only_on_the_slow_cadence():
    fake = fake_nvml.scenario("two_gpus")
    gpu = fake.gpus[0]
    now = [100.0]
    reader = reader_for(fake, slow_refresh_s=2.0, clock=lambda: now[0])

    gpu.power_mw, gpu.temperature_c, gpu.utilization_gpu = 100_000, 40, 10
    first = reader.read(set())[0][0]
    assert (first.power_w, first.temperature_c, first.utilization_gpu) == (100.0, 40.0, 10.0)

    gpu.power_mw, gpu.temperature_c, gpu.utilization_gpu = 250_000, 70, 90
    now[0] = 101.9
    carried = reader.read(set())[0][0]
    assert carried.utilization_gpu == 90.0  # fast tier: every read
    assert (carried.power_w, carried.temperature_c) == (100.0, 40.0)  # slow tier: carried
    assert gpu.calls["nvmlDeviceGetPowerUsage"] == 1
    assert gpu.calls["nvmlDeviceGetUtilizationRates"] == 2

    now[0] = 102.0
    refreshed = reader.read(set())[0][0]
    assert (refreshed.power_w, refreshed.temperature_c) == (250.0, 70.0)
    assert gpu.calls["nvmlDeviceGetPowerUsage"] == 2


# -- fields the GPU does not support ----------------------------------------------------------


def test_not_supported_fields_are_none_with_reason_never_zero():
    fake = fake_nvml.scenario("not_supported_fields")
    reader = reader_for(fake, slow_refresh_s=0.0)  # slow tier on every read
    for _ in range(3):
        samples, _ = reader.read(set())
    s = samples[0]
    for name in ("power_w", "temperature_c", "pcie_rx_per_s", "pcie_tx_per_s"):
        assert getattr(s, name) is None
        assert s.unavailable[name] == "not supported on this GPU"
    assert s.power_limit_w == 400.0 and s.sm_clock_mhz == 1410.0  # the rest still read
    assert "processes" not in s.unavailable  # graphics list NotSupported: compute list is enough
    # NotSupported does not change while the process runs: asked once, then remembered.
    assert fake.gpus[0].calls["nvmlDeviceGetPowerUsage"] == 1
    assert fake.gpus[0].calls["nvmlDeviceGetPcieThroughput"] == 2  # rx and tx, once each


def test_unreadable_compute_process_list_is_reported():
    gpu = fake_nvml.FakeGpu(not_supported={"nvmlDeviceGetComputeRunningProcesses_v3"})
    samples, procs = reader_for(fake_nvml.FakeNvml([gpu])).read(set())
    assert procs == []
    assert samples[0].unavailable["processes"] == "compute processes: not supported on this GPU"


def test_device_without_permission_is_listed_with_the_reason_and_others_read():
    fake = fake_nvml.scenario("two_gpus")
    fake.gpus[1].errors["nvmlDeviceGetHandleByIndex"] = fake_nvml.NVML_ERROR_NO_PERMISSION
    reader = reader_for(fake)
    assert reader.status.available is True
    info = reader.status.gpus[1]
    assert (info.name, info.uuid, info.memory_total) == ("GPU 1", None, None)
    assert info.unavailable["name"] == "no permission to read this from NVML"
    samples, _ = reader.read(set())
    assert samples[0].memory_used == GIB
    assert samples[1].memory_used is None
    assert samples[1].unavailable["memory_used"] == "no permission to read this from NVML"


def test_transient_error_is_reported_then_read_again():
    fake = fake_nvml.scenario("two_gpus")
    gpu = fake.gpus[0]
    gpu.utilization_gpu = 55
    gpu.errors["nvmlDeviceGetUtilizationRates"] = fake_nvml.NVML_ERROR_UNKNOWN
    reader = reader_for(fake)
    first = reader.read(set())[0][0]
    assert first.utilization_gpu is None
    assert first.unavailable["utilization_gpu"] == "unknown NVML error"
    assert first.memory_used == GIB  # the rest of the device still read
    del gpu.errors["nvmlDeviceGetUtilizationRates"]
    second = reader.read(set())[0][0]
    assert (second.utilization_gpu, second.unavailable) == (55.0, {})


# -- a GPU lost mid-run -----------------------------------------------------------------------


def test_lost_gpu_is_reported_lost_while_the_other_keeps_working():
    fake = fake_nvml.scenario("gpu_lost_mid_run", lost_after_calls=40)  # C calls: 1+ reads
    fake.gpus[1].compute_processes = [(os.getpid(), GIB)]
    reader = reader_for(fake, slow_refresh_s=0.0)
    history = [reader.read({os.getpid()}) for _ in range(6)]

    before, procs_before = history[0]
    assert before[1].memory_used == GIB and before[1].unavailable == {}
    assert [p.gpu_index for p in procs_before] == [1]

    lost_at = next(i for i, (s, _) in enumerate(history) if s[1].unavailable)
    assert 0 < lost_at < 5
    calls_when_lost = sum(fake.gpus[1].calls.values())
    for samples, procs in history[lost_at:]:
        assert [s.index for s in samples] == [0, 1]
        lost = samples[1]
        assert lost.uuid == fake.gpus[1].uuid
        assert lost.memory_used is None and lost.utilization_gpu is None and lost.power_w is None
        assert set(lost.unavailable.values()) == {"GPU is lost"}
        assert "memory_used" in lost.unavailable and "power_w" in lost.unavailable
        assert samples[0].memory_used == GIB and samples[0].unavailable == {}
        assert procs == []
    more, _ = reader.read(set())
    assert more[1].unavailable["utilization_gpu"] == "GPU is lost"
    assert sum(fake.gpus[1].calls.values()) == calls_when_lost  # a lost GPU is not asked again


# -- processes: real PIDs, the job and outsiders ----------------------------------------------


def test_process_memory_dedupes_compute_and_graphics_and_keeps_unknowns_unknown():
    fake = fake_nvml.scenario("two_gpus")
    me = os.getpid()
    fake.gpus[0].compute_processes = [(me, 3 * GIB), (me + 1, None)]
    fake.gpus[0].graphics_processes = [(me, 3 * GIB)]  # same process, both contexts
    _, procs = reader_for(fake).read({me})
    by_pid = {p.pid: p for p in procs}
    assert len(procs) == 2
    assert (by_pid[me].used_memory, by_pid[me].in_job, by_pid[me].local_pid) == (3 * GIB, True, me)
    assert by_pid[me + 1].used_memory is None  # NVML_VALUE_NOT_AVAILABLE, not 0
    assert by_pid[me + 1].in_job is False


def test_job_gpu_memory_joined_to_real_processes_through_the_sampler(job_tree, outsider):
    fake = fake_nvml.scenario("foreign_process")
    trainer, worker = job_tree.trainer.pid, job_tree.worker_pid
    fake.gpus[0].compute_processes = [(trainer, 6 * GIB), (outsider.pid, 2 * GIB)]
    fake.gpus[0].graphics_processes = [(worker, 300 * MIB)]
    job = JobReader(trainer)
    gpus = reader_for(fake)
    try:
        snap = Sampler(None, job, gpus).snapshot()
    finally:
        job.close()
        gpus.close()

    memory = {p.pid: p.gpu_memory for p in snap.processes}
    assert memory == {trainer: 6 * GIB, worker: 300 * MIB}
    foreign = [gp for gp in snap.gpu_processes if gp.pid == outsider.pid]
    assert len(foreign) == 1
    assert foreign[0].in_job is False and foreign[0].used_memory == 2 * GIB
    assert {gp.pid for gp in snap.gpu_processes if gp.in_job} == {trainer, worker}


@engine(
    "root",
    None
    if os.geteuid() == 0 and shutil.which("unshare")
    else "creating a PID namespace needs root and util-linux unshare",
)
def test_own_pid_namespace_leaves_nvml_pids_unresolved():
    # Inside a fresh PID namespace (as in a container) NVML's host PIDs cannot be mapped:
    # the reader must say so, not match them against the namespace's own small PIDs.
    script = f"""
import json, os, sys
sys.path.insert(0, {str(TESTS_DIR)!r})
import fake_nvml
from torchdoctor.sampling.gpus import GpuReader
fake = fake_nvml.scenario("foreign_process")
fake.gpus[0].compute_processes = [(os.getpid(), 1 << 30)]
reader = GpuReader(fake)
_, procs = reader.read({{os.getpid()}})
print(json.dumps({{"pid": os.getpid(), "unresolved": reader.status.process_pids_unresolved,
    "procs": [[p.pid, p.local_pid, p.in_job, p.used_memory] for p in procs]}}))
"""
    done = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if done.returncode != 0 and "unshare failed" in done.stderr:
        require_engine("PID namespaces", f"not allowed here: {done.stderr.strip()}")
    require_engine("PID namespaces", None)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["pid"] == 1
    assert "PID namespace" in result["unresolved"]
    assert result["procs"] == [[1, None, False, 1 << 30]]


# -- hardware errors: ECC counters and Xid events -------------------------------------------


def test_ecc_counts_and_xid_events_are_read_each_once():
    gpu = fake_nvml.FakeGpu(ecc_volatile=(12, 0), xids=[13])  # an Xid before we looked
    fake = fake_nvml.FakeNvml([gpu, fake_nvml.FakeGpu(uuid="GPU-other")])
    reader = reader_for(fake, slow_refresh_s=0.0)
    first, _ = reader.read(set())
    assert (first[0].ecc_corrected, first[0].ecc_uncorrected) == (12, 0)
    assert first[0].xid_errors == [] and first[0].xid_count == 0  # events from now on
    gpu.xids += [79, 48]  # fallen off the bus; a double-bit ECC error
    gpu.ecc_volatile = (12, 1)
    second, _ = reader.read(set())
    assert second[0].xid_errors == [79, 48] and second[0].xid_count == 2
    assert second[0].ecc_uncorrected == 1
    assert second[1].xid_errors == [] and second[1].xid_count == 0
    third, _ = reader.read(set())
    assert third[0].xid_errors == [] and third[0].xid_count == 2  # each event once
    reader.close()


def test_ecc_not_supported_is_none_with_the_reason():
    gpu = fake_nvml.FakeGpu(not_supported={"nvmlDeviceGetTotalEccErrors"})
    reader = reader_for(fake_nvml.FakeNvml([gpu]), slow_refresh_s=0.0)
    (sample,), _ = reader.read(set())
    assert sample.ecc_corrected is None and sample.ecc_uncorrected is None
    assert sample.unavailable["ecc_uncorrected"] == "not supported on this GPU"
    reader.close()
