"""The fake GPUs of torchdoctor's tests: a fake libnvidia-ml.so.1 in C, driven from Python.

Why a fake: the test machines and CI have no NVIDIA GPU and no driver, so the real NVML can
only ever show its "no driver" path. The fake sits at the C ABI (tests/nvml/fake_nvml.c, built
here with the system compiler), under the real bindings (nvidia-ml-py, ``import pynvml``): their
ctypes structures and versions, the two-call size protocol and the NVMLError classes run as they
do against a driver. Only the driver is simulated; everything else in the suite is real.

Two ways in:

- In a test process, :class:`FakeNvml` is a private copy of the installed ``pynvml`` module
  whose library is a private copy of the fake (so each test's machine has its own state). Its
  :class:`FakeGpu` objects are the machine: a test changes them between reads and the next
  call writes them to the scenario file the C library re-reads. ``calls``/``gpus[i].calls``
  count what the code under test asked, by pynvml function name.
- For a child process (``torchdoctor run``, the queue's scheduler, the exporter),
  :func:`subprocess_env` puts the library on ``LD_LIBRARY_PATH`` and names a scenario file in
  ``TORCHDOCTOR_FAKE_NVML_SCENARIO``: the child's own ``import pynvml`` loads the fake.
  :func:`write_scenario` renders a machine to that file; the shared machine of the queue tests
  (:func:`write_machine`, :func:`allocate`) is one too.

Named scenarios: see :func:`scenario` and ``SCENARIOS``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import types
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pynvml as _real_pynvml

SOURCE = Path(__file__).resolve().parent / "nvml" / "fake_nvml.c"
SCENARIO_ENV = "TORCHDOCTOR_FAKE_NVML_SCENARIO"
LIBRARY = "libnvidia-ml.so.1"

# The bindings' constants (return codes, field ids, reason bits, topology levels), so tests
# name them as code written against pynvml does.
globals().update(
    {
        name: value
        for name, value in vars(_real_pynvml).items()
        if name.startswith(("NVML_", "nvmlClocksEventReason", "nvmlClocksThrottleReason"))
        or name in ("nvmlMemory_v2", "nvmlTemperature_v1")
    }
)
NVML_ERROR_GPU_IS_LOST = _real_pynvml.NVML_ERROR_GPU_IS_LOST  # named for linters and readers
NVML_ERROR_NOT_SUPPORTED = _real_pynvml.NVML_ERROR_NOT_SUPPORTED
NVML_ERROR_NO_PERMISSION = _real_pynvml.NVML_ERROR_NO_PERMISSION
NVML_ERROR_UNKNOWN = _real_pynvml.NVML_ERROR_UNKNOWN
NVML_ERROR_DRIVER_NOT_LOADED = _real_pynvml.NVML_ERROR_DRIVER_NOT_LOADED
NVML_ERROR_LIB_RM_VERSION_MISMATCH = _real_pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH
NVML_TOPOLOGY_SINGLE = _real_pynvml.NVML_TOPOLOGY_SINGLE
NVML_TOPOLOGY_HOSTBRIDGE = _real_pynvml.NVML_TOPOLOGY_HOSTBRIDGE
NVML_TOPOLOGY_NODE = _real_pynvml.NVML_TOPOLOGY_NODE
NVML_TOPOLOGY_SYSTEM = _real_pynvml.NVML_TOPOLOGY_SYSTEM
NVML_P2P_STATUS_GPU_NOT_SUPPORTED = _real_pynvml.NVML_P2P_STATUS_GPU_NOT_SUPPORTED
NVML_P2P_STATUS_IOH_TOPOLOGY_NOT_SUPPORTED = _real_pynvml.NVML_P2P_STATUS_IOH_TOPOLOGY_NOT_SUPPORTED
nvmlClocksEventReasonGpuIdle = _real_pynvml.nvmlClocksEventReasonGpuIdle

# What the CUDA toolkit's stub libnvidia-ml prints on nvmlInit (kept out of the C file: a
# library holding this text is what the product takes for a stub).
STUB_BANNER = (
    "\n!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!\n"
    "WARNING:\n\n"
    "You should always run with libnvidia-ml.so that is installed with your\n"
    "NVIDIA Display Driver. By default it's installed in /usr/lib and /usr/lib64.\n"
    "libnvidia-ml.so in GDK package is a stub library that is attached only for\n"
    "build purposes (e.g. machine that you build your application doesn't have\n"
    "to have Display Driver installed).\n"
    "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!\n"
)

GIB = 1024**3
MIB = 1024**2


# -- the library ------------------------------------------------------------------------------


@functools.cache
def library_dir() -> Path:
    """The folder holding the built fake ``libnvidia-ml.so.1``: built once per source text
    (a cache folder named by its hash), with ``cc -shared -fPIC`` and nothing else."""
    compiler = shutil.which("cc")
    why_missing = (
        None if compiler else "no C compiler for the fake libnvidia-ml (apt-get install gcc)"
    )
    try:  # in a pytest run: skip, or fail on CI; in a helper process: say why
        from tests.helpers.engines import require_engine
    except ImportError:
        if why_missing:
            raise RuntimeError(why_missing) from None
    else:
        require_engine("cc", why_missing)
    assert compiler is not None
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    folder = Path(tempfile.gettempdir()) / f"torchdoctor-fake-nvml-{digest}"
    target = folder / LIBRARY
    if not target.exists():
        folder.mkdir(parents=True, exist_ok=True)
        partial = folder / f".{LIBRARY}.{os.getpid()}"
        done = subprocess.run(
            [compiler, "-shared", "-fPIC", "-o", str(partial), str(SOURCE)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise RuntimeError(f"building the fake libnvidia-ml failed:\n{done.stderr}")
        os.replace(partial, target)  # parallel builders: the last complete one wins
    return folder


def subprocess_env(
    scenario_path: str | os.PathLike | None, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """An environment whose processes load the fake NVML (``None``: one healthy GPU)."""
    env = dict(os.environ if base is None else base)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        [str(library_dir()), *filter(None, [env.get("LD_LIBRARY_PATH")])]
    )
    if scenario_path is None:
        env.pop(SCENARIO_ENV, None)
    else:
        env[SCENARIO_ENV] = str(scenario_path)
    return env


_scratch = tempfile.TemporaryDirectory(prefix="torchdoctor-fake-nvml-")
_numbers = itertools.count()


@functools.cache
def _pynvml_code() -> types.CodeType:
    path = _real_pynvml.__file__
    return compile(Path(path).read_text(encoding="utf-8"), path, "exec")


def private_pynvml(scenario_path: str | os.PathLike) -> tuple[types.ModuleType, ctypes.CDLL]:
    """A fresh copy of the installed ``pynvml`` over a fresh copy of the fake library, reading
    ``scenario_path``. Fresh, because pynvml keeps its library, its refcount and its function
    pointers in module globals and a loaded library keeps its state: one copy of each per
    simulated machine keeps tests apart. pynvml loads it itself, by name, from our folder."""
    n = next(_numbers)
    folder = Path(_scratch.name) / f"lib{n}"
    folder.mkdir()
    shutil.copyfile(library_dir() / LIBRARY, folder / LIBRARY)  # a new file: a new dlopen
    lib = ctypes.CDLL(str(folder / LIBRARY))
    lib.fakeNvmlSetScenario.argtypes = [ctypes.c_char_p]
    lib.fakeNvmlSetScenario(os.fsencode(scenario_path))
    lib.fakeNvmlHandleIndex.argtypes = [ctypes.c_void_p]
    # pynvml attaches its generated error classes to sys.modules[__name__]: a name of its own.
    module = types.ModuleType(f"pynvml_over_fake_nvml_{n}")
    module.__file__ = _real_pynvml.__file__
    sys.modules[module.__name__] = module
    exec(_pynvml_code(), module.__dict__)

    def cdll(name: str, *args: Any, **kwargs: Any) -> ctypes.CDLL:
        return ctypes.CDLL(str(folder / name) if "/" not in name else name, *args, **kwargs)

    module.CDLL = cdll  # type: ignore[attr-defined]  # pynvml: CDLL("libnvidia-ml.so.1")
    return module, lib


def scratch_path(suffix: str) -> Path:
    return Path(_scratch.name) / f"{next(_numbers)}{suffix}"


# A value read once a sample may be given as a list: the k-th read gives the k-th item.
Samples = int | list[int]


@dataclass
class FakeGpu:
    """The state of one simulated device; tests change it between reads."""

    name: str = "NVIDIA A100-SXM4-80GB"
    uuid: str = "GPU-3b1f6c52-0d7e-4b8e-9a51-8f6a3a1c0000"
    compute_capability: tuple[int, int] = (8, 0)
    memory_total: int = 80 * GIB
    memory_reserved: int = 512 * MIB
    # held by processes (v2 "used"; v1 adds the reserved part); None: the sum of the processes
    memory_used: Samples | None = 1 * GIB
    utilization_gpu: Samples = 0
    utilization_memory: Samples = 0
    power_mw: Samples = 61_000
    power_limit_mw: int = 400_000
    temperature_c: Samples = 34
    sm_clock_mhz: Samples = 1410
    clock_event_reasons: Samples = 0x1  # nvmlClocksEventReasonGpuIdle
    pcie_rx_kb: Samples = 0  # nvmlDeviceGetPcieThroughput, KB/s over its 20 ms window
    pcie_tx_kb: Samples = 0
    pcie_counters: bool = True  # NVML_FI_DEV_PCIE_COUNT_*_BYTES (recent drivers)
    pcie_rx_bytes: int = 7_000_000_000  # byte counters since the driver loaded
    pcie_tx_bytes: int = 3_000_000_000
    # (host pid, used bytes or None when NVML says "not available")
    compute_processes: list[tuple[int, int | None]] = field(default_factory=list)
    graphics_processes: list[tuple[int, int | None]] = field(default_factory=list)
    # pynvml function names answering NotSupported on this device
    not_supported: set[str] = field(default_factory=set)
    # pynvml function name -> NVML_ERROR_* code it raises on this device, while present
    errors: dict[str, int] = field(default_factory=dict)
    lost_after_calls: int | None = None  # GPU falls off the bus after this many calls
    numa_node: int | None = None  # None: NotSupported (one-node machines, older drivers)
    # Placement on the bus and near the CPUs. ``pci_bus`` None: 0x07 + index, as slots go.
    pci_bus: int | None = None
    cpu_affinity: list[int] = field(default_factory=lambda: list(range(8)))  # "ideal" CPUs
    # NVLinks of this device, one entry per link: the peer GPU's index, "switch" for a link to
    # an NVSwitch, None for an inactive link. Empty: a PCIe-only GPU (NotSupported).
    nvlinks: list[int | str | None] = field(default_factory=list)
    # ECC error counts (corrected, uncorrected): since the driver loaded / over the lifetime
    ecc_volatile: tuple[int, int] = (0, 0)
    ecc_aggregate: tuple[int, int] = (0, 0)
    xids: list[int] = field(default_factory=list)  # Xid errors, in the order they happen
    calls: Counter = field(default_factory=Counter)


def _samples(value: Samples) -> str:
    return ",".join(str(v) for v in value) if isinstance(value, list) else str(value)


def render_gpu(gpu: FakeGpu) -> list[str]:
    lines = [
        "gpu",
        f"name {gpu.name}",
        f"uuid {gpu.uuid}",
        f"compute_capability {gpu.compute_capability[0]} {gpu.compute_capability[1]}",
        f"memory_total {gpu.memory_total}",
        f"memory_reserved {gpu.memory_reserved}",
        f"power_limit_mw {gpu.power_limit_mw}",
        f"pcie_rx_bytes {gpu.pcie_rx_bytes}",
        f"pcie_tx_bytes {gpu.pcie_tx_bytes}",
        f"cpu_affinity {','.join(map(str, gpu.cpu_affinity)) or 'none'}",
        f"ecc_volatile {gpu.ecc_volatile[0]} {gpu.ecc_volatile[1]}",
        f"ecc_aggregate {gpu.ecc_aggregate[0]} {gpu.ecc_aggregate[1]}",
    ]
    for key in ("utilization_gpu", "utilization_memory", "power_mw", "temperature_c",
                "sm_clock_mhz", "clock_event_reasons", "pcie_rx_kb", "pcie_tx_kb"):  # fmt: skip
        lines.append(f"{key} {_samples(getattr(gpu, key))}")
    if gpu.memory_used is not None:
        lines.append(f"memory_used {_samples(gpu.memory_used)}")
    if not gpu.pcie_counters:
        lines.append("no_pcie_counters")
    for kind, listed in (
        ("process", gpu.compute_processes),
        ("graphics_process", gpu.graphics_processes),
    ):
        lines += [f"{kind} {pid} {'na' if used is None else used}" for pid, used in listed]
    lines += [f"not_supported {name}" for name in sorted(gpu.not_supported)]
    lines += [f"error {name} {code}" for name, code in sorted(gpu.errors.items())]
    lines += [f"xid {code}" for code in gpu.xids]
    if gpu.lost_after_calls is not None:
        lines.append(f"lost_after_calls {gpu.lost_after_calls}")
    if gpu.numa_node is not None:
        lines.append(f"numa_node {gpu.numa_node}")
    if gpu.pci_bus is not None:
        lines.append(f"pci_bus {gpu.pci_bus:#x}")
    if gpu.nvlinks:
        words = ["none" if p is None else str(p) for p in gpu.nvlinks]
        lines.append(f"nvlink {' '.join(words)}")
    return lines


def render(
    gpus: list[FakeGpu],
    *,
    init_error: int | None = None,
    init_banner: str | None = None,
    driver_version: str = "550.54.15",
    cuda_driver_version: int = 12040,
    nvml_version: str = "12.550.54.15",
    has_memory_v2: bool = True,
    topology: Mapping[tuple[int, int], int] | None = None,
    p2p: Mapping[tuple[int, int], int] | None = None,
    drop_exited_processes: bool = False,
) -> str:
    """The scenario file for a machine (the format is described in tests/nvml/fake_nvml.c)."""
    lines = [f"driver {driver_version}", f"nvml {nvml_version}", f"cuda {cuda_driver_version}"]
    if init_error is not None:
        lines.append(f"init_error {init_error}")
    if init_banner:
        lines.append("init_banner " + init_banner.replace("\n", "\\n"))
    if not has_memory_v2:
        lines.append("no_memory_v2")
    if drop_exited_processes:
        lines.append("drop_exited_processes")
    lines += [f"topology {a} {b} {level}" for (a, b), level in (topology or {}).items()]
    lines += [f"p2p {a} {b} {status}" for (a, b), status in (p2p or {}).items()]
    for gpu in gpus:
        lines += render_gpu(gpu)
    return "\n".join(lines) + "\n"


def write_scenario(path: str | os.PathLike, gpus: list[FakeGpu], **machine: Any) -> Path:
    """Write a machine to ``path`` for child processes (atomically: a reader never sees half)."""
    _write_atomic(str(path), render(gpus, **machine))
    return Path(path)


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


class FakeNvml(types.ModuleType):
    """The real ``pynvml`` over the fake library; ``gpus`` is the simulated machine."""

    def __init__(
        self,
        gpus: list[FakeGpu],
        *,
        init_error: int | None = None,
        init_banner: str | None = None,
        driver_version: str = "550.54.15",
        cuda_driver_version: int = 12040,
        nvml_version: str = "12.550.54.15",
        has_memory_v2: bool = True,
        topology: dict[tuple[int, int], int] | None = None,
        p2p: dict[tuple[int, int], int] | None = None,
    ) -> None:
        super().__init__("pynvml")
        self.gpus = gpus
        self.machine = {
            "init_error": init_error,
            "init_banner": init_banner,
            "driver_version": driver_version,
            "cuda_driver_version": cuda_driver_version,
            "nvml_version": nvml_version,
            "has_memory_v2": has_memory_v2,
            "topology": topology or {},
            "p2p": p2p or {},
        }
        self.scenario_path = scratch_path(".nvml")
        self._written = ""
        self.sync()
        self.bindings, self._lib = private_pynvml(self.scenario_path)
        self.__file__ = self.bindings.__file__
        self.init_calls = 0
        self.calls: Counter = Counter()  # every function but nvmlInit, all devices

    @property
    def refcount(self) -> int:
        return self.bindings._nvmlLib_refcount

    def sync(self) -> None:
        """Write the machine as it is now, if a test changed it since the last call."""
        text = render(self.gpus, **self.machine)
        if text != self._written:
            _write_atomic(str(self.scenario_path), text)
            self._written = text

    def _device_index(self, value: Any) -> int | None:
        if isinstance(value, ctypes._Pointer):
            index = self._lib.fakeNvmlHandleIndex(value)
            return index if 0 <= index < len(self.gpus) else None
        return None

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.__dict__["bindings"], name)
        if not (
            name.startswith("nvml") and callable(value) and isinstance(value, types.FunctionType)
        ):
            return value

        @functools.wraps(value)
        def call(*args: Any, **kwargs: Any) -> Any:
            self.sync()
            if name.startswith("nvmlInit"):
                self.init_calls += 1
            else:
                self.calls[name] += 1
                for arg in args:
                    index = self._device_index(arg)
                    if index is not None:
                        self.gpus[index].calls[name] += 1
            return value(*args, **kwargs)

        return call


SCENARIOS = (
    "no_driver",
    "stub_library",
    "two_gpus",
    "gpu_lost_mid_run",
    "not_supported_fields",
    "foreign_process",
    "two_sockets",
    "nvlink_pair",
    "nvswitch",
    "mixed_models",
)


def scenario(name: str, *, lost_after_calls: int = 40) -> FakeNvml:
    """A fake NVML in one named situation.

    - ``no_driver``: libnvidia-ml loads but the kernel driver is not loaded (nvmlInit fails
      with DriverNotLoaded, as on a machine whose driver failed to build for a new kernel).
    - ``stub_library``: the CUDA toolkit's stub libnvidia-ml was picked up (a container built
      against stubs and run without the NVIDIA runtime): it prints its banner on stdout and
      nvmlInit fails. The code a stub returns is not what identifies it; the banner is.
    - ``two_gpus``: two healthy A100s, nothing running.
    - ``gpu_lost_mid_run``: two GPUs; device 1 falls off the bus (GpuIsLost on every call)
      after ``lost_after_calls`` calls to it.
    - ``not_supported_fields``: one virtual/consumer GPU where power, temperature, PCIe
      throughput (counters and sampled) and the graphics process list are NotSupported.
    - ``foreign_process``: one GPU; tests put a process outside the job on it.
    - ``two_sockets``: four PCIe L40S, two per CPU socket (NUMA nodes 0 and 1, CPUs 0-15 and
      16-31); pairs on one socket share a PCIe switch (PIX), pairs across sockets are SYS and
      P2P between them fails with "IOH topology not supported"; no NVLink.
    - ``nvlink_pair``: two H100 NVL joined by 12 NVLinks (a bridge), on one NUMA node.
    - ``nvswitch``: an HGX H100 board: eight GPUs, each with 18 NVLinks to NVSwitches, four
      per socket.
    - ``mixed_models``: an RTX 3060 (PCI order 0) and an RTX 4090 (1), so CUDA's
      fastest-first order differs from NVML's; P2P is not supported on these GeForce cards.
    """
    if name == "no_driver":
        return FakeNvml([], init_error=NVML_ERROR_DRIVER_NOT_LOADED)
    if name == "stub_library":
        return FakeNvml([], init_error=NVML_ERROR_UNKNOWN, init_banner=STUB_BANNER)
    if name == "two_gpus":
        return FakeNvml(_two_a100s())
    if name == "gpu_lost_mid_run":
        gpus = _two_a100s()
        gpus[1].lost_after_calls = lost_after_calls
        return FakeNvml(gpus)
    if name == "not_supported_fields":
        gpu = FakeGpu(
            name="GRID A100D-8C",
            uuid="GPU-7c2a9e10-55d1-4f2e-8b0a-1d2e3f4a5b6c",
            memory_total=8 * GIB,
            pcie_counters=False,
            not_supported={
                "nvmlDeviceGetPowerUsage",
                "nvmlDeviceGetTemperatureV",
                "nvmlDeviceGetTemperature",
                "nvmlDeviceGetPcieThroughput",
                "nvmlDeviceGetGraphicsRunningProcesses_v3",
            },
        )
        return FakeNvml([gpu])
    if name == "foreign_process":
        return FakeNvml([FakeGpu()])
    if name == "two_sockets":
        return _two_sockets()
    if name == "nvlink_pair":
        gpus = [
            FakeGpu(name="NVIDIA H100 NVL", uuid=f"GPU-5e7d2c1a-8f3b-4a6e-9d0c-2b4f6a8c0e1{i}",
                    nvlinks=[1 - i] * 12 + [None] * 6)
            for i in range(2)
        ]  # fmt: skip
        return FakeNvml(gpus, topology={(0, 1): NVML_TOPOLOGY_NODE})
    if name == "nvswitch":
        gpus = [
            FakeGpu(name="NVIDIA H100 80GB HBM3", uuid=f"GPU-9a8b7c6d-1e2f-4a3b-8c4d-5e6f7a8b9c0{i}",
                    nvlinks=["switch"] * 18, numa_node=i // 4,
                    cpu_affinity=list(range(0, 48)) if i < 4 else list(range(48, 96)))
            for i in range(8)
        ]  # fmt: skip
        topology = {
            (a, b): NVML_TOPOLOGY_NODE if a // 4 == b // 4 else NVML_TOPOLOGY_SYSTEM
            for a in range(8)
            for b in range(a + 1, 8)
        }
        return FakeNvml(gpus, topology=topology)
    if name == "mixed_models":
        return FakeNvml(
            [
                FakeGpu(name="NVIDIA GeForce RTX 3060", uuid="GPU-11111111-2222-4333-8444-555555550000",
                        memory_total=12 * GIB),
                FakeGpu(name="NVIDIA GeForce RTX 4090", uuid="GPU-11111111-2222-4333-8444-555555550001",
                        memory_total=24 * GIB),
            ],
            topology={(0, 1): NVML_TOPOLOGY_HOSTBRIDGE},
            p2p={(0, 1): NVML_P2P_STATUS_GPU_NOT_SUPPORTED},
        )  # fmt: skip
    raise ValueError(f"unknown fake NVML scenario {name!r}; known: {', '.join(SCENARIOS)}")


def _two_a100s() -> list[FakeGpu]:
    return [
        FakeGpu(uuid="GPU-3b1f6c52-0d7e-4b8e-9a51-8f6a3a1c0000"),
        FakeGpu(uuid="GPU-3b1f6c52-0d7e-4b8e-9a51-8f6a3a1c0001"),
    ]


# -- one simulated machine shared by several processes ----------------------------------------
#
# The queue's scheduler, each job's recorder and the jobs themselves are separate processes.
# They share one simulated machine: a JSON file (the devices, and the memory each process holds
# on them) that the Python side edits under a lock, rendered after each change to the scenario
# file ``<machine>.nvml`` the C library reads. As with the real driver, a process's memory is
# freed when it exits (its PID is gone or a zombie): the library drops such processes as it
# reads, and :func:`allocate` before it counts what is free. An allocation that does not fit
# fails. The processes see it through :func:`machine_env`.

STATE_ENV = "FAKE_NVML_STATE"


def machine_scenario(path: str) -> str:
    return f"{path}.nvml"


def machine_env(path: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a process on the shared machine: the fake NVML reading it, and the
    machine file for :func:`allocate`."""
    env = subprocess_env(machine_scenario(path), base)
    env[STATE_ENV] = path
    return env


