"""The fake libnvidia-ml.so.1 (tests/nvml/fake_nvml.c) under the real nvidia-ml-py.

Each test runs a child process whose plain ``import pynvml`` finds the library through
LD_LIBRARY_PATH, as it would find a driver's, so the bindings' own loader, ctypes structures,
size protocol and error classes are what is exercised.
"""

from __future__ import annotations

import ast
import inspect
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pynvml

from tests import fake_nvml
from tests.conftest import REPO
from tests.fake_nvml import GIB, FakeGpu

PY = sys.executable


def in_child(code: str, scenario: Path | None, timeout: float = 60) -> dict:
    """Run ``code`` (which sets ``out``) in a child that loads the fake; its ``out`` as JSON."""
    program = (
        "import json, pynvml\nout = {}\n" + textwrap.dedent(code) + "\nprint(json.dumps(out))\n"
    )
    done = subprocess.run(
        [PY, "-c", program],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=fake_nvml.subprocess_env(scenario),
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def product_nvml_functions() -> set[str]:
    """Every pynvml function name the product calls (the string literals starting 'nvml')."""
    names = set()
    for path in (REPO / "src" / "torchdoctor").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            value = node.value if isinstance(node, ast.Constant) else None
            named = isinstance(value, str) and re.fullmatch(r"nvml[A-Z]\w+", value)
            if named and callable(getattr(pynvml, value, None)):
                names.add(value)
    return names


def c_symbols(function_name: str, seen: set[str] | None = None) -> set[str]:
    """The C entry points a pynvml wrapper resolves, following the wrappers it calls."""
    seen = set() if seen is None else seen
    if function_name in seen:
        return set()
    seen.add(function_name)
    source = inspect.getsource(inspect.unwrap(getattr(pynvml, function_name)))
    symbols = set(re.findall(r'_nvmlGetFunctionPointer\("(\w+)"\)', source))
    for called in re.findall(r"\b(nvml\w+)\(", source):
        if called != function_name and callable(getattr(pynvml, called, None)):
            symbols |= c_symbols(called, seen)
    return symbols


def test_builds_with_the_plain_command_and_exports_every_entry_point_the_product_calls():
    library = fake_nvml.library_dir() / "libnvidia-ml.so.1"
    assert library.stat().st_size > 0
    import ctypes

    lib = ctypes.CDLL(str(library))
    called = product_nvml_functions()
    assert {
        "nvmlInit",
        "nvmlDeviceGetComputeRunningProcesses_v3",
        "nvmlDeviceGetMemoryInfo",
    } <= called
    needed = set().union(*(c_symbols(name) for name in called | {"nvmlInit", "nvmlShutdown"}))
    needed |= {"nvmlErrorString", "nvmlEventSetCreate", "nvmlDeviceRegisterEvents",
               "nvmlEventSetWait_v2", "nvmlEventSetFree", "nvmlDeviceGetTotalEccErrors"}  # fmt: skip
    missing = sorted(name for name in needed if not hasattr(lib, name))
    assert not missing, f"the fake lacks {missing}"


def test_without_a_scenario_one_healthy_gpu():
    out = in_child(
        """
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        m = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
        out = {"count": pynvml.nvmlDeviceGetCount(), "name": pynvml.nvmlDeviceGetName(h),
               "total": m.total, "free": m.free, "reserved": m.reserved, "used": m.used,
               "procs": len(pynvml.nvmlDeviceGetComputeRunningProcesses(h)),
               "reasons": pynvml.nvmlDeviceGetCurrentClocksEventReasons(h),
               "lib": pynvml.nvmlLib._name}
        """,
        None,
    )
    assert out["count"] == 1 and out["name"].startswith("NVIDIA")
    assert out["total"] == out["free"] + out["reserved"] + out["used"]
    assert out["procs"] == 0 and out["reasons"] == pynvml.nvmlClocksEventReasonGpuIdle
    assert out["lib"] == "libnvidia-ml.so.1"  # loaded by name, as from a driver


def test_two_gpus_with_real_processes_in_v3_structs_and_samples_that_change(tmp_path):
    holder = subprocess.Popen([PY, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        gpus = [
            FakeGpu(uuid="GPU-aaaaaaaa-0000-4000-8000-000000000000", utilization_gpu=[10, 55, 95],
                    compute_processes=[(holder.pid, 3 * GIB), (4_000_000, None)], memory_used=None,
                    numa_node=1, pci_bus=0x41, nvlinks=[1, None]),
            FakeGpu(uuid="GPU-aaaaaaaa-0000-4000-8000-000000000001", nvlinks=[0, None]),
        ]  # fmt: skip
        scenario = fake_nvml.write_scenario(tmp_path / "s.nvml", gpus)
        out = in_child(
            """
            pynvml.nvmlInit()
            h = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses_v3(h[0])
            out["procs"] = [[p.pid, p.usedGpuMemory] for p in procs]
            out["util"] = [pynvml.nvmlDeviceGetUtilizationRates(h[0]).gpu for _ in range(4)]
            out["used_v2"] = pynvml.nvmlDeviceGetMemoryInfo(h[0], version=pynvml.nvmlMemory_v2).used
            out["numa"] = pynvml.nvmlDeviceGetNumaNodeId(h[0])
            out["bus"] = pynvml.nvmlDeviceGetPciInfo_v3(h[0]).busId
            out["peer"] = pynvml.nvmlDeviceGetNvLinkRemotePciInfo(h[0], 0).busId
            out["link1"] = pynvml.nvmlDeviceGetNvLinkState(h[0], 1)
            out["uuid1"] = pynvml.nvmlDeviceGetUUID(h[1])
            try:
                pynvml.nvmlDeviceGetNumaNodeId(h[1])
            except pynvml.NVMLError_NotSupported as e:
                out["numa1"] = str(e)
            """,
            scenario,
        )
    finally:
        holder.stdin.close()
        holder.wait()
    assert out["procs"] == [[holder.pid, 3 * GIB], [4_000_000, None]]  # "not available" -> None
    assert out["util"] == [10, 55, 95, 95]  # one item a sample, the last repeats
    assert out["used_v2"] == 3 * GIB  # what the processes hold
    assert out["numa"] == 1 and out["bus"] == "00000000:41:00.0"
    assert out["peer"] == "00000000:08:00.0" and out["link1"] == 0
    assert out["uuid1"].endswith("0001") and out["numa1"] == "Not Supported"


def test_failures_version_mismatch_lost_gpu_not_supported(tmp_path):
    mismatch = fake_nvml.write_scenario(
        tmp_path / "m.nvml", [FakeGpu()], init_error=fake_nvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH
    )
    out = in_child(
        """
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            out = {"cls": type(e).__name__, "text": str(e)}
        """,
        mismatch,
    )
    assert out == {"cls": "NVMLError_LibRmVersionMismatch",
                   "text": "RM has detected an NVML/RM version mismatch."}  # fmt: skip
    gpu = FakeGpu(
        lost_after_calls=3, not_supported={"nvmlDeviceGetPowerUsage"}, pcie_counters=False
    )
    flaky = fake_nvml.write_scenario(tmp_path / "f.nvml", [gpu])
    out = in_child(
        """
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)          # call 1
        try:
            pynvml.nvmlDeviceGetPowerUsage(h)             # call 2
        except pynvml.NVMLError_NotSupported:
            out["power"] = "not supported"
        f = pynvml.nvmlDeviceGetFieldValues(h, [pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES])  # 3
        out["field"] = f[0].nvmlReturn
        try:
            pynvml.nvmlDeviceGetUtilizationRates(h)       # call 4: past the last good one
        except pynvml.NVMLError_GpuIsLost as e:
            out["lost"] = str(e)
        """,
        flaky,
    )
    assert out == {"power": "not supported", "field": pynvml.NVML_ERROR_NOT_SUPPORTED,
                   "lost": "GPU is lost"}  # fmt: skip


def test_xid_events_and_ecc_counters_and_a_scenario_rewritten_while_running(tmp_path):
    gpu = FakeGpu(ecc_volatile=(4, 1), ecc_aggregate=(40, 2))
    path = tmp_path / "x.nvml"
    fake_nvml.write_scenario(path, [gpu])
    child = subprocess.Popen(
        [PY, "-c", textwrap.dedent("""
            import json, sys, pynvml
            pynvml.nvmlInit()
            h = pynvml.nvmlDeviceGetHandleByIndex(0)
            s = pynvml.nvmlEventSetCreate()
            pynvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, s)
            try:
                pynvml.nvmlEventSetWait(s, 0)
            except pynvml.NVMLError_Timeout:
                print("none yet", flush=True)
            sys.stdin.readline()
            e = pynvml.nvmlEventSetWait(s, 5000)
            ecc = [pynvml.nvmlDeviceGetTotalEccErrors(h, kind, counter)
                   for kind in (0, 1) for counter in (0, 1)]
            print(json.dumps({"xid": e.eventData, "type": e.eventType, "ecc": ecc}), flush=True)
            pynvml.nvmlEventSetFree(s)
        """)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=fake_nvml.subprocess_env(path),
    )  # fmt: skip
    try:
        assert child.stdout.readline().strip() == "none yet"
        gpu.xids.append(79)  # "GPU has fallen off the bus", while the child waits
        fake_nvml.write_scenario(path, [gpu])
        child.stdin.write("go\n")
        child.stdin.flush()
        out = json.loads(child.stdout.readline())
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    assert out == {"xid": 79, "type": pynvml.nvmlEventTypeXidCriticalError, "ecc": [4, 40, 1, 2]}


def test_a_stub_banner_comes_from_the_scenario_not_the_library():
    # The product takes a library holding the stub's banner for the CUDA stub: ours must not.
    library = fake_nvml.library_dir() / "libnvidia-ml.so.1"
    assert b"is a stub library" not in library.read_bytes()
