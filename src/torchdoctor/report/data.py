"""From a recording to the data of a report: the summary, findings, charts and tables.

Everything here is plain computation over :class:`~torchdoctor.recording.Recording` rows, so
it is tested without a browser; :mod:`torchdoctor.report.html` only draws the result. The
charts live in :mod:`torchdoctor.report.charts`, the tables in :mod:`torchdoctor.report.tables`.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable

from torchdoctor.diagnosis.cuda_memory import recorded_snapshots
from torchdoctor.diagnosis.findings import SEVERITIES, Finding
from torchdoctor.recording.frame import SampleFrame
from torchdoctor.recording.profiles import read_profiles
from torchdoctor.recording.reader import Instants, Recording
from torchdoctor.recording.steps import FoldedSteps, step_stats
from torchdoctor.report.charts import (
    MAX_POINTS,
    ChartContext,
    core_heatmap,
    cpu_chart,
    disk_chart,
    event_markers,
    gpu_unavailable_reason,
    gpu_util_chart,
    iowait_chart,
    memory_chart,
    step_chart,
    sustained_level,
    swap_chart,
    vram_chart,
)
from torchdoctor.report.model import (
    Figure,
    ReportData,
)
from torchdoctor.report.readings import SWAP_TRAFFIC, Readings, instants_of, read_readings
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
    process_tree_of,
    read_process_stats,
    settings_rows,
    threshold_rows,
)
from torchdoctor.sampling.types import usable_cpus_of
from torchdoctor.thresholds import Thresholds
from torchdoctor.units import fmt_duration

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
    # their saving is per step: the step-time timeline shows what it is taken from
    "accumulation-without-no-sync": "steps",
    "unused-parameters-search": "steps",
}


Diagnose = Callable[[Recording, Thresholds], list[Finding]]


def build_report_data(
    rec: Recording,
    thresholds: Thresholds,
    *,
    diagnose: Diagnose | None = None,
    max_points: int = MAX_POINTS,
) -> ReportData:
    """Read ``rec`` and compute everything the report shows.

    The samples are summed up in SQL and streamed (:mod:`torchdoctor.report.readings`) and
    the steps read as column arrays (``Recording.frame``): no Python object is held per
    sample or step, so a week-long recording reports in the memory of an hour-long one.
    ``diagnose`` defaults to the diagnosis engine; a failure there is shown in the report
    instead of costing the user the rest of it.
    """
    meta = rec.meta
    steps = rec.frame("steps")
    events = rec.rows("events")
    settings = rec.rows("settings")
    loaders = rec.rows("dataloaders")

    t0 = _origin(meta, rec)
    end = rec.ended_at
    span = max(0.0, (end - t0) if end is not None else 0.0)
    cpus = usable_cpus_of(meta.get("host"))
    ctx = ChartContext(t0=t0, max_points=max_points, thresholds=thresholds)
    instants = instants_of(rec)
    readings = read_readings(rec, t0, max_points, thresholds, cpus, instants)

    findings, note = _run_diagnosis(rec, thresholds, diagnose)
    markers = event_markers(events, ctx)
    charts = [
        cpu_chart(readings, cpus, ctx),
        iowait_chart(readings, ctx),
        disk_chart(readings, ctx),
        memory_chart(readings, meta, ctx),
        swap_chart(readings, ctx),
        gpu_util_chart(readings, meta, ctx),
        vram_chart(readings, meta, ctx),
        step_chart(steps, markers, ctx),
    ]
    infos = rec.processes()
    process_rows, process_count = process_tree_of(
        infos, read_process_stats(rec, instants["process_samples"]), t0
    )
    summary, verdict, level = _summary(
        meta,
        readings,
        steps,
        loaders,
        settings,
        findings,
        note,
        span,
        cpus,
        thresholds,
        rec.folded_steps,
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
        cores=core_heatmap(rec, meta, ctx, instants["host_samples"]),
        resolution_note=_resolution_note(instants),
        processes=process_rows,
        process_count=process_count,
        settings=settings_rows(settings, {p["pid"]: p["role"] for p in infos}),
        dataloaders=dataloader_rows(loaders),
        precision=precision_rows(steps, rec.folded_steps.values()),
        findings=findings,
        diagnosis_note=note,
        meta=meta_sections(meta, rec),
        events=event_rows(events, t0),
        thresholds=threshold_rows(thresholds),
        profiles=read_profiles(rec),
        memory=recorded_snapshots(rec),
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
    readings: Readings,
    steps: SampleFrame,
    loaders: list[dict],
    settings: list[dict],
    findings: list[Finding],
    note: str | None,
    span: float,
    cpus: float | None,
    th: Thresholds,
    folded: dict[int, FoldedSteps],
) -> tuple[list[Figure], str, str]:
    # Means and peaks are the readings' own: over every measured sample, not the buckets.
    duration = fmt_duration(span) if meta.get("started_at") is not None and span > 0 else "n/a"
    figures = [Figure("Duration", duration, exit_text(meta.get("exit_status")), "none")]
    if len(steps):
        stats = step_stats(steps, loaders, settings, folded)
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
    busy = readings.host["cpu_busy"]
    if busy.measured:
        where = f"of {fmt_value(cpus, '')} allowed CPUs" if cpus else "of all CPUs"
        level = sustained_level(busy, th.cpu_load_best_pct, th.cpu_load_alert_pct)
        peak = fmt_value(busy.peak, PERCENT)
        figures.append(
            Figure("CPU busy (mean)", fmt_value(busy.mean, PERCENT), f"{where}, peak {peak}", level)
        )
    iowait = readings.host["cpu_iowait"]
    if iowait.measured:
        level = sustained_level(iowait, th.iowait_best_pct, th.iowait_alert_pct)
        peak = fmt_value(iowait.peak, PERCENT)
        figures.append(
            Figure("I/O wait (mean)", fmt_value(iowait.mean, PERCENT), f"peak {peak}", level)
        )
    job_cpu = readings.job["cpu_percent"]
    if job_cpu.measured:
        of = f" of {fmt_value(cpus, '')} allowed" if cpus else ""
        figures.append(
            Figure(
                "Job CPU (mean)",
                f"{fmt_value(job_cpu.mean / 100, '')} cores",  # type: ignore[operator]
                f"all its processes{of}, peak {fmt_value(job_cpu.peak / 100, '')} cores",  # type: ignore[operator]
                "none",
            )
        )
    pss, rss = readings.job["pss"], readings.job["rss"]
    if pss.measured or rss.measured:
        label, values = (
            ("Job memory (peak PSS)", pss) if pss.measured else ("Job memory (peak RSS)", rss)
        )
        total = (meta.get("host") or {}).get("mem_total")
        detail = f"of {fmt_value(total, BYTES)} RAM" if total else ""
        figures.append(Figure(label, fmt_value(values.peak, BYTES), detail, "none"))
    traffic = readings.host[SWAP_TRAFFIC]
    if traffic.measured:
        level = sustained_level(traffic, th.swap_best_bytes_per_s, th.swap_alert_bytes_per_s)
        figures.append(
            Figure(
                "Swap traffic (mean)",
                fmt_value(traffic.mean, BYTES_PER_S),
                f"in + out, peak {fmt_value(traffic.peak, BYTES_PER_S)}",
                level,
            )
        )
    if readings.gpu_util_mean is not None:
        figures.append(
            Figure(
                "GPU utilization (mean)",
                fmt_value(readings.gpu_util_mean, PERCENT),
                "share of time a kernel was running",
                "none",
            )
        )
    vram = [r for r in readings.gpu_memory.values() if r.measured]
    if vram:
        levels = [
            sustained_level(r, th.gpu_memory_best_high_pct, th.gpu_memory_alert_pct) for r in vram
        ]
        level = "alert" if "alert" in levels else "warn" if "warn" in levels else "ok"
        peak_vram = max(r.peak for r in vram)  # type: ignore[type-var]
        figures.append(
            Figure("VRAM (peak)", fmt_value(peak_vram, PERCENT), "of GPU memory in use", level)
        )
    elif not readings.gpu_sampled:
        reason = gpu_unavailable_reason(meta, readings.gpu_sampled)
        figures.append(Figure("GPU", "none", reason or "", "none"))

    counts = {s: sum(1 for f in findings if f.severity == s) for s in SEVERITIES}
    if not (readings.host_sampled or readings.roles or len(steps)):
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


def _origin(meta: dict, rec: Recording) -> float:
    started = meta.get("started_at")
    if isinstance(started, (int, float)):
        return float(started)
    firsts = [
        t
        for (t,) in rec.iter_query(
            "SELECT MIN(t) FROM host_samples UNION ALL SELECT MIN(t) FROM process_samples"
            " UNION ALL SELECT MIN(t_end) FROM steps"
        )
        if t is not None
    ]
    return min(firsts) if firsts else time.time()


def _resolution_note(instants: dict[str, Instants]) -> str | None:
    """What the timelines rest on when the recording was too long to read every sample."""
    every = max((i.every_s for i in instants.values() if i.every_s), default=None)
    if every is None:
        return None
    return (
        "A long recording: the timelines and the process table read one sampling instant"
        f" every {fmt_duration(every)}, spread over the whole run (means over those"
        " instants, peaks their maxima)."
    )


def _command(meta: dict) -> str | None:
    command = meta.get("command") or []
    return shlex.join(str(a) for a in command) if command else None