def write_machine(path: str, gpus: list[dict]) -> None:
    """Create the shared machine: one dict per device with ``uuid``, ``memory_total`` and
    optionally ``processes`` ([pid, bytes]) and any other :class:`FakeGpu` setting (``name``,
    ``numa_node``, ``utilization_gpu``, ``clock_event_reasons``, ``xids`` ...). ``memory_used``
    is what the processes hold unless given."""
    with _locked(path):
        _save(path, {"gpus": [{"processes": [], **gpu} for gpu in gpus]})


def allocate(path: str, uuid: str, nbytes: int, pid: int | None = None) -> bool:
    """Have ``pid`` (default: us) allocate ``nbytes`` on the device ``uuid``, as cudaMalloc
    would: False, and nothing held, when the device has less free memory than that."""
    pid = os.getpid() if pid is None else pid
    with _locked(path):
        state = _load(path)
        gpu = next((g for g in state["gpus"] if g["uuid"] == uuid), None)
        if gpu is None:
            raise KeyError(f"no GPU {uuid} in the fake machine")
        _drop_exited(gpu)
        if _free(gpu) < nbytes:
            return False
        gpu["processes"].append([pid, nbytes])
        _save(path, state)
        return True


def update_gpu(path: str, uuid: str, **settings: Any) -> None:
    """Change :class:`FakeGpu` settings of one device of the shared machine while it runs
    (``xids=[79]``: an Xid event happens now; ``ecc_volatile=(0, 2)``...)."""
    with _locked(path):
        state = _load(path)
        gpu = next((g for g in state["gpus"] if g["uuid"] == uuid), None)
        if gpu is None:
            raise KeyError(f"no GPU {uuid} in the fake machine")
        gpu.update(settings)
        _save(path, state)


