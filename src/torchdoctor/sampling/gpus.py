"""NVIDIA GPUs through NVML: a fast tier every read, slow fields on a slower cadence.

Every read gives utilization, memory and the GPU memory of each process. Power, temperature,
SM clock, clock-event (throttle) reasons and PCIe throughput change slowly or cost more, so they
are read every ``slow_refresh_s`` and carried over in between. PCIe rates come from the
driver's byte counters where it has them (the average over the slow interval, at no cost);
otherwise from nvmlDeviceGetPcieThroughput, which samples the bus for about 20 ms a direction.

A field NVML cannot give is ``None`` with the reason in ``GpuSample.unavailable``, keyed by the
field name (``"processes"`` for the process list). A GPU lost mid-run is reported as lost from
then on while the other GPUs keep being read. All devices NVML sees are recorded:
``CUDA_VISIBLE_DEVICES`` does not apply to NVML, and indexes are NVML's.

NVML's "GPU utilization" is the share of the last sample window (1/6 s to 1 s, by device) in
which at least one kernel was running. It is not SM occupancy: one tiny kernel at a time can
show 100 %.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torchdoctor.sampling.nvml import GPU_LOST, Nvml, Unavailable, text
from torchdoctor.sampling.pidns import PidNamespace
from torchdoctor.sampling.types import GpuInfo, GpuProcessSample, GpuSample, GpuStatus

LOST_REASON = "GPU is lost"

# Bits of nvmlClocksEventReasons (formerly "throttle reasons"), nvml.h; the names are ours.
CLOCK_EVENT_REASONS: tuple[tuple[int, str], ...] = (
    (0x001, "gpu_idle"),
    (0x002, "applications_clocks_setting"),
    (0x004, "sw_power_cap"),
    (0x008, "hw_slowdown"),
    (0x010, "sync_boost"),
    (0x020, "sw_thermal_slowdown"),
    (0x040, "hw_thermal_slowdown"),
    (0x080, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
)
_KNOWN_REASON_BITS = 0x1FF

# Newest first: the first one both the driver and the bindings have is used from then on.
_COMPUTE_PROCS = (
    "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetComputeRunningProcesses_v2",
    "nvmlDeviceGetComputeRunningProcesses",
)
_GRAPHICS_PROCS = (
    "nvmlDeviceGetGraphicsRunningProcesses_v3",
    "nvmlDeviceGetGraphicsRunningProcesses_v2",
    "nvmlDeviceGetGraphicsRunningProcesses",
)
_TEMPERATURE = ("nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature")
_CLOCK_EVENTS = (
    "nvmlDeviceGetCurrentClocksEventReasons",
    "nvmlDeviceGetCurrentClocksThrottleReasons",
)
_POWER_LIMIT = ("nvmlDeviceGetEnforcedPowerLimit", "nvmlDeviceGetPowerManagementLimit")
_CUDA_VERSION = ("nvmlSystemGetCudaDriverVersion_v2", "nvmlSystemGetCudaDriverVersion")

# Constants of nvml.h, used when the bindings module does not define them.
_NVML_TEMPERATURE_GPU = 0
_NVML_CLOCK_SM = 1
_NVML_PCIE_UTIL_TX_BYTES = 0
_NVML_PCIE_UTIL_RX_BYTES = 1
_NVML_FI_DEV_PCIE_COUNT_TX_BYTES = 197
_NVML_FI_DEV_PCIE_COUNT_RX_BYTES = 198
_NVML_ERROR_GPU_IS_LOST = 15
_NVML_MEMORY_V2 = 0x02000028
_NVML_EVENT_TYPE_XID = 0x8  # nvmlEventTypeXidCriticalError
_NVML_MEMORY_ERROR_CORRECTED = 0
_NVML_MEMORY_ERROR_UNCORRECTED = 1
_NVML_VOLATILE_ECC = 0
_MAX_EVENTS_A_READ = 256  # a storm of Xids is drained over several reads, never forever
# NVML_VALUE_NOT_AVAILABLE for unsigned long long; recent bindings already turn it into None.
_VALUE_NOT_AVAILABLE = 2**64 - 1

_FAST_FIELDS = ("utilization_gpu", "utilization_memory", "memory_used", "memory_total")
_SLOW_FIELDS = (
    "power_w",
    "power_limit_w",
    "temperature_c",
    "sm_clock_mhz",
    "clock_event_reasons",
    "pcie_rx_per_s",
    "pcie_tx_per_s",
    "ecc_corrected",
    "ecc_uncorrected",
)
_EVENT_FIELDS = ("xid_errors", "xid_count")
ALL_FIELDS = _FAST_FIELDS + _SLOW_FIELDS + _EVENT_FIELDS


def decode_clock_event_reasons(mask: int) -> list[str]:
    """Names of the active clock-event reasons in an NVML bitmask; unknown bits by value."""
    names = [name for bit, name in CLOCK_EVENT_REASONS if mask & bit]
    unknown = mask & ~_KNOWN_REASON_BITS
    if unknown:
        names.append(f"other_0x{unknown:x}")
    return names


@dataclass(slots=True)
class _Device:
    index: int
    handle: Any
    uuid: str | None
    lost: bool = False
    # Calls that failed for good (NotSupported, FunctionNotFound...): not asked again.
    settled: dict[str, Unavailable] = field(default_factory=dict)
    slow_values: dict[str, Any] = field(default_factory=dict)
    slow_unavailable: dict[str, str] = field(default_factory=dict)
    pcie_counters: bool | None = None  # whether the driver has PCIe byte counters; None: unknown
    pcie_previous: tuple[float, int, int] | None = None  # (clock, rx bytes, tx bytes)
    xid_reason: str | None = None  # why Xid events cannot be had; None: registered
    xid_pending: list[int] = field(default_factory=list)
    xid_count: int = 0


def _address(handle: Any) -> int | None:
    """A device handle's identity: NVML hands out one pointer per device."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (ctypes.ArgumentError, TypeError):
        return id(handle)


