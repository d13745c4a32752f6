"""A fake ``pynvml`` module: the ONLY fake in torchdoctor's test suite.

Why a fake here and nowhere else: the test machines and CI have no NVIDIA GPU and no driver,
so the real NVML can only ever show its "no driver" path (tested with the real bindings too).
Everything else in the suite uses real parts: real /proc, real child processes, real SQLite
files, real torch loops.

It is shaped after the real bindings (nvidia-ml-py, ``import pynvml``) and the C library's
behaviour, so that code written against it works unchanged against the real module:

- the functions GpuReader uses, with the same names and parameters (a test compares their
  signatures with the installed pynvml);
- the same exception hierarchy: ``NVMLError(value)`` maps the code to a generated subclass
  (``NVMLError_NotSupported``, ``NVMLError_GpuIsLost``, ...), same codes and names, and
  ``NVMLLibraryMismatchError`` for an unversioned wrapper that finds no symbol;
- ctypes structures with the real field names (``.total/.used/.free``, ``.gpu/.memory``) and
  process objects with ``.pid/.usedGpuMemory`` (``None`` when NVML says "not available");
- calls before ``nvmlInit`` raise Uninitialized; power in mW, PCIe in KB/s, clock-event
  reasons as a bitmask, CUDA version as 1000 * major + 10 * minor;
- NVML's pid for a process is its host PID.

Named scenarios: see :func:`scenario` and ``SCENARIOS``.
"""

from __future__ import annotations

import os
import string
import sys
import types
from collections import Counter
from ctypes import (
    Structure,
    Union,
    c_char,
    c_double,
    c_int,
    c_int64,
    c_longlong,
    c_uint,
    c_uint32,
    c_ulong,
    c_ulonglong,
    c_ushort,
)
from dataclasses import dataclass, field

# -- return codes, as in nvml.h / pynvml ------------------------------------------------------

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_ALREADY_INITIALIZED = 5
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_INSUFFICIENT_POWER = 8
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_IRQ_ISSUE = 11
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_CORRUPTED_INFOROM = 14
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_OPERATING_SYSTEM = 17
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_IN_USE = 19
NVML_ERROR_MEMORY = 20
NVML_ERROR_NO_DATA = 21
NVML_ERROR_VGPU_ECC_NOT_SUPPORTED = 22
NVML_ERROR_INSUFFICIENT_RESOURCES = 23
NVML_ERROR_FREQ_NOT_SUPPORTED = 24
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
NVML_ERROR_DEPRECATED = 26
NVML_ERROR_NOT_READY = 27
NVML_ERROR_GPU_NOT_FOUND = 28
NVML_ERROR_INVALID_STATE = 29
NVML_ERROR_RESET_TYPE_NOT_SUPPORTED = 30
NVML_ERROR_UNKNOWN = 999

NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_GRAPHICS = 0
NVML_CLOCK_SM = 1
NVML_CLOCK_MEM = 2
NVML_PCIE_UTIL_TX_BYTES = 0
NVML_PCIE_UTIL_RX_BYTES = 1
NVML_FI_DEV_PCIE_COUNT_TX_BYTES = 197
NVML_FI_DEV_PCIE_COUNT_RX_BYTES = 198
NVML_VALUE_TYPE_UNSIGNED_LONG_LONG = 3
NVML_TOPOLOGY_INTERNAL = 0
NVML_TOPOLOGY_SINGLE = 10
NVML_TOPOLOGY_MULTIPLE = 20
NVML_TOPOLOGY_HOSTBRIDGE = 30
NVML_TOPOLOGY_NODE = 40
NVML_TOPOLOGY_SYSTEM = 50
NVML_P2P_CAPS_INDEX_READ = (0,)  # sic: the real bindings have this stray comma too
NVML_P2P_CAPS_INDEX_WRITE = 1
NVML_P2P_CAPS_INDEX_NVLINK = 2
NVML_P2P_STATUS_OK = 0
NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED = 1
NVML_P2P_STATUS_GPU_NOT_SUPPORTED = 2
NVML_P2P_STATUS_IOH_TOPOLOGY_NOT_SUPPORTED = 3
NVML_P2P_STATUS_DISABLED_BY_REGKEY = 4
NVML_P2P_STATUS_NOT_SUPPORTED = 5
NVML_NVLINK_MAX_LINKS = 36
NVML_FEATURE_DISABLED = 0
NVML_FEATURE_ENABLED = 1
nvmlMemory_v2 = 0x02000028
nvmlTemperature_v1 = 0x1000008
NVML_VALUE_NOT_AVAILABLE_ulonglong = c_ulonglong(-1)

