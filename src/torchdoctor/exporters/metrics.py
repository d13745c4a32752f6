"""The Prometheus series torchdoctor exposes, built fresh from the latest samples.

Naming follows the Prometheus conventions: one ``torchdoctor_`` prefix, base units in the name
(``_seconds``, ``_bytes``, ``_ratio``, ``_watts``), counters ending in ``_total`` made from the
raw cumulative values the kernel keeps (never from rates: Prometheus computes those), strings
only in ``_info`` series. Labels are bounded: ``run_id`` (the recording), ``role`` (a fixed
set), ``rank``, ``gpu`` (NVML index) and ``uuid``, and small fixed sets (``mode``, ``kind``,
``rule``). Never a PID, a user or a command line: they would make a new series per process.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client.core import Metric

from torchdoctor.exporters.exposition import Family, LabelTexts, encode
from torchdoctor.exporters.jobstate import JobState
from torchdoctor.sampling import roles
from torchdoctor.sampling.gpus import CLOCK_EVENT_REASONS

PREFIX = "torchdoctor_"
ROLES = (roles.TRAINER, roles.WORKER, roles.LAUNCHER, roles.OTHER)
CPU_MODES = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
_LAST = "Value of the latest sample."


_NUMBERS = frozenset((int, float))


def _number(name: str, value: Any) -> float:
    """A sample's value that is not a plain int or float: a bool or another number type as a
    float; text (an edited recording's figure) raises here, where the job's series are added
    and left out alone, rather than when the whole scrape is written."""
    if isinstance(value, str | bytes):
        raise TypeError(f"{name}: {value!r} is not a number")
    return float(value)


class Families:
    """Metric families by name, so that several jobs add samples to one family each.

    Kept as plain rows (label pairs, value) and written by :func:`.exposition.encode`:
    prometheus_client's families and encoder cost a quarter of a 20-job scrape. Iterating
    gives prometheus_client's Metric objects, for its registry (and the tests' parser).
    """

    def __init__(self) -> None:
        self._families: dict[str, Family] = {}

    def _get(self, kind: str, name: str, doc: str) -> Family:
        family = self._families.get(name)
        if family is None:
            family = self._families[name] = Family(kind, PREFIX + name, doc)
        return family

    def gauge(self, name: str, doc: str, labels: dict[str, str], value: float | None) -> None:
        if value is None:
            return  # not measured: no sample rather than a made-up zero
        if value.__class__ not in _NUMBERS:
            value = _number(name, value)
        self._get("gauge", name, doc).rows.append((tuple(labels.items()), value))

    def counter(self, name: str, doc: str, labels: dict[str, str], value: float | None) -> None:
        if value is None:
            return
        if value.__class__ not in _NUMBERS:
            value = _number(name, value)
        if isinstance(value, float):
            # Sums of per-sample deltas carry float noise (6.029999999999997); rounding to
            # a nanosecond / a byte's billionth keeps them monotonic and readable.
            value = round(value, 9)
        # ``name`` ends in _total; the family adds the suffix back when it writes the series.
        family = self._get("counter", name.removesuffix("_total"), doc)
        family.rows.append((tuple(labels.items()), value))

    def info(self, name: str, doc: str, labels: dict[str, str], values: dict[str, str]) -> None:
        pairs = (*labels.items(), *((k, v) for k, v in values.items() if v))
        self._get("info", name, doc).rows.append((pairs, 1))

    def mark(self) -> dict[str, int]:
        """Where each family stands now, for :meth:`rollback`."""
        return {name: len(family.rows) for name, family in self._families.items()}

    def rollback(self, mark: dict[str, int]) -> None:
        """Drop every sample added since ``mark`` (a job whose figures failed half-way)."""
        for name in list(self._families):
            if name not in mark:
                del self._families[name]
            else:
                del self._families[name].rows[mark[name] :]

    def encode(self, labels: LabelTexts | None = None, **options: Any) -> bytes:
        """The exposition text (see :func:`.exposition.encode` for ``options``)."""
        return encode(self._families.values(), labels, **options)

    def __iter__(self) -> Iterator[Metric]:
        for family in self._families.values():
            metric = Metric(family.name, family.doc, family.kind)
            sample = family.sample_name
            for pairs, value in family.rows:
                metric.add_sample(sample, dict(pairs), value)
            yield metric


def add_job(
    f: Families, job: JobState, findings: dict[str, bool] | None, user: str | None = None
) -> None:
    """Every series of one recorded job, labelled with its ``run_id`` (and, from the
    machine's exporter, the ``user`` whose job it is). Never its command or environment."""
    run = {"run_id": job.run_id}
    if user is not None:
        run["user"] = user
    meta = job.meta
    f.gauge("job_recording_up", "1 when the job's recording could be read.", run, 1)
    f.info(
        "job",
        "The recorded job: how it was recorded and with which versions.",
        run,
        {
            "mode": str(meta.get("mode") or ""),
            "torchdoctor_version": str(meta.get("torchdoctor_version") or ""),
            "torch_version": str(meta.get("torch_version") or ""),
            "instrumented": "true" if meta.get("instrumented") else "false",
        },
    )
    f.gauge(
        "job_start_time_seconds",
        "When the recording started (UNIX time).",
        run,
        meta.get("started_at"),
    )
    f.gauge(
        "sample_timestamp_seconds",
        "Time of the latest sample of the job's processes (UNIX time); the job's gauges are "
        "this sample's values.",
        run,
        job.sample_t,
    )
    job_io_known = any(t.io_known for t in job.totals.values())
    for role in ROLES:
        labels = {**run, "role": role}
        now = job.now.get(role)
        tot = job.totals.get(role)
        f.gauge(
            "job_processes",
            "Processes of the job with this role. " + _LAST,
            labels,
            now.processes if now else 0,
        )
        f.gauge(
            "job_threads",
            "Threads of the job's processes. " + _LAST,
            labels,
            now.threads if now else 0,
        )
        f.gauge(
            "job_memory_rss_bytes",
            "Resident memory (RSS) summed over the processes. " + _LAST,
            labels,
            now.rss if now else 0,
        )
        f.gauge(
            "job_memory_pss_bytes",
            "Proportional set size (shared pages split between their users) summed over the "
            "processes; refreshed on a slower tier than the other figures. " + _LAST,
            labels,
            (now.pss if now.pss_known else None) if now else 0,
        )
        f.gauge(
            "job_memory_uss_bytes",
            "Unique set size summed over the processes. " + _LAST,
            labels,
            (now.uss if now.pss_known else None) if now else 0,
        )
        f.gauge(
            "job_memory_swap_bytes",
            "Swapped-out memory of the processes. " + _LAST,
            labels,
            now.swap if now else 0,
        )
        cpu = "CPU time of every process that had this role, ended processes included."
        for mode, value in (
            ("user", tot.cpu_user_s if tot else 0.0),
            ("system", tot.cpu_system_s if tot else 0.0),
        ):
            f.counter("job_cpu_seconds_total", cpu, {**labels, "mode": mode}, value)
        # /proc/<pid>/io needs ptrace rights: when no process of the job could be read, the
        # series are left out rather than shown as zero.
        io_known = job_io_known and (tot is None or tot.io_known)
        f.counter(
            "job_read_bytes_total",
            "Bytes the processes read from storage (/proc/<pid>/io), ended processes included.",
            labels,
            (tot.read_bytes if tot else 0) if io_known else None,
        )
        f.counter(
            "job_written_bytes_total",
            "Bytes the processes wrote to storage, ended processes included.",
            labels,
            (tot.write_bytes if tot else 0) if io_known else None,
        )
    for index, used in sorted(job.gpu_memory.items()):
        gpu = job.gpus.get(index, {})
        f.gauge(
            "job_gpu_memory_used_bytes",
            "GPU memory held by the job's processes. " + _LAST,
            {**run, "gpu": str(index), "uuid": _uuid(gpu)},
            used,
        )
    for rank, s in sorted(job.steps.items()):
        labels = {**run, "rank": rank}
        f.counter("steps_total", "Optimizer steps taken.", labels, s.steps)
        f.counter("step_seconds_total", "Wall time of the steps taken.", labels, s.wall_s)
        f.counter(
            "step_data_wait_seconds_total",
            "Time the steps spent waiting for the DataLoader's next batch.",
            labels,
            s.data_wait_s,
        )
        f.counter(
            "samples_total",
            "Samples consumed by the steps.",
            labels,
            s.samples if s.samples_known else None,
        )
        f.gauge(
            "last_step_timestamp_seconds",
            "When the latest step ended (UNIX time).",
            labels,
            s.last_t_end,
        )
        f.gauge(
            "cuda_memory_allocated_bytes",
            "CUDA memory allocated by tensors at the end of the latest step.",
            labels,
            s.cuda_allocated,
        )
        f.gauge(
            "cuda_memory_reserved_bytes",
            "CUDA memory reserved by the caching allocator at the end of the latest step.",
            labels,
            s.cuda_reserved,
        )
        f.gauge(
            "cuda_memory_max_allocated_bytes",
            "Peak CUDA memory allocated within the latest step.",
            labels,
            s.cuda_max_allocated,
        )
        if s.cuda_alloc_retries:
            f.counter(
                "cuda_alloc_retries_total",
                "Allocations the caching allocator retried after freeing its cache.",
                labels,
                sum(s.cuda_alloc_retries.values()),
            )
        if s.cuda_ooms:
            f.counter(
                "cuda_ooms_total", "CUDA out-of-memory errors.", labels, sum(s.cuda_ooms.values())
            )
    for kind, n in sorted(job.events.items()):
        f.counter(
            "job_events_total",
            "Events the job's instrumentation recorded.",
            {**run, "kind": kind},
            n,
        )
    if findings is not None:
        for rule, active in sorted(findings.items()):
            f.gauge(
                "finding_active",
                "1 while the diagnosis reports this finding for the job (re-run every 30 s "
                "or less often, within a CPU budget).",
                {**run, "rule": rule},
                1 if active else 0,
            )
    host = job.host
    if host is not None:
        f.counter(
            "job_cgroup_cpu_throttled_seconds_total",
            "Time the job's cgroup was throttled by its CPU quota.",
            run,
            host.get("cgroup_throttled_s"),
        )
        f.counter(
            "job_cgroup_cpu_throttled_periods_total",
            "Scheduler periods in which the job's cgroup was throttled.",
            run,
            host.get("cgroup_throttled_periods"),
        )


def add_host(f: Families, host: dict[str, Any]) -> None:
    """The machine, from one host sample (a flattened ``host_samples`` row)."""
    cpu = "CPU time of all the machine's CPUs in each mode, since boot."
    for mode in CPU_MODES:
        f.counter("host_cpu_seconds_total", cpu, {"mode": mode}, host.get(f"cpu_seconds_{mode}"))
    none: dict[str, str] = {}
    for name, doc, key in (
        ("host_load1", "Load average over 1 minute.", "load1"),
        ("host_procs_running", "Runnable tasks.", "procs_running"),
        (
            "host_procs_blocked",
            "Tasks blocked in uninterruptible sleep (mostly I/O).",
            "procs_blocked",
        ),
        ("host_memory_total_bytes", "Memory of the machine.", "mem_total"),
        (
            "host_memory_available_bytes",
            "Memory available to applications (MemAvailable).",
            "mem_available",
        ),
        ("host_swap_total_bytes", "Swap space.", "swap_total"),
        ("host_swap_used_bytes", "Swap space in use.", "swap_used"),
    ):
        f.gauge(name, doc, none, host.get(key))
    for name, doc, key in (
        ("host_context_switches_total", "Context switches since boot.", "ctx_switches"),
        ("host_swap_in_bytes_total", "Bytes swapped in since boot.", "swap_in_bytes"),
        ("host_swap_out_bytes_total", "Bytes swapped out since boot.", "swap_out_bytes"),
        ("host_major_faults_total", "Major page faults since boot.", "major_faults"),
        (
            "host_disk_read_bytes_total",
            "Bytes read from whole disks since boot.",
            "disk_read_bytes",
        ),
        (
            "host_disk_written_bytes_total",
            "Bytes written to whole disks since boot.",
            "disk_written_bytes",
        ),
        (
            "host_pressure_cpu_waiting_seconds_total",
            "Time some runnable task waited for a CPU (PSI some).",
            "psi_cpu_some_s",
        ),
        (
            "host_pressure_memory_waiting_seconds_total",
            "Time some task stalled on memory (PSI some).",
            "psi_memory_some_s",
        ),
        (
            "host_pressure_memory_stalled_seconds_total",
            "Time all non-idle tasks stalled on memory (PSI full).",
            "psi_memory_full_s",
        ),
        (
            "host_pressure_io_waiting_seconds_total",
            "Time some task stalled on I/O (PSI some).",
            "psi_io_some_s",
        ),
        (
            "host_pressure_io_stalled_seconds_total",
            "Time all non-idle tasks stalled on I/O (PSI full).",
            "psi_io_full_s",
        ),
    ):
        f.counter(name, doc, none, host.get(key))


def add_gpus(
    f: Families, available: bool, gpus: Iterable[dict[str, Any]], info: dict[str, Any] | None
) -> None:
    """NVIDIA devices from their latest samples (flattened ``gpu_samples`` rows); ``info`` is
    the run metadata's ``gpus`` entry (names, driver version)."""
    f.gauge("gpu_up", "1 when NVML answers (an NVIDIA driver is loaded).", {}, int(available))
    names = {g.get("index"): g.get("name") for g in (info or {}).get("gpus") or []}
    for g in gpus:
        labels = {"gpu": str(g["index"]), "uuid": _uuid(g)}
        f.info(
            "gpu",
            "The device: model and driver.",
            labels,
            {
                "name": str(names.get(g["index"]) or ""),
                "driver_version": str((info or {}).get("driver_version") or ""),
            },
        )
        util, busy = g.get("utilization_gpu"), g.get("utilization_memory")
        f.gauge(
            "gpu_utilization_ratio",
            "Share of the last sample window in which a kernel ran (NVML utilization.gpu).",
            labels,
            _ratio(util),
        )
        f.gauge(
            "gpu_memory_busy_ratio",
            "Share of the window the memory bus was busy.",
            labels,
            _ratio(busy),
        )
        f.gauge(
            "gpu_memory_used_bytes",
            "Device memory in use (all processes).",
            labels,
            g.get("memory_used"),
        )
        f.gauge("gpu_memory_total_bytes", "Device memory.", labels, g.get("memory_total"))
        f.gauge("gpu_power_watts", "Power draw.", labels, g.get("power_w"))
        f.gauge("gpu_power_limit_watts", "Enforced power limit.", labels, g.get("power_limit_w"))
        f.gauge("gpu_temperature_celsius", "Core temperature.", labels, g.get("temperature_c"))
        mhz = g.get("sm_clock_mhz")
        f.gauge("gpu_sm_clock_hertz", "SM clock.", labels, None if mhz is None else mhz * 1e6)
        reasons = g.get("clock_event_reasons")
        if isinstance(reasons, str):  # a recording's JSON column
            reasons = json.loads(reasons)
        if reasons is not None:
            # One series a known reason, 0 or 1: a reason that stops shows as 0, not a gap.
            for reason in [name for _bit, name in CLOCK_EVENT_REASONS] + [
                r for r in reasons if r.startswith("other_")
            ]:
                f.gauge(
                    "gpu_clock_event_reason_active",
                    "1 while NVML names this reason for holding the clocks down (throttling).",
                    {**labels, "reason": reason},
                    int(reason in reasons),
                )
        f.gauge(
            "gpu_pcie_rx_bytes_per_second",
            "PCIe receive throughput as NVML reports it (a rate, NVML keeps no counter).",
            labels,
            g.get("pcie_rx_per_s"),
        )
        f.gauge(
            "gpu_pcie_tx_bytes_per_second",
            "PCIe transmit throughput as NVML reports it.",
            labels,
            g.get("pcie_tx_per_s"),
        )
        for kind in ("corrected", "uncorrected"):
            f.counter(
                "gpu_ecc_errors",
                "ECC errors since the driver loaded (NVML volatile counters).",
                {**labels, "kind": kind},
                g.get(f"ecc_{kind}"),
            )
        f.counter(
            "gpu_xid_errors",
            "Xid critical errors (NVML events) seen since torchdoctor started reading.",
            labels,
            g.get("xid_count"),
        )


def _ratio(percent: float | None) -> float | None:
    return None if percent is None else percent / 100.0


def _uuid(gpu: dict[str, Any]) -> str:
    """As NVML spells it (``GPU-...``), so the series join with dcgm-exporter's."""
    return str(gpu.get("uuid") or "")