class _Lost(Exception):
    """Raised inside one device's read when NVML says the GPU is gone."""


class GpuReader:
    """Reads every NVIDIA device NVML sees.

    ``nvml_module`` is the NVML bindings module; ``None`` imports ``pynvml``. ``clock`` times
    the slow tier (monotonic seconds). ``pid_namespace`` says how NVML's host PIDs map to
    ours; by default it is detected from /proc.
    """

    def __init__(
        self,
        nvml_module: Any = None,
        *,
        slow_refresh_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        pid_namespace: PidNamespace | None = None,
    ) -> None:
        self.slow_refresh_s = slow_refresh_s
        self._clock = clock
        self._last_slow: float | None = None
        self._nvml = Nvml(nvml_module)
        self._devices: list[_Device] = []
        self._memory_v2: bool | None = None
        self._pidns = pid_namespace if pid_namespace is not None else PidNamespace()
        self._event_set: Any = None
        self.status = self._start()

    # -- construction -----------------------------------------------------------------------

    def _start(self) -> GpuStatus:
        nvml = self._nvml
        if not nvml.start():
            return GpuStatus(available=False, reason=nvml.reason)
        count = nvml.call("nvmlDeviceGetCount")
        if isinstance(count, Unavailable):
            nvml.shutdown()
            return GpuStatus(available=False, reason=f"cannot count GPUs: {count.reason}")
        if count == 0:
            nvml.shutdown()
            return GpuStatus(available=False, reason="NVML works but sees no NVIDIA GPU")
        status = GpuStatus(
            available=True,
            reason=None,
            driver_version=self._system_text("nvmlSystemGetDriverVersion"),
            cuda_driver_version=self._cuda_driver_version(),
            nvml_version=self._system_text("nvmlSystemGetNVMLVersion"),
            process_pids_unresolved=self._pidns.unresolved_reason,
        )
        for index in range(count):
            info = self._open_device(index)
            status.gpus.append(info)
        self._register_xid_events()
        return status

    def _register_xid_events(self) -> None:
        """One event set for every device's Xid errors (the driver's "GPU has fallen off the
        bus", "double-bit ECC error", ... codes), drained without waiting at each read."""
        event_set = self._nvml.call("nvmlEventSetCreate")
        if isinstance(event_set, Unavailable):
            for device in self._devices:
                device.xid_reason = event_set.reason
            return
        self._event_set = event_set
        xid = self._nvml.constant("nvmlEventTypeXidCriticalError", _NVML_EVENT_TYPE_XID)
        for device in self._devices:
            if device.lost:
                continue
            done = self._nvml.call("nvmlDeviceRegisterEvents", device.handle, xid, event_set)
            if isinstance(done, Unavailable):
                device.xid_reason = done.reason

    def _drain_xid_events(self) -> None:
        if self._event_set is None:
            return
        by_address = {_address(d.handle): d for d in self._devices}
        for _ in range(_MAX_EVENTS_A_READ):
            # A timeout of 0 answers at once: NVML_ERROR_TIMEOUT when nothing is pending.
            event = self._nvml.call("nvmlEventSetWait", self._event_set, 0)
            if isinstance(event, Unavailable):
                return
            device = by_address.get(_address(event.device))
            if device is not None:
                device.xid_pending.append(int(event.eventData))
                device.xid_count += 1

    def _system_text(self, name: str) -> str | None:
        value = self._nvml.call(name)
        return None if isinstance(value, Unavailable) else text(value)

    def _cuda_driver_version(self) -> str | None:
        value = self._nvml.call(_CUDA_VERSION)
        if isinstance(value, Unavailable):
            return None
        # 12040 -> "12.4", as CUDA encodes it (1000 * major + 10 * minor).
        return f"{value // 1000}.{value % 1000 // 10}"

    def _open_device(self, index: int) -> GpuInfo:
        nvml = self._nvml
        unavailable: dict[str, str] = {}
        handle = nvml.call("nvmlDeviceGetHandleByIndex", index)
        if isinstance(handle, Unavailable):
            # Without a handle nothing can be read; the device is still listed, with the reason.
            device = _Device(index, None, None, lost=True)
            device.settled["*"] = handle
            self._devices.append(device)
            for name in ("name", "uuid", "memory_total", "compute_capability", "power_limit_w"):
                unavailable[name] = handle.reason
            return GpuInfo(index, f"GPU {index}", None, None, None, None, unavailable)

        device = _Device(index, handle, None)
        self._devices.append(device)
        facts: dict[str, Any] = {}
        try:
            for key, name in (
                ("name", "nvmlDeviceGetName"),
                ("uuid", "nvmlDeviceGetUUID"),
                ("compute_capability", "nvmlDeviceGetCudaComputeCapability"),
                ("power_limit", _POWER_LIMIT),
            ):
                result = self._call(device, key, name)
                if isinstance(result, Unavailable):
                    unavailable[key.replace("power_limit", "power_limit_w")] = result.reason
                else:
                    facts[key] = result
            memory = self._memory_info(device)
            if isinstance(memory, Unavailable):
                unavailable["memory_total"] = memory.reason
            else:
                facts["memory_total"] = int(memory.total)
            # A baseline now, so the first PCIe rate covers the time up to the first read.
            counters = self._pcie_counters(device)
            if counters is not None:
                device.pcie_counters = True
                device.pcie_previous = (self._clock(), *counters)
        except _Lost:
            device.lost = True
            for key in ("name", "uuid", "memory_total", "compute_capability", "power_limit"):
                if key not in facts:
                    unavailable[key.replace("power_limit", "power_limit_w")] = LOST_REASON
        if "uuid" in facts:
            device.uuid = text(facts["uuid"])
        capability = facts.get("compute_capability")
        limit_mw = facts.get("power_limit")
        return GpuInfo(
            index=index,
            name=text(facts["name"]) if "name" in facts else f"GPU {index}",
            uuid=device.uuid,
            memory_total=facts.get("memory_total"),
            compute_capability=(
                f"{capability[0]}.{capability[1]}" if capability is not None else None
            ),
            power_limit_w=limit_mw / 1000.0 if limit_mw is not None else None,
            unavailable=unavailable,
        )

    # -- reading ----------------------------------------------------------------------------

    def read(self, job_pids: set[int]) -> tuple[list[GpuSample], list[GpuProcessSample]]:
        """One sample per device, and the GPU memory of every process NVML lists."""
        if not self._nvml.available:
            return [], []
        t = time.time()
        now = self._clock()
        slow_due = self._last_slow is None or now - self._last_slow >= self.slow_refresh_s
        if slow_due:
            self._last_slow = now
        samples: list[GpuSample] = []
        processes: list[GpuProcessSample] = []
        self._drain_xid_events()
        for device in self._devices:
            if device.lost:
                samples.append(self._lost_sample(t, device))
                continue
            try:
                sample, device_procs = self._read_device(t, device, job_pids, slow_due)
            except _Lost:
                device.lost = True
                samples.append(self._lost_sample(t, device))
                continue
            samples.append(sample)
            processes.extend(device_procs)
        return samples, processes

    def free_memory(self) -> dict[int, int]:
        """Free bytes of each readable device, as NVML counts them: what a new allocation
        there can still get (reserved and other processes' memory already taken off)."""
        out: dict[int, int] = {}
        for device in self._devices:
            if device.lost:
                continue
            try:
                memory = self._memory_info(device)
            except _Lost:
                device.lost = True
                continue
            if not isinstance(memory, Unavailable):
                out[device.index] = int(memory.free)
        return out

    def numa_node(self, index: int) -> int | None:
        """The NUMA node the device is attached to, where NVML knows it."""
        device = self._devices[index]
        if device.lost:
            return None
        try:
            node = self._call(device, "numa_node", "nvmlDeviceGetNumaNodeId")
        except _Lost:
            device.lost = True
            return None
        return None if isinstance(node, Unavailable) or int(node) < 0 else int(node)

    def _lost_sample(self, t: float, device: _Device) -> GpuSample:
        reason = device.settled["*"].reason if "*" in device.settled else LOST_REASON
        sample = GpuSample(t, device.index, device.uuid, *([None] * len(ALL_FIELDS)))
        sample.unavailable = dict.fromkeys(ALL_FIELDS, reason)
        return sample

    def _call(
        self, device: _Device, key: str, name: str | tuple[str, ...], *args: Any, **kwargs: Any
    ) -> Any:
        """One NVML call for one device; a lost GPU ends the device's read."""
        settled = device.settled.get(key)
        if settled is not None:
            return settled
        result = self._nvml.call(name, device.handle, *args, **kwargs)
        if isinstance(result, Unavailable):
            if result.kind == GPU_LOST:
                raise _Lost
            if result.permanent:
                device.settled[key] = result
        return result

    def _memory_info(self, device: _Device) -> Any:
        if self._memory_v2 is not False:
            # v2 reports driver-reserved memory apart, so "used" is what processes hold.
            version = self._nvml.constant("nvmlMemory_v2", _NVML_MEMORY_V2)
            result = self._call(device, "memory_v2", "nvmlDeviceGetMemoryInfo", version=version)
            if not isinstance(result, Unavailable):
                self._memory_v2 = True
                return result
            if self._memory_v2:
                return result  # v2 works with this driver: the failure is the device's
            self._memory_v2 = False  # a driver or bindings without v2
        return self._call(device, "memory", "nvmlDeviceGetMemoryInfo")

    def _read_device(
        self, t: float, device: _Device, job_pids: set[int], slow_due: bool
    ) -> tuple[GpuSample, list[GpuProcessSample]]:
        unavailable: dict[str, str] = {}

        def got(result: Any, *keys: str) -> bool:
            if isinstance(result, Unavailable):
                for key in keys:
                    unavailable[key] = result.reason
                return False
            return True

        memory = self._memory_info(device)
        memory_used = memory_total = None
        if got(memory, "memory_used", "memory_total"):
            memory_used, memory_total = int(memory.used), int(memory.total)

        rates = self._call(device, "utilization", "nvmlDeviceGetUtilizationRates")
        util_gpu = util_mem = None
        if got(rates, "utilization_gpu", "utilization_memory"):
            util_gpu, util_mem = float(rates.gpu), float(rates.memory)

        procs = self._processes(t, device, job_pids, unavailable)

        if slow_due:
            self._read_slow(device)
        unavailable.update(device.slow_unavailable)
        slow = device.slow_values
        sample = GpuSample(
            t=t,
            index=device.index,
            uuid=device.uuid,
            utilization_gpu=util_gpu,
            utilization_memory=util_mem,
            memory_used=memory_used,
            memory_total=memory_total,
            power_w=slow.get("power_w"),
            power_limit_w=slow.get("power_limit_w"),
            temperature_c=slow.get("temperature_c"),
            sm_clock_mhz=slow.get("sm_clock_mhz"),
            clock_event_reasons=slow.get("clock_event_reasons"),
            pcie_rx_per_s=slow.get("pcie_rx_per_s"),
            pcie_tx_per_s=slow.get("pcie_tx_per_s"),
            ecc_corrected=slow.get("ecc_corrected"),
            ecc_uncorrected=slow.get("ecc_uncorrected"),
            unavailable=unavailable,
        )
        if device.xid_reason is None:
            sample.xid_errors, device.xid_pending = device.xid_pending, []
            sample.xid_count = device.xid_count
        else:
            unavailable["xid_errors"] = unavailable["xid_count"] = device.xid_reason
        return sample, procs

    def _processes(
        self, t: float, device: _Device, job_pids: set[int], unavailable: dict[str, str]
    ) -> list[GpuProcessSample]:
        # A process with both a compute and a graphics context is listed twice, with the
        # same memory: keep one entry per PID.
        used_by_pid: dict[int, int | None] = {}
        failures: list[str] = []
        for key, names in (("compute", _COMPUTE_PROCS), ("graphics", _GRAPHICS_PROCS)):
            listed = self._call(device, key, names)
            if isinstance(listed, Unavailable):
                failures.append(f"{key} processes: {listed.reason}")
                continue
            for proc in listed:
                used = getattr(proc, "usedGpuMemory", None)
                if used is not None and int(used) == _VALUE_NOT_AVAILABLE:
                    used = None
                pid = int(proc.pid)
                previous = used_by_pid.get(pid)
                if pid not in used_by_pid or (used is not None and (previous or 0) < used):
                    used_by_pid[pid] = int(used) if used is not None else None
        # Graphics lists are NotSupported on many compute GPUs; only a missing compute list
        # leaves the picture incomplete.
        if failures and failures[0].startswith("compute"):
            unavailable["processes"] = "; ".join(failures)
        samples = []
        for pid, used in used_by_pid.items():
            local = self._pidns.local_pid(pid)
            samples.append(
                GpuProcessSample(
                    t=t,
                    gpu_index=device.index,
                    pid=pid,
                    local_pid=local,
                    used_memory=used,
                    in_job=local is not None and local in job_pids,
                )
            )
        return samples

    def _read_slow(self, device: _Device) -> None:
        nvml = self._nvml
        values: dict[str, Any] = {}
        reasons: dict[str, str] = {}

        def put(key: str, result: Any, convert: Callable[[Any], Any]) -> None:
            if isinstance(result, Unavailable):
                values[key] = None
                reasons[key] = result.reason
            else:
                values[key] = convert(result)

        def milliwatts(v: Any) -> float:
            return v / 1000.0

        put("power_w", self._call(device, "power", "nvmlDeviceGetPowerUsage"), milliwatts)
        put("power_limit_w", self._call(device, "power_limit", _POWER_LIMIT), milliwatts)
        sensor = nvml.constant("NVML_TEMPERATURE_GPU", _NVML_TEMPERATURE_GPU)
        put("temperature_c", self._call(device, "temperature", _TEMPERATURE, sensor), float)
        sm = nvml.constant("NVML_CLOCK_SM", _NVML_CLOCK_SM)
        put("sm_clock_mhz", self._call(device, "sm_clock", "nvmlDeviceGetClockInfo", sm), float)
        put(
            "clock_event_reasons",
            self._call(device, "clock_events", _CLOCK_EVENTS),
            decode_clock_event_reasons,
        )
        for key, kind in (
            ("ecc_corrected", _NVML_MEMORY_ERROR_CORRECTED),
            ("ecc_uncorrected", _NVML_MEMORY_ERROR_UNCORRECTED),
        ):
            count = self._call(device, key, "nvmlDeviceGetTotalEccErrors", kind, _NVML_VOLATILE_ECC)
            put(key, count, int)
        self._read_pcie(device, values, reasons)
        device.slow_values = values
        device.slow_unavailable = reasons

    def _read_pcie(self, device: _Device, values: dict[str, Any], reasons: dict[str, str]) -> None:
        """PCIe rx/tx in bytes/s, averaged over the slow interval where the driver can.

        Recent drivers keep byte counters (NVML_FI_DEV_PCIE_COUNT_RX/TX_BYTES): the rate
        between two slow reads costs no wait and covers the whole interval. Otherwise
        nvmlDeviceGetPcieThroughput samples the bus for about 20 ms per direction.
        """
        keys = ("pcie_rx_per_s", "pcie_tx_per_s")
        if device.pcie_counters is not False:
            counters = self._pcie_counters(device)
            if counters is not None:
                device.pcie_counters = True
                now = self._clock()
                previous, device.pcie_previous = device.pcie_previous, (now, *counters)
                if previous is None or now <= previous[0]:
                    for key in keys:
                        values[key] = None
                        reasons[key] = "PCIe byte counters not read yet (a rate needs two)"
                    return
                elapsed = now - previous[0]
                for key, before, after in zip(keys, previous[1:], counters, strict=True):
                    # A counter that went backwards was reset (driver reload): no rate this time.
                    values[key] = (after - before) / elapsed if after >= before else None
                    if after < before:
                        reasons[key] = "PCIe byte counter was reset"
                return
            device.pcie_counters = False
        nvml = self._nvml
        rx = nvml.constant("NVML_PCIE_UTIL_RX_BYTES", _NVML_PCIE_UTIL_RX_BYTES)
        tx = nvml.constant("NVML_PCIE_UTIL_TX_BYTES", _NVML_PCIE_UTIL_TX_BYTES)
        for key, counter in zip(keys, (rx, tx), strict=True):
            result = self._call(device, key, "nvmlDeviceGetPcieThroughput", counter)
            if isinstance(result, Unavailable):
                values[key] = None
                reasons[key] = result.reason
            else:
                values[key] = float(result) * 1024.0  # NVML's KB/s are KiB/s

    def _pcie_counters(self, device: _Device) -> tuple[int, int] | None:
        """(rx bytes, tx bytes) since the driver loaded, or None where there are none."""
        result = self._call(
            device,
            "pcie_counters",
            "nvmlDeviceGetFieldValues",
            [_NVML_FI_DEV_PCIE_COUNT_RX_BYTES, _NVML_FI_DEV_PCIE_COUNT_TX_BYTES],
        )
        if isinstance(result, Unavailable) or len(result) != 2:
            return None
        if any(field.nvmlReturn != 0 for field in result):
            if any(field.nvmlReturn == _NVML_ERROR_GPU_IS_LOST for field in result):
                raise _Lost
            return None
        return int(result[0].value.ullVal), int(result[1].value.ullVal)

    def close(self) -> None:
        """Shut NVML down; later reads return nothing."""
        if self._event_set is not None:
            self._nvml.call("nvmlEventSetFree", self._event_set)
            self._event_set = None
        self._nvml.shutdown()

    def __enter__(self) -> GpuReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