def release(path: str, pid: int) -> None:
    """Free everything ``pid`` holds (a process that is still running, e.g. another user's)."""
    with _locked(path):
        state = _load(path)
        for gpu in state["gpus"]:
            gpu["processes"] = [p for p in gpu["processes"] if p[0] != pid]
        _save(path, state)


def _machine_gpus(state: dict) -> list[FakeGpu]:
    known = set(FakeGpu.__dataclass_fields__) - {"compute_processes", "calls"}
    gpus = []
    for gpu in state["gpus"]:
        settings = {k: v for k, v in gpu.items() if k in known}
        settings = {"name": "NVIDIA A100-PCIE-40GB", "memory_used": None, **settings}
        compute = [(pid, n) for pid, n in gpu["processes"]]
        gpus.append(FakeGpu(**settings, compute_processes=compute))
    return gpus


def _free(gpu: dict) -> int:
    held = sum(n for _, n in gpu["processes"])
    return gpu["memory_total"] - gpu.get("memory_reserved", 512 * MIB) - held


def _drop_exited(gpu: dict) -> None:
    gpu["processes"] = [p for p in gpu["processes"] if _running(p[0])]


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] not in (b"Z", b"X")


def _load(path: str) -> dict:
    import json

    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _save(path: str, state: dict) -> None:
    import json

    _write_atomic(path, json.dumps(state))
    _write_atomic(machine_scenario(path), render(_machine_gpus(state), drop_exited_processes=True))


class _locked:
    def __init__(self, path: str) -> None:
        self.lock_path = f"{path}.lock"

    def __enter__(self) -> None:
        import fcntl

        self.fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)  # closing releases the lock


def _two_sockets() -> FakeNvml:
    gpus = [
        FakeGpu(
            name="NVIDIA L40S",
            uuid=f"GPU-0c1d2e3f-4a5b-4c6d-8e7f-80910203040{i}",
            memory_total=48 * GIB,
            pci_bus=[0x17, 0x18, 0x98, 0x99][i],
            numa_node=i // 2,
            cpu_affinity=list(range(0, 16)) if i < 2 else list(range(16, 32)),
        )
        for i in range(4)
    ]
    topology = {}
    p2p = {}
    for a in range(4):
        for b in range(a + 1, 4):
            same = a // 2 == b // 2
            topology[(a, b)] = NVML_TOPOLOGY_SINGLE if same else NVML_TOPOLOGY_SYSTEM
            if not same:
                p2p[(a, b)] = NVML_P2P_STATUS_IOH_TOPOLOGY_NOT_SUPPORTED
    return FakeNvml(gpus, topology=topology, p2p=p2p)