nvmlClocksEventReasonGpuIdle = 0x001
nvmlClocksEventReasonApplicationsClocksSetting = 0x002
nvmlClocksEventReasonSwPowerCap = 0x004
nvmlClocksEventReasonHwSlowdown = 0x008
nvmlClocksEventReasonSyncBoost = 0x010
nvmlClocksEventReasonSwThermalSlowdown = 0x020
nvmlClocksEventReasonHwThermalSlowdown = 0x040
nvmlClocksEventReasonHwPowerBrakeSlowdown = 0x080
nvmlClocksEventReasonDisplayClockSetting = 0x100

_ERROR_STRINGS = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
    NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
    NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    NVML_ERROR_LIB_RM_VERSION_MISMATCH: "RM has detected an NVML/RM version mismatch.",
    NVML_ERROR_UNKNOWN: "Unknown Error",
}


class NVMLLibraryMismatchError(Exception):
    pass


class NVMLError(Exception):
    """Like pynvml's: ``NVMLError(code)`` builds the subclass generated for that code."""

    _valClassMapping: dict[int, type] = {}

    def __new__(typ, value):
        if typ == NVMLError:
            typ = NVMLError._valClassMapping.get(value, typ)
        obj = Exception.__new__(typ)
        obj.value = value
        return obj

    def __str__(self):
        return _ERROR_STRINGS.get(self.value, f"NVML Error with code {self.value}")

    def __eq__(self, other):
        return self.value == other.value

    __hash__ = Exception.__hash__


def _generate_error_classes() -> None:
    # Same naming rule as pynvml: NVML_ERROR_GPU_IS_LOST -> NVMLError_GpuIsLost.
    module = sys.modules[__name__]
    for name in [n for n in dir(module) if n.startswith("NVML_ERROR_")]:
        class_name = "NVMLError_" + string.capwords(name.replace("NVML_ERROR_", ""), "_").replace(
            "_", ""
        )
        value = getattr(module, name)

        def new(typ, *args, _value=value):
            return NVMLError.__new__(typ, _value)

        cls = type(class_name, (NVMLError,), {"__new__": new})
        cls.__module__ = __name__
        setattr(module, class_name, cls)
        NVMLError._valClassMapping[value] = cls


_generate_error_classes()
NVMLError_NotSupported = NVMLError._valClassMapping[NVML_ERROR_NOT_SUPPORTED]
NVMLError_GpuIsLost = NVMLError._valClassMapping[NVML_ERROR_GPU_IS_LOST]


# -- structures with the real field names -----------------------------------------------------


class c_nvmlMemory_t(Structure):
    _fields_ = [("total", c_ulonglong), ("free", c_ulonglong), ("used", c_ulonglong)]


class c_nvmlMemory_v2_t(Structure):
    _fields_ = [
        ("version", c_uint),
        ("total", c_ulonglong),
        ("reserved", c_ulonglong),
        ("free", c_ulonglong),
        ("used", c_ulonglong),
    ]


class c_nvmlUtilization_t(Structure):
    _fields_ = [("gpu", c_uint), ("memory", c_uint)]


class c_nvmlValue_t(Union):
    _fields_ = [
        ("dVal", c_double),
        ("uiVal", c_uint),
        ("ulVal", c_ulong),
        ("ullVal", c_ulonglong),
        ("sllVal", c_longlong),
        ("siVal", c_int),
        ("usVal", c_ushort),
    ]


