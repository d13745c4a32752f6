"""io-wait: CPUs wait on storage above the table's limit while the job runs.

Where the job reads is told from the per-process read rates: the job's share of the disk
reads says whether the waiting is the job's own I/O or somebody else's.
"""

from __future__ import annotations

from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.diagnosis.findings import Evidence, Finding
from torchdoctor.diagnosis.series import mean
from torchdoctor.units import fmt_bytes, fmt_rate

ID = "io-wait"


def check(ctx: DiagnosisContext) -> list[Finding]:
    span = ctx.sustained(ctx.host_series("cpu_iowait"), ctx.thresholds.iowait_alert_pct)
    if span is None:
        return []
    t0, t1 = span.t_start, span.t_end
    readers: dict[int, float] = {}
    for pid, samples in ctx.samples_by_pid.items():
        rates = [
            s["read_bytes_per_s"]
            for s in samples
            if t0 <= s["t"] <= t1 and s["read_bytes_per_s"] is not None
        ]
        if rates:
            readers[pid] = sum(rates) / len(rates)
    job_read = sum(readers.values())
    disk_read = mean([v for t, v in ctx.host_series("disk_read_per_s") if t0 <= t <= t1])
    job_write = 0.0
    for samples in ctx.samples_by_pid.values():
        rates = [
            s["write_bytes_per_s"]
            for s in samples
            if t0 <= s["t"] <= t1 and s["write_bytes_per_s"] is not None
        ]
        if rates:
            job_write += sum(rates) / len(rates)
    blocked = mean([v for t, v in ctx.host_series("procs_blocked") if t0 <= t <= t1])
    psi_io = mean([v for t, v in ctx.host_series("psi_io_some") if t0 <= t <= t1])
    evidence = [
        Evidence("I/O wait share of CPU time", round(span.mean, 1), "%", t0, t1),
        Evidence("peak I/O wait", round(span.peak, 1), "%", t0, t1),
        Evidence("job reads", round(job_read), "B/s", t0, t1),
        Evidence("job writes", round(job_write), "B/s", t0, t1),
    ]
    if disk_read is not None:
        evidence.append(Evidence("disk reads (whole machine)", round(disk_read), "B/s", t0, t1))
    if blocked is not None:
        evidence.append(Evidence("tasks blocked on I/O", round(blocked, 1), "tasks", t0, t1))
    if psi_io is not None:
        evidence.append(Evidence("I/O pressure (PSI some, avg10)", round(psi_io, 1), "%", t0, t1))

    job_io = job_read + job_write
    machine_io = (disk_read or 0.0) + (
        mean([v for t, v in ctx.host_series("disk_write_per_s") if t0 <= t <= t1]) or 0.0
    )
    theirs = machine_io > 0 and job_io < 0.2 * machine_io
    if theirs:
        return [
            Finding(
                id=ID,
                severity="warning",
                title=f"CPUs wait {span.mean:.0f} % of the time on I/O caused by other processes",
                evidence=evidence,
                recommendation=(
                    f"The job moves {fmt_rate(job_io)} of the machine's {fmt_rate(machine_io)}: "
                    "find the other heavy reader/writer (iotop) or move the job's data to a disk "
                    "of its own."
                ),
                expected_effect="The job's own reads stop queueing behind other I/O.",
                confidence=0.6,
            )
        ]
    top = max(readers, key=readers.get) if readers else None
    where = ""
    if top is not None and readers[top] > 0:
        where = f" Most of it is read by pid {top} ({ctx.role_of(top)}, {fmt_rate(readers[top])})."
    read_total = job_read * max(ctx.duration, 0.0)
    available = mean([v for t, v in ctx.host_series("mem_available") if t0 <= t <= t1])
    cache_hint = (
        "move the data to faster local storage (NVMe) or pack it into fewer large files "
        "(LMDB, HDF5, WebDataset shards)"
    )
    if available and read_total and read_total < 0.5 * available:
        cache_hint = (
            f"the job read {fmt_bytes(read_total)} in this run and {fmt_bytes(available)} of RAM "
            "is available: preload the data set into memory (or copy it to /dev/shm) once, then "
            "train from RAM"
        )
    settings: dict[str, object] = {}
    loader_fix = next((f for f in ctx.findings if f.id == "dataloader-bound"), None)
    recommendation = f"I/O wait {span.mean:.0f} % > {ctx.thresholds.iowait_alert_pct:g} %:{where} {cache_hint[0].upper()}{cache_hint[1:]}."
    if loader_fix is not None and "num_workers" in loader_fix.settings:
        settings = dict(loader_fix.settings)
        recommendation += (
            f" Meanwhile num_workers={settings['num_workers']} overlaps the reads with compute "
            "(see dataloader-bound)."
        )
    if job_write > job_read and job_write > 0:
        recommendation += (
            f" The job writes {fmt_rate(job_write)}: save checkpoints/logs less often or "
            "asynchronously, and avoid fsync per step."
        )
    return [
        Finding(
            id=ID,
            severity="critical" if span.mean > 4 * ctx.thresholds.iowait_alert_pct else "warning",
            title=f"CPUs wait {span.mean:.0f} % of the time on storage while the job runs",
            evidence=evidence,
            recommendation=recommendation,
            expected_effect=(
                f"I/O wait back under {ctx.thresholds.iowait_best_pct:g} %; steps stop stalling "
                "on reads."
            ),
            confidence=0.8 if job_io > 0 else 0.6,
            settings=settings,
            details="I/O wait is CPU time with nothing to run while a task waits for storage (/proc/stat).",
        )
    ]
