"""From a recording to the data of a report: the summary, findings, charts and tables.

Everything here is plain computation over :class:`~torchdoctor.recording.Recording` rows, so
it is tested without a browser; :mod:`torchdoctor.report.html` only draws the result. The
charts live in :mod:`torchdoctor.report.charts`, the tables in :mod:`torchdoctor.report.tables`.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable

from torchdoctor.diagnosis.findings import SEVERITIES, Finding
from torchdoctor.recording.reader import Recording
from torchdoctor.recording.steps import step_stats
from torchdoctor.report.charts import (
    MAX_POINTS,
    ChartContext,
    column,
    core_heatmap,
    cpu_chart,
    disk_chart,
    event_markers,
    gpu_unavailable_reason,
    gpu_util_chart,
    iowait_chart,
    memory_chart,
    share,
    step_chart,
    sum_by_time,
    sustained_level,
    swap_chart,
    swap_traffic,
    vram_chart,
)
from torchdoctor.report.model import (
    Figure,
    ReportData,
)
from torchdoctor.report.scales import (
    BYTES,
    BYTES_PER_S,
    PERCENT,
    SECONDS,
    fmt_value,
)
from torchdoctor.report.tables import (
    dataloader_rows,
    event_rows,
    exit_text,
    meta_sections,
    precision_rows,
    process_tree,
    settings_rows,
    threshold_rows,
)
from torchdoctor.sampling.types import usable_cpus_of
from torchdoctor.thresholds import Thresholds
from torchdoctor.units import fmt_duration

# Only the columns drawn: a recording of hours holds hundreds of thousands of rows.
HOST_COLUMNS = [
    "t",
    "cpu_busy",
    "cpu_iowait",
    "mem_total",
    "mem_used",
    "swap_used",
    "swap_in_per_s",
    "swap_out_per_s",
    "disk_read_per_s",
    "disk_write_per_s",
    "unavailable",
]


GPU_COLUMNS = ["t", "index", "utilization_gpu", "memory_used", "memory_total", "unavailable"]


# The timeline that shows each finding's evidence best (finding id -> chart id).
FINDING_CHARTS = {
    "dataloader-bound": "steps",
    "workers-not-persistent": "steps",
    "pin-memory-off": "steps",
    "thread-oversubscription": "cpu-cores",
    "cpu-saturated": "cpu",
    "cpu-contention": "cpu",
    "io-wait": "iowait",
    "swap-thrash": "swap",
    "host-memory-leak": "memory",
    "dataloader-copy-on-access": "memory",
    "vram-near-full": "vram",
    "vram-underused": "vram",
    "cuda-fragmentation": "vram",
    "no-mixed-precision": "gpu-util",
    "gpu-throttled": "gpu-util",
    "gpu-hardware-errors": "gpu-util",
    "gpu-underused": "gpu-util",
    "gpu-idle-cpu-training": "gpu-util",
}


Diagnose = Callable[[Recording, Thresholds], list[Finding]]


def build_report_data(
    rec: Recording,
    thresholds: Thresholds,
    *,
    diagnose: Diagnose | None = None,
    max_points: int = MAX_POINTS,
) -> ReportData:
    """Read ``rec`` once and compute everything the report shows.

    ``diagnose`` defaults to the diagnosis engine; a failure there is shown in the report
    instead of costing the user the rest of it.
    """
    meta = rec.meta
    host = rec.rows("host_samples", columns=HOST_COLUMNS)
    procs = rec.rows(
        "process_samples",
        columns=["t", "pid", "create_time", "role", "cpu_percent", "rss", "pss", "swap"]
        + ["threads", "read_bytes_per_s"],
    )
    gpus = rec.rows("gpu_samples", columns=GPU_COLUMNS)
    gpu_procs = rec.rows("gpu_process_samples", columns=["t", "gpu_index", "used_memory", "in_job"])
    steps = rec.rows("steps")
    events = rec.rows("events")
    settings = rec.rows("settings")
    loaders = rec.rows("dataloaders")

    t0 = _origin(meta, host, procs, steps)
    end = rec.ended_at
    span = max(0.0, (end - t0) if end is not None else 0.0)
    cpus = usable_cpus_of(meta.get("host"))
    ctx = ChartContext(t0=t0, max_points=max_points, thresholds=thresholds)

    findings, note = _run_diagnosis(rec, thresholds, diagnose)
    markers = event_markers(events, ctx)
    charts = [
        cpu_chart(host, procs, cpus, ctx),
        iowait_chart(host, ctx),
        disk_chart(host, procs, ctx),
        memory_chart(host, procs, meta, ctx),
        swap_chart(host, ctx),
        gpu_util_chart(gpus, meta, ctx),
        vram_chart(gpus, gpu_procs, meta, ctx),
        step_chart(steps, markers, ctx),
    ]
    process_rows, process_count = process_tree(rec.processes(), procs, t0)
    summary, verdict, level = _summary(
        meta, host, procs, gpus, steps, loaders, settings, findings, note, span, cpus, thresholds
    )
    return ReportData(
        title=_command(meta) or rec.path.name,
        command=_command(meta),
        source=str(rec.path),
        started_at=meta.get("started_at"),
        span_s=span,
        complete=rec.complete,
        state_notes=rec.notes(),
        verdict=verdict,
        verdict_level=level,
        summary=summary,
        charts=charts,
        cores=core_heatmap(rec, meta, ctx),
        processes=process_rows,
        process_count=process_count,
        settings=settings_rows(settings, {p["pid"]: p["role"] for p in rec.processes()}),
        dataloaders=dataloader_rows(loaders),
        precision=precision_rows(steps),
        findings=findings,
        diagnosis_note=note,
        meta=meta_sections(meta, rec),
        events=event_rows(events, t0),
        thresholds=threshold_rows(thresholds),
    )


def _run_diagnosis(
    rec: Recording, thresholds: Thresholds, diagnose: Diagnose | None
) -> tuple[list[Finding], str | None]:
    if diagnose is None:
        try:
            from torchdoctor.diagnosis.engine import diagnose as engine_diagnose
        except ImportError:
            return [], "the diagnosis engine is not part of this installation"
        diagnose = engine_diagnose
    try:
        findings = list(diagnose(rec, thresholds))
    except Exception as exc:  # a rule's bug must not cost the user the charts
        return [], f"the diagnosis failed ({type(exc).__name__}: {exc}); the charts are complete"
    rank = {s: i for i, s in enumerate(SEVERITIES)}
    findings.sort(key=lambda f: (rank.get(f.severity, len(rank)), -f.confidence))
    return findings, None


def _summary(
    meta: dict,
    host: list[dict],
    procs: list[dict],
    gpus: list[dict],
    steps: list[dict],
    loaders: list[dict],
    settings: list[dict],
    findings: list[Finding],
    note: str | None,
    span: float,
    cpus: float | None,
    th: Thresholds,
) -> tuple[list[Figure], str, str]:
    duration = fmt_duration(span) if meta.get("started_at") is not None and span > 0 else "n/a"
    figures = [Figure("Duration", duration, exit_text(meta.get("exit_status")), "none")]
    if steps:
        stats = step_stats(steps, loaders, settings)
        rate = (
            f", {fmt_value(stats.samples_per_s, '')} samples/s"
            if stats.samples_per_s is not None
            else ""
        )
        figures.append(
            Figure(
                "Steps",
                f"{stats.step_count:,}",
                f"median {fmt_value(stats.median_step_s, SECONDS)} per step{rate}",
                "none",
            )
        )
        if stats.data_wait_fraction is not None:
            figures.append(
                Figure(
                    "Data wait",
                    fmt_value(100.0 * stats.data_wait_fraction, PERCENT),
                    "of step time spent waiting for the DataLoader",
                    "none",
                )
            )
    busy = [r["cpu_busy"] for r in host if r["cpu_busy"] is not None]
    if busy:
        mean = sum(busy) / len(busy)
        where = f"of {fmt_value(cpus, '')} allowed CPUs" if cpus else "of all CPUs"
        level = sustained_level(
            column(host, "cpu_busy"), th.cpu_load_best_pct, th.cpu_load_alert_pct, th
        )
        peak = fmt_value(max(busy), PERCENT)
        figures.append(
            Figure("CPU busy (mean)", fmt_value(mean, PERCENT), f"{where}, peak {peak}", level)
        )
    iowait = [r["cpu_iowait"] for r in host if r["cpu_iowait"] is not None]
    if iowait:
        mean = sum(iowait) / len(iowait)
        level = sustained_level(
            column(host, "cpu_iowait"), th.iowait_best_pct, th.iowait_alert_pct, th
        )
        peak = fmt_value(max(iowait), PERCENT)
        figures.append(Figure("I/O wait (mean)", fmt_value(mean, PERCENT), f"peak {peak}", level))
    job_cpu = [v for _, v in sum_by_time(procs, "cpu_percent") if v is not None]
    if job_cpu:
        of = f" of {fmt_value(cpus, '')} allowed" if cpus else ""
        figures.append(
            Figure(
                "Job CPU (mean)",
                f"{fmt_value(sum(job_cpu) / len(job_cpu) / 100, '')} cores",
                f"all its processes{of}, peak {fmt_value(max(job_cpu) / 100, '')} cores",
                "none",
            )
        )
    pss = [v for _, v in sum_by_time(procs, "pss") if v is not None]
    rss = [v for _, v in sum_by_time(procs, "rss") if v is not None]
    if pss or rss:
        label, values = ("Job memory (peak PSS)", pss) if pss else ("Job memory (peak RSS)", rss)
        total = (meta.get("host") or {}).get("mem_total")
        detail = f"of {fmt_value(total, BYTES)} RAM" if total else ""
        figures.append(Figure(label, fmt_value(max(values), BYTES), detail, "none"))
    traffic = swap_traffic(host)
    measured = [v for _, v in traffic if v is not None]
    if measured:
        level = sustained_level(traffic, th.swap_best_bytes_per_s, th.swap_alert_bytes_per_s, th)
        figures.append(
            Figure(
                "Swap traffic (mean)",
                fmt_value(sum(measured) / len(measured), BYTES_PER_S),
                f"in + out, peak {fmt_value(max(measured), BYTES_PER_S)}",
                level,
            )
        )
    util = [r["utilization_gpu"] for r in gpus if r["utilization_gpu"] is not None]
    if util:
        figures.append(
            Figure(
                "GPU utilization (mean)",
                fmt_value(sum(util) / len(util), PERCENT),
                "share of time a kernel was running",
                "none",
            )
        )
    vram = [(r["t"], share(r["memory_used"], r["memory_total"])) for r in gpus]
    peak_vram = max((v for _, v in vram if v is not None), default=None)
    if peak_vram is not None:
        levels = [
            sustained_level(
                [p for p, r in zip(vram, gpus, strict=True) if r["index"] == index],
                th.gpu_memory_best_high_pct,
                th.gpu_memory_alert_pct,
                th,
            )
            for index in {r["index"] for r in gpus}
        ]
        level = "alert" if "alert" in levels else "warn" if "warn" in levels else "ok"
        figures.append(
            Figure("VRAM (peak)", fmt_value(peak_vram, PERCENT), "of GPU memory in use", level)
        )
    elif not gpus:
        figures.append(Figure("GPU", "none", gpu_unavailable_reason(meta, gpus) or "", "none"))

    counts = {s: sum(1 for f in findings if f.severity == s) for s in SEVERITIES}
    if not (host or procs or steps):
        verdict, level = (
            "Nothing to judge: this recording holds no samples (the job ended before the "
            "first one was taken).",
            "none",
        )
    elif note:
        verdict, level = f"No diagnosis: {note}.", "none"
    elif counts["critical"] or counts["warning"]:
        top = findings[0]
        others = counts["critical"] + counts["warning"] - 1
        more = f" (and {others} more problem{'s' if others != 1 else ''})" if others else ""
        verdict, level = f"{top.title}{more}", "alert" if counts["critical"] else "warn"
    else:
        extra = (
            f"; {counts['info']} note{'s' if counts['info'] != 1 else ''} below"
            if counts["info"]
            else ""
        )
        verdict, level = (
            f"No bottleneck found: no figure stayed beyond the threshold table and no rule "
            f"fired{extra}.",
            "ok",
        )
    return figures, verdict, level


def _origin(meta: dict, *tables: list[dict]) -> float:
    started = meta.get("started_at")
    if isinstance(started, (int, float)):
        return float(started)
    firsts = [rows[0].get("t", rows[0].get("t_end")) for rows in tables if rows]
    firsts = [t for t in firsts if t is not None]
    return min(firsts) if firsts else time.time()


def _command(meta: dict) -> str | None:
    command = meta.get("command") or []
    return shlex.join(str(a) for a in command) if command else None