class c_nvmlFieldValue_t(Structure):
    # The enums (valueType, nvmlReturn) are C ints in pynvml's structure too.
    _fields_ = [
        ("fieldId", c_uint32),
        ("scopeId", c_uint32),
        ("timestamp", c_int64),
        ("latencyUsec", c_int64),
        ("valueType", c_uint),
        ("nvmlReturn", c_uint),
        ("value", c_nvmlValue_t),
    ]


class nvmlPciInfo_t(Structure):
    # busId is "00000000:07:00.0" (8-digit domain), busIdLegacy the old 4-digit form.
    _fields_ = [
        ("busIdLegacy", c_char * 16),
        ("domain", c_uint),
        ("bus", c_uint),
        ("device", c_uint),
        ("pciDeviceId", c_uint),
        ("pciSubSystemId", c_uint),
        ("busId", c_char * 32),
    ]


class nvmlFriendlyObject:
    """What pynvml returns for a process: attributes from the C struct's fields."""

    def __init__(self, dictionary):
        for key, value in dictionary.items():
            setattr(self, key, value)


class c_nvmlDevice_t:
    """An opaque device handle, as the real one is to its users."""

    def __init__(self, index: int) -> None:
        self.index = index


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


@dataclass
class FakeGpu:
    """The state of one simulated device; tests change it between reads."""

    name: str = "NVIDIA A100-SXM4-80GB"
    uuid: str = "GPU-3b1f6c52-0d7e-4b8e-9a51-8f6a3a1c0000"
    compute_capability: tuple[int, int] = (8, 0)
    memory_total: int = 80 * GIB
    memory_reserved: int = 512 * MIB
    memory_used: int = 1 * GIB  # held by processes (v2 "used"); v1 adds the reserved part
    utilization_gpu: int = 0
    utilization_memory: int = 0
    power_mw: int = 61_000
    power_limit_mw: int = 400_000
    temperature_c: int = 34
    sm_clock_mhz: int = 1410
    clock_event_reasons: int = nvmlClocksEventReasonGpuIdle
    pcie_rx_kb: int = 0  # nvmlDeviceGetPcieThroughput, KB/s over its 20 ms window
    pcie_tx_kb: int = 0
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
    calls: Counter = field(default_factory=Counter)


class FakeNvml(types.ModuleType):
    """A module object with pynvml's names; ``gpus`` is the simulated machine."""

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
        self.__file__ = __file__
        self.gpus = gpus
        self.init_error = init_error
        self.init_banner = init_banner
        self.driver_version = driver_version
        self.cuda_driver_version = cuda_driver_version
        self.nvml_version = nvml_version
        self.has_memory_v2 = has_memory_v2
        # (a, b) with a < b -> NVML_TOPOLOGY_* level / NVML_P2P_STATUS_* for reads; pairs not
        # listed are NVML_TOPOLOGY_HOSTBRIDGE and P2P OK.
        self.topology = topology or {}
        self.p2p = p2p or {}
        self.refcount = 0
        self.init_calls = 0
        self.calls: Counter = Counter()  # every function, all devices
        module = sys.modules[__name__]
        for name in dir(module):
            if name.startswith(("NVML", "nvmlClocksEventReason", "nvmlMemory_", "nvmlTemp")) or (
                name.startswith("c_nvml") or name in ("nvmlFriendlyObject", "nvmlPciInfo_t")
            ):
                setattr(self, name, getattr(module, name))

    # -- plumbing ---------------------------------------------------------------------------

    def _check_init(self, fn: str) -> None:
        self.calls[fn] += 1
        if self.refcount == 0:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)

    def _gpu(self, handle: c_nvmlDevice_t, fn: str) -> FakeGpu:
        self._check_init(fn)
        gpu = self.gpus[handle.index]
        gpu.calls[fn] += 1
        if gpu.lost_after_calls is not None and sum(gpu.calls.values()) > gpu.lost_after_calls:
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        if fn in gpu.not_supported:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        if fn in gpu.errors:
            raise NVMLError(gpu.errors[fn])
        return gpu

    # -- initialisation and system ----------------------------------------------------------

    def nvmlInit(self):
        self.init_calls += 1
        if self.init_banner:
            # The stub library prints from C straight to file descriptor 1.
            os.write(1, self.init_banner.encode())
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        self.refcount += 1

    def nvmlShutdown(self):
        self._check_init("nvmlShutdown")
        self.refcount -= 1

    def nvmlSystemGetDriverVersion(self):
        self._check_init("nvmlSystemGetDriverVersion")
        return self.driver_version

    def nvmlSystemGetCudaDriverVersion(self):
        self._check_init("nvmlSystemGetCudaDriverVersion")
        return self.cuda_driver_version

    def nvmlSystemGetCudaDriverVersion_v2(self):
        self._check_init("nvmlSystemGetCudaDriverVersion_v2")
        return self.cuda_driver_version

    def nvmlSystemGetNVMLVersion(self):
        self._check_init("nvmlSystemGetNVMLVersion")
        return self.nvml_version.encode()  # recent bindings return bytes here

    def nvmlDeviceGetCount(self):
        self._check_init("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        self._check_init("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        handle = c_nvmlDevice_t(index)
        self._gpu(handle, "nvmlDeviceGetHandleByIndex")
        return handle

    # -- static device facts ----------------------------------------------------------------

    def nvmlDeviceGetName(self, handle):
        return self._gpu(handle, "nvmlDeviceGetName").name

    def nvmlDeviceGetUUID(self, handle):
        return self._gpu(handle, "nvmlDeviceGetUUID").uuid

    def nvmlDeviceGetCudaComputeCapability(self, handle):
        return self._gpu(handle, "nvmlDeviceGetCudaComputeCapability").compute_capability

    def nvmlDeviceGetEnforcedPowerLimit(self, handle):
        return self._gpu(handle, "nvmlDeviceGetEnforcedPowerLimit").power_limit_mw

    def nvmlDeviceGetPowerManagementLimit(self, handle):
        return self._gpu(handle, "nvmlDeviceGetPowerManagementLimit").power_limit_mw

    def nvmlDeviceGetNumaNodeId(self, handle):
        gpu = self._gpu(handle, "nvmlDeviceGetNumaNodeId")
        if gpu.numa_node is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return gpu.numa_node

    # -- fast tier --------------------------------------------------------------------------

    def nvmlDeviceGetMemoryInfo(self, handle, version=None):
        gpu = self._gpu(handle, "nvmlDeviceGetMemoryInfo")
        if version:
            if not self.has_memory_v2:
                raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)  # old driver: no _v2 symbol
            free = gpu.memory_total - gpu.memory_reserved - gpu.memory_used
            return c_nvmlMemory_v2_t(
                version, gpu.memory_total, gpu.memory_reserved, free, gpu.memory_used
            )
        used = gpu.memory_used + gpu.memory_reserved
        return c_nvmlMemory_t(gpu.memory_total, gpu.memory_total - used, used)

    def nvmlDeviceGetUtilizationRates(self, handle):
        gpu = self._gpu(handle, "nvmlDeviceGetUtilizationRates")
        return c_nvmlUtilization_t(gpu.utilization_gpu, gpu.utilization_memory)

    def _processes(self, handle, fn, listed):
        gpu = self._gpu(handle, fn)
        return [
            nvmlFriendlyObject(
                {
                    "pid": pid,
                    "usedGpuMemory": used,
                    "gpuInstanceId": 0xFFFFFFFF,
                    "computeInstanceId": 0xFFFFFFFF,
                }
            )
            for pid, used in listed(gpu)
        ]

    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle):
        return self._processes(
            handle, "nvmlDeviceGetComputeRunningProcesses_v3", lambda g: g.compute_processes
        )

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        return self.nvmlDeviceGetComputeRunningProcesses_v3(handle)

    def nvmlDeviceGetGraphicsRunningProcesses_v3(self, handle):
        return self._processes(
            handle, "nvmlDeviceGetGraphicsRunningProcesses_v3", lambda g: g.graphics_processes
        )

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle):
        return self.nvmlDeviceGetGraphicsRunningProcesses_v3(handle)

    # -- slow tier --------------------------------------------------------------------------

    def nvmlDeviceGetPowerUsage(self, handle):
        return self._gpu(handle, "nvmlDeviceGetPowerUsage").power_mw

    def nvmlDeviceGetTemperatureV(self, handle, sensor, version=nvmlTemperature_v1):
        if sensor != NVML_TEMPERATURE_GPU:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return self._gpu(handle, "nvmlDeviceGetTemperatureV").temperature_c

    def nvmlDeviceGetTemperature(self, handle, sensor):
        if sensor != NVML_TEMPERATURE_GPU:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return self._gpu(handle, "nvmlDeviceGetTemperature").temperature_c

    def nvmlDeviceGetClockInfo(self, handle, type):
        gpu = self._gpu(handle, "nvmlDeviceGetClockInfo")
        if type != NVML_CLOCK_SM:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return gpu.sm_clock_mhz

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        return self._gpu(handle, "nvmlDeviceGetCurrentClocksEventReasons").clock_event_reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle):
        return self._gpu(handle, "nvmlDeviceGetCurrentClocksThrottleReasons").clock_event_reasons

    def nvmlDeviceGetFieldValues(self, handle, fieldIds):
        gpu = self._gpu(handle, "nvmlDeviceGetFieldValues")
        values = (c_nvmlFieldValue_t * len(fieldIds))()
        counters = {
            NVML_FI_DEV_PCIE_COUNT_RX_BYTES: gpu.pcie_rx_bytes,
            NVML_FI_DEV_PCIE_COUNT_TX_BYTES: gpu.pcie_tx_bytes,
        }
        for slot, field_id in zip(values, fieldIds, strict=True):
            if isinstance(field_id, tuple):  # (fieldId, scopeId), as pynvml accepts
                field_id, slot.scopeId = field_id
            slot.fieldId = field_id
            # Per field, as NVML does: the call succeeds and each value carries its own status.
            if field_id in counters and gpu.pcie_counters:
                slot.valueType = NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
                slot.value.ullVal = counters[field_id]
            else:
                slot.nvmlReturn = NVML_ERROR_NOT_SUPPORTED
        return values

    def nvmlDeviceGetPcieThroughput(self, device, counter):
        gpu = self._gpu(device, "nvmlDeviceGetPcieThroughput")
        if counter == NVML_PCIE_UTIL_RX_BYTES:
            return gpu.pcie_rx_kb
        if counter == NVML_PCIE_UTIL_TX_BYTES:
            return gpu.pcie_tx_kb
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)

    # -- topology: the bus, NVLink, peer-to-peer, CPU affinity ------------------------------

    def _bus(self, index: int) -> int:
        bus = self.gpus[index].pci_bus
        return 0x07 + index if bus is None else bus

    def _pci_info(self, bus: int) -> nvmlPciInfo_t:
        return nvmlPciInfo_t(
            f"0000:{bus:02X}:00.0".encode(), 0, bus, 0, 0x20B010DE, 0x134F10DE,
            f"00000000:{bus:02X}:00.0".encode(),
        )  # fmt: skip

    def nvmlDeviceGetPciInfo_v3(self, handle):
        self._gpu(handle, "nvmlDeviceGetPciInfo_v3")
        return self._pci_info(self._bus(handle.index))

    def nvmlDeviceGetPciInfo(self, handle):
        return self.nvmlDeviceGetPciInfo_v3(handle)

    def _pair(self, device1, device2, fn: str) -> tuple[int, int]:
        self._gpu(device1, fn)
        self._gpu(device2, fn)
        return tuple(sorted((device1.index, device2.index)))  # type: ignore[return-value]

    def nvmlDeviceGetTopologyCommonAncestor(self, device1, device2):
        pair = self._pair(device1, device2, "nvmlDeviceGetTopologyCommonAncestor")
        if pair[0] == pair[1]:
            return NVML_TOPOLOGY_INTERNAL
        return self.topology.get(pair, NVML_TOPOLOGY_HOSTBRIDGE)

    def nvmlDeviceGetP2PStatus(self, device1, device2, p2pIndex):
        if not isinstance(p2pIndex, int):
            # The real call passes it to C as an enum: ctypes rejects anything else.
            from ctypes import ArgumentError

            raise ArgumentError(f"argument 3: TypeError: wrong type {type(p2pIndex).__name__}")
        pair = self._pair(device1, device2, "nvmlDeviceGetP2PStatus")
        if p2pIndex not in (0, 1, 2, 3, 4):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return self.p2p.get(pair, NVML_P2P_STATUS_OK)

    def _link(self, device, link, fn: str):
        gpu = self._gpu(device, fn)
        if not gpu.nvlinks:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)  # no NVLink on this GPU
        if not 0 <= link < len(gpu.nvlinks):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)  # past the device's last link
        return gpu.nvlinks[link]

    def nvmlDeviceGetNvLinkState(self, device, link):
        peer = self._link(device, link, "nvmlDeviceGetNvLinkState")
        return NVML_FEATURE_ENABLED if peer is not None else NVML_FEATURE_DISABLED

    def nvmlDeviceGetNvLinkRemotePciInfo(self, device, link):
        peer = self._link(device, link, "nvmlDeviceGetNvLinkRemotePciInfo")
        if peer is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)  # an inactive link has no far end
        if peer == "switch":
            return self._pci_info(0xC0 + link)  # each NVSwitch port has its own bus id
        return self._pci_info(self._bus(peer))

    def nvmlDeviceGetCpuAffinity(self, handle, cpuSetSize):
        gpu = self._gpu(handle, "nvmlDeviceGetCpuAffinity")
        mask = (c_ulonglong * cpuSetSize)()
        for cpu in gpu.cpu_affinity:
            if cpu < 64 * cpuSetSize:
                mask[cpu // 64] |= 1 << (cpu % 64)
        return mask


# The pynvml functions this fake provides; a test checks their signatures against the real ones.
FUNCTIONS = tuple(
    name for name in vars(FakeNvml) if name.startswith("nvml") and callable(vars(FakeNvml)[name])
)

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
# They share one simulated machine through a JSON file: the devices, and the memory each
# process holds on them. As with the real driver, a process's memory is freed when it exits
# (its PID is gone or a zombie), whoever reads next; an allocation that does not fit fails.
# Processes load it as ``pynvml`` through tests/helpers/fake_pynvml/ on PYTHONPATH, with
# FAKE_NVML_STATE naming the file.

STATE_ENV = "FAKE_NVML_STATE"


def write_machine(path: str, gpus: list[dict]) -> None:
    """Create the shared machine: one dict per device with ``uuid``, ``memory_total`` and
    optionally ``name``, ``memory_reserved``, ``numa_node``, ``processes`` ([pid, bytes])."""
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


def release(path: str, pid: int) -> None:
    """Free everything ``pid`` holds (a process that is still running, e.g. another user's)."""
    with _locked(path):
        state = _load(path)
        for gpu in state["gpus"]:
            gpu["processes"] = [p for p in gpu["processes"] if p[0] != pid]
        _save(path, state)


class SharedFakeNvml(FakeNvml):
    """The fake NVML over the shared machine file: every call sees the file as it is now."""

    def __init__(self, path: str, **kwargs) -> None:
        self.state_path = path
        super().__init__([], **kwargs)

    @property
    def gpus(self) -> list[FakeGpu]:
        with _locked(self.state_path):
            state = _load(self.state_path)
        out = []
        for gpu in state["gpus"]:
            _drop_exited(gpu)
            out.append(
                FakeGpu(
                    name=gpu.get("name", "NVIDIA A100-PCIE-40GB"),
                    uuid=gpu["uuid"],
                    memory_total=gpu["memory_total"],
                    memory_reserved=gpu.get("memory_reserved", 512 * MIB),
                    memory_used=sum(n for _, n in gpu["processes"]),
                    numa_node=gpu.get("numa_node"),
                    compute_processes=[(pid, n) for pid, n in gpu["processes"]],
                )
            )
        return out

    @gpus.setter
    def gpus(self, value: list[FakeGpu]) -> None:
        pass  # the devices live in the file


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

    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(state, f)
    os.replace(tmp, path)


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
