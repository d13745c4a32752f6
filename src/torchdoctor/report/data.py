"""From a recording to the data of a report: series per chart, process tree, settings, metadata.

Everything here is plain computation over :class:`~torchdoctor.recording.Recording` rows, so
it is tested without a browser; :mod:`torchdoctor.report.html` only draws the result.
"""

from __future__ import annotations

import json
import shlex
import signal
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

from torchdoctor.diagnosis.context import sustained_span
from torchdoctor.diagnosis.findings import SEVERITIES, Finding
from torchdoctor.instrument.stats import step_stats
from torchdoctor.recording.reader import Recording
from torchdoctor.report.downsample import Point, downsample_minmax
from torchdoctor.report.model import (
    AlertSpan,
    Band,
    Chart,
    EventRow,
    Figure,
    Heatmap,
    Marker,
    MetaSection,
    ProcessRow,
    RefLine,
    ReportData,
    Series,
    SettingRow,
)
from torchdoctor.report.units import (
    BYTES,
    BYTES_PER_S,
    PERCENT,
    SECONDS,
    fmt_duration,
    fmt_utc,
    fmt_value,
)
from torchdoctor.thresholds import Thresholds

# Points drawn per series: two per bucket, about one per pixel of a 1000 px wide chart.
MAX_POINTS = 1200
# Siblings of one role beyond this many are folded into one row of the process tree.
FOLD_SIBLINGS_OVER = 6
SHOWN_WHEN_FOLDED = 3

ROLE_LABELS = {
    "trainer": "trainer",
    "dataloader-worker": "DataLoader workers",
    "rank": "ranks",
    "launcher": "launcher",
    "other": "other processes",
}

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
    "io-wait": "iowait",
    "swap-thrash": "swap",
    "host-memory-leak": "memory",
    "dataloader-copy-on-access": "memory",
    "vram-near-full": "vram",
    "vram-underused": "vram",
    "cuda-fragmentation": "vram",
    "no-mixed-precision": "gpu-util",
    "gpu-throttled": "gpu-util",
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
    cpus = usable_cpus(meta)
    ctx = _Ctx(t0=t0, max_points=max_points, thresholds=thresholds)

    findings, note = _run_diagnosis(rec, thresholds, diagnose)
    markers = _markers(events, ctx)
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
        title=_title(meta, rec),
        source=str(rec.path),
        started_at=meta.get("started_at"),
        span_s=span,
        complete=rec.complete,
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


class _Ctx:
    __slots__ = ("t0", "max_points", "thresholds")

    def __init__(self, t0: float, max_points: int, thresholds: Thresholds) -> None:
        self.t0 = t0
        self.max_points = max_points
        self.thresholds = thresholds


# -- series ------------------------------------------------------------------------------


def make_series(
    label: str, points: Iterable[Point], ctx: _Ctx, *, dashed: bool = False
) -> Series | None:
    """A drawable series from (UNIX time, value) points; None when nothing was measured."""
    shifted = sorted(((t - ctx.t0, v) for t, v in points), key=lambda p: p[0])
    values = [v for _, v in shifted if v is not None]
    if not values:
        return None
    return Series(
        label=label,
        points=downsample_minmax(shifted, ctx.max_points),
        samples=len(values),
        mean=sum(values) / len(values),
        peak=max(values),
        dashed=dashed,
    )


def _column(rows: list[dict[str, Any]], key: str) -> list[Point]:
    return [(r["t"], r[key]) for r in rows]


def _sum_by_time(
    rows: list[dict[str, Any]], key: str, keep: Callable[[dict[str, Any]], bool] = lambda r: True
) -> list[Point]:
    """Per sampling instant, the sum of ``key`` over the rows kept; None if any is unknown."""
    totals: dict[float, float | None] = {}
    for r in rows:
        if not keep(r):
            continue
        value = r[key]
        if r["t"] not in totals:
            totals[r["t"]] = value
        elif totals[r["t"]] is None or value is None:
            # A sum over part of the job would understate it: unknown, not smaller.
            totals[r["t"]] = None
        else:
            totals[r["t"]] += value
    return sorted(totals.items())


def sustained_level(points: list[Point], best: float, alert: float, th: Thresholds) -> str:
    """'alert' or 'warn' when the reading stays beyond that limit (as the diagnosis counts
    sustained), else 'ok': a single spike does not colour the summary."""
    measured = [(t, v) for t, v in points if v is not None]
    if sustained_span(measured, alert, th):
        return "alert"
    if sustained_span(measured, best, th):
        return "warn"
    return "ok"


def alert_spans(
    points: list[Point], limit: float, what: str, unit: str, ctx: _Ctx
) -> list[AlertSpan]:
    """The longest sustained stretch beyond ``limit``, in elapsed time, to shade on a chart."""
    span = sustained_span([(t, v) for t, v in points if v is not None], limit, ctx.thresholds)
    if span is None:
        return []
    return [
        AlertSpan(
            span.t_start - ctx.t0,
            span.t_end - ctx.t0,
            f"{what} stayed above the alert limit ({fmt_value(limit, unit)}) for "
            f"{fmt_duration(span.t_end - span.t_start)}: mean {fmt_value(span.mean, unit)}",
        )
    ]


def swap_traffic(host: list[dict]) -> list[Point]:
    """Swap in + out per sample, bytes/s: the threshold table's "swap traffic"."""
    out: list[Point] = []
    for r in host:
        a, b = r["swap_in_per_s"], r["swap_out_per_s"]
        out.append((r["t"], None if a is None and b is None else (a or 0.0) + (b or 0.0)))
    return out


def _unavailable_reason(rows: list[dict[str, Any]], *fields: str) -> str | None:
    """The reason a reader gave for a field it could not read, if it gave one."""
    for r in rows:
        missing = r.get("unavailable") or {}
        for name in fields:
            if name in missing:
                return f"{name}: {missing[name]}"
    return None


def _nothing(chart: Chart, reason: str) -> Chart:
    chart.series = []
    chart.unavailable = reason
    return chart


def _present(series: Iterable[Series | None]) -> list[Series]:
    return [s for s in series if s is not None]


# -- charts ------------------------------------------------------------------------------


def cpu_chart(host: list[dict], procs: list[dict], cpus: float | None, ctx: _Ctx) -> Chart:
    th = ctx.thresholds
    allowed = f"{fmt_value(cpus, '')} allowed CPUs" if cpus else "all CPUs"
    chart = Chart(
        id="cpu",
        title="CPU",
        unit=PERCENT,
        series=[],
        note=(
            f"Share of {allowed}. The job's processes are summed per role "
            "(100 % = every allowed CPU busy). The threshold table's CPU load row is shaded."
        ),
        bands=[
            Band(
                "best",
                0.0,
                th.cpu_load_best_pct,
                f"best ≤ {fmt_value(th.cpu_load_best_pct, PERCENT)}",
            ),
            Band(
                "alert",
                th.cpu_load_alert_pct,
                None,
                f"alert > {fmt_value(th.cpu_load_alert_pct, PERCENT)} sustained",
            ),
        ],
        y_max=100.0,
    )
    busy = _column(host, "cpu_busy")
    chart.alerts = alert_spans(busy, th.cpu_load_alert_pct, "CPU load", PERCENT, ctx)
    series: list[Series | None] = [make_series("machine busy", busy, ctx)]
    if cpus:
        for role in _roles_in(procs):
            points = _sum_by_time(procs, "cpu_percent", lambda r, role=role: r["role"] == role)
            scaled = [(t, None if v is None else v / cpus) for t, v in points]
            series.append(make_series(f"job: {ROLE_LABELS.get(role, role)}", scaled, ctx))
    chart.series = _present(series)
    if not chart.series:
        return _nothing(chart, _no_host(host) or "no CPU figures were recorded")
    return chart


# Cells drawn in the per-CPU heatmap at most (rows x columns), and columns at most.
MAX_HEATMAP_CELLS = 24_000
MAX_HEATMAP_COLUMNS = 300


def core_heatmap(rec: Recording, meta: dict, ctx: _Ctx) -> Heatmap:
    """Mean busy share (user + system + irq...) of each allowed CPU per time bucket."""
    heatmap = Heatmap(
        id="cpu-cores",
        title="CPU per core",
        rows=[],
        t_edges=[],
        cells=[],
        note=(
            "One row per CPU the job may run on; darker is busier (time not idle and not "
            "waiting for I/O). Pale rows while the job runs are CPUs it leaves unused."
        ),
    )
    columns = ["t", "per_core"] + (
        ["per_core_ids"] if "per_core_ids" in rec.columns("host_samples") else []
    )
    rows = [r for r in rec.rows("host_samples", columns=columns) if r.get("per_core")]
    if not rows:
        heatmap.unavailable = "no per-CPU figures were recorded"
        return heatmap
    ncores = max(len(r["per_core"]) for r in rows)
    ids = rows[-1].get("per_core_ids") or (meta.get("host") or {}).get("allowed_cpus")
    if not ids or len(ids) != ncores:
        ids = list(range(ncores))
    heatmap.rows = [f"CPU {i}" for i in ids]
    ncols = max(1, min(MAX_HEATMAP_COLUMNS, MAX_HEATMAP_CELLS // ncores, len(rows)))
    t_first = rows[0]["t"] - ctx.t0
    t_last = rows[-1]["t"] - ctx.t0
    width = (t_last - t_first) / ncols if t_last > t_first else 1.0
    sums = [[0.0] * ncols for _ in range(ncores)]
    counts = [[0] * ncols for _ in range(ncores)]
    for r in rows:
        col = min(ncols - 1, int((r["t"] - ctx.t0 - t_first) / width))
        for core, split in enumerate(r["per_core"][:ncores]):
            sums[core][col] += _busy(split)
            counts[core][col] += 1
    heatmap.cells = [
        [s / n if n else None for s, n in zip(srow, nrow, strict=True)]
        for srow, nrow in zip(sums, counts, strict=True)
    ]
    heatmap.t_edges = [t_first + i * width for i in range(ncols + 1)]
    return heatmap


def _busy(split: list[float] | dict[str, float]) -> float:
    """Busy percent of one CPU split: neither idle nor waiting for I/O (as CpuSplit.busy)."""
    if isinstance(split, dict):
        return max(0.0, 100.0 - split["idle"] - split["iowait"])
    # [user, nice, system, idle, iowait, irq, softirq, steal]: CpuSplit's field order
    return max(0.0, 100.0 - split[3] - split[4])


def iowait_chart(host: list[dict], ctx: _Ctx) -> Chart:
    th = ctx.thresholds
    chart = Chart(
        id="iowait",
        title="I/O wait",
        unit=PERCENT,
        series=_present([make_series("I/O wait", _column(host, "cpu_iowait"), ctx)]),
        note="Share of CPU time spent idle while waiting for storage (all allowed CPUs).",
        bands=[
            Band(
                "best", 0.0, th.iowait_best_pct, f"best ≤ {fmt_value(th.iowait_best_pct, PERCENT)}"
            ),
            Band(
                "alert",
                th.iowait_alert_pct,
                None,
                f"alert > {fmt_value(th.iowait_alert_pct, PERCENT)}",
            ),
        ],
        y_max=100.0,
        y_min_top=th.iowait_alert_pct * 2,
    )
    if not chart.series:
        return _nothing(chart, _no_host(host) or _unavailable_reason(host, "cpu") or "not recorded")
    iowait = _column(host, "cpu_iowait")
    chart.alerts = alert_spans(iowait, th.iowait_alert_pct, "I/O wait", PERCENT, ctx)
    return chart


def disk_chart(host: list[dict], procs: list[dict], ctx: _Ctx) -> Chart:
    chart = Chart(
        id="disk",
        title="Disk throughput",
        unit=BYTES_PER_S,
        series=_present(
            [
                make_series("machine reads", _column(host, "disk_read_per_s"), ctx),
                make_series("machine writes", _column(host, "disk_write_per_s"), ctx),
                make_series("job reads", _sum_by_time(procs, "read_bytes_per_s"), ctx, dashed=True),
            ]
        ),
        note="Bytes per second over whole disks, and what the job's processes read themselves.",
    )
    if not chart.series:
        reason = _unavailable_reason(host, "disk_read_per_s") or "not recorded"
        return _nothing(chart, _no_host(host) or reason)
    return chart


def memory_chart(host: list[dict], procs: list[dict], meta: dict, ctx: _Ctx) -> Chart:
    info = meta.get("host") or {}
    refs = []
    total = info.get("mem_total") or next((r["mem_total"] for r in host if r["mem_total"]), None)
    if total:
        refs.append(RefLine(float(total), f"RAM {fmt_value(total, BYTES)}"))
    if info.get("cgroup_memory_limit"):
        limit = info["cgroup_memory_limit"]
        refs.append(RefLine(float(limit), f"cgroup limit {fmt_value(limit, BYTES)}"))
    series: list[Series | None] = [
        make_series("machine used", _column(host, "mem_used"), ctx),
        make_series("job PSS (shared pages split)", _sum_by_time(procs, "pss"), ctx),
        make_series(
            "job RSS (shared pages counted per process)",
            _sum_by_time(procs, "rss"),
            ctx,
            dashed=True,
        ),
    ]
    if len({r["role"] for r in procs}) > 1:
        trainer = _sum_by_time(procs, "rss", lambda r: r["role"] in ("trainer", "rank"))
        series.append(make_series("trainer RSS", trainer, ctx))
    chart = Chart(
        id="memory",
        title="Memory (RAM)",
        unit=BYTES,
        series=_present(series),
        refs=refs,
        note=(
            "PSS splits pages shared between the trainer and its DataLoader workers, so it is "
            "what the job really costs; RSS counts a shared page once per process."
        ),
    )
    if not chart.series:
        return _nothing(chart, _no_host(host) or "no memory figures were recorded")
    return chart


def swap_chart(host: list[dict], ctx: _Ctx) -> Chart:
    th = ctx.thresholds
    chart = Chart(
        id="swap",
        title="Swap traffic",
        unit=BYTES_PER_S,
        series=_present(
            [
                make_series("swap in", _column(host, "swap_in_per_s"), ctx),
                make_series("swap out", _column(host, "swap_out_per_s"), ctx),
            ]
        ),
        note="Pages moved between RAM and swap, per second. Any sustained traffic slows the job.",
        bands=[
            Band(
                "best",
                0.0,
                th.swap_best_bytes_per_s,
                f"best ≈ {fmt_value(th.swap_best_bytes_per_s, BYTES_PER_S)}",
            ),
            Band(
                "alert",
                th.swap_alert_bytes_per_s,
                None,
                f"alert > {fmt_value(th.swap_alert_bytes_per_s, BYTES_PER_S)} sustained",
            ),
        ],
        y_min_top=th.swap_alert_bytes_per_s * 1.6,
    )
    if not chart.series:
        reason = _unavailable_reason(host, "swap_in_per_s") or "not recorded"
        return _nothing(chart, _no_host(host) or reason)
    used = [r["swap_used"] for r in host if r["swap_used"] is not None]
    if used:
        chart.note += f" Swap in use peaked at {fmt_value(max(used), BYTES)}."
    traffic = swap_traffic(host)
    chart.alerts = alert_spans(traffic, th.swap_alert_bytes_per_s, "swap traffic", BYTES_PER_S, ctx)
    return chart


def gpu_util_chart(gpus: list[dict], meta: dict, ctx: _Ctx) -> Chart:
    chart = Chart(
        id="gpu-util",
        title="GPU utilization",
        unit=PERCENT,
        series=[],
        note=(
            "NVML utilization: the share of time in which at least one kernel was running on "
            "the GPU. 100 % does not mean every streaming multiprocessor was busy."
        ),
        y_max=100.0,
    )
    reason = gpu_unavailable_reason(meta, gpus)
    if reason:
        return _nothing(chart, reason)
    names = _gpu_names(meta)
    for index in sorted({r["index"] for r in gpus}):
        rows = [r for r in gpus if r["index"] == index]
        chart.series += _present(
            [make_series(_gpu_label(index, names), _column(rows, "utilization_gpu"), ctx)]
        )
    if not chart.series:
        return _nothing(
            chart,
            "NVML reported no utilization for any GPU: "
            + (_unavailable_reason(gpus, "utilization_gpu") or "no reason given"),
        )
    return chart


def vram_chart(gpus: list[dict], gpu_procs: list[dict], meta: dict, ctx: _Ctx) -> Chart:
    th = ctx.thresholds
    chart = Chart(
        id="vram",
        title="GPU memory (VRAM)",
        unit=PERCENT,
        series=[],
        note="Memory in use on each GPU as NVML reports it, and the part held by this job.",
        bands=[
            Band(
                "best",
                th.gpu_memory_best_low_pct,
                th.gpu_memory_best_high_pct,
                f"best {fmt_value(th.gpu_memory_best_low_pct, '')}-{fmt_value(th.gpu_memory_best_high_pct, PERCENT)}",
            ),
            Band(
                "alert",
                th.gpu_memory_alert_pct,
                None,
                f"alert > {fmt_value(th.gpu_memory_alert_pct, PERCENT)}",
            ),
        ],
        y_max=100.0,
    )
    reason = gpu_unavailable_reason(meta, gpus)
    if reason:
        return _nothing(chart, reason)
    names = _gpu_names(meta)
    for index in sorted({r["index"] for r in gpus}):
        rows = [r for r in gpus if r["index"] == index]
        totals = {r["t"]: r["memory_total"] for r in rows}
        used = [(t, _share(v, totals.get(t))) for t, v in _column(rows, "memory_used")]
        label = _gpu_label(index, names)
        chart.alerts += alert_spans(used, th.gpu_memory_alert_pct, f"{label} memory", PERCENT, ctx)
        job_rows = [r for r in gpu_procs if r["gpu_index"] == index and r["in_job"]]
        job = _sum_by_time(job_rows, "used_memory")
        chart.series += _present(
            [
                make_series(f"{label}: all processes", used, ctx),
                make_series(
                    f"{label}: this job",
                    [(t, _share(v, totals.get(t))) for t, v in job],
                    ctx,
                    dashed=True,
                ),
            ]
        )
    if not chart.series:
        return _nothing(
            chart,
            "NVML reported no memory figures for any GPU: "
            + (_unavailable_reason(gpus, "memory_used") or "no reason given"),
        )
    return chart


def step_chart(steps: list[dict], markers: list[Marker], ctx: _Ctx) -> Chart:
    chart = Chart(
        id="steps",
        title="Step time and data wait",
        unit=SECONDS,
        series=[],
        markers=markers,
        note=(
            "Each optimizer step's wall time and the part of it spent waiting for the DataLoader. "
            "A data wait close to the step time means the GPU or CPU waits for input."
        ),
    )
    if not steps:
        return _nothing(
            chart,
            "no training steps were recorded: the job ran without instrumentation "
            "or never called optimizer.step()",
        )
    owners = sorted(
        {(s["pid"], s["rank"]) for s in steps}, key=lambda o: (o[1] is None, o[1], o[0])
    )
    per_owner = len(owners) <= 4
    groups = owners if per_owner else [None]
    for owner in groups:
        mine = steps if owner is None else [s for s in steps if (s["pid"], s["rank"]) == owner]
        suffix = "" if owner is None or len(owners) == 1 else f" ({_who(*owner)})"
        chart.series += _present(
            [
                make_series(f"step time{suffix}", [(s["t_end"], s["wall_s"]) for s in mine], ctx),
                make_series(
                    f"data wait{suffix}",
                    [(s["t_end"], s["data_wait_s"]) for s in mine],
                    ctx,
                    dashed=True,
                ),
            ]
        )
    if not per_owner:
        chart.note += f" All {len(owners)} processes' steps are drawn together."
    return chart


def _markers(events: list[dict], ctx: _Ctx) -> list[Marker]:
    out = []
    for e in events:
        if e["kind"] == "epoch-start":
            detail = _json(e["detail"])
            epoch = detail.get("epoch") if isinstance(detail, dict) else None
            out.append(
                Marker(e["t"] - ctx.t0, f"epoch {epoch}" if epoch is not None else "epoch", "epoch")
            )
        elif e["kind"] == "cuda-oom":
            out.append(Marker(e["t"] - ctx.t0, "CUDA out of memory", "error"))
    # One label per marker is unreadable for hundreds of epochs: keep the first few labelled.
    for i, m in enumerate(out):
        if m.kind == "epoch" and i >= 30:
            m.label = ""
    return out


# -- machine and GPU facts ---------------------------------------------------------------


def usable_cpus(meta: dict) -> float | None:
    """CPUs the job could use: affinity capped by the cgroup quota (see HostInfo.usable_cpus)."""
    info = meta.get("host") or {}
    allowed = info.get("allowed_cpus")
    n: float | None = float(len(allowed)) if allowed else None
    if n is None and info.get("logical_cpus"):
        n = float(info["logical_cpus"])
    quota = info.get("cgroup_cpu_quota")
    if n is not None and quota:
        n = min(n, float(quota))
    return n


def gpu_unavailable_reason(meta: dict, gpus: list[dict]) -> str | None:
    """Why there is no GPU chart, in words, or None when there is GPU data."""
    status = meta.get("gpus")
    if isinstance(status, dict) and not status.get("available", True):
        return f"no GPU / NVML unavailable: {status.get('reason') or 'no reason given'}"
    if isinstance(status, dict) and status.get("available") and not status.get("gpus") and not gpus:
        return "no GPU / NVML unavailable: NVML works but found no GPU"
    if not gpus:
        return "no GPU / NVML unavailable: no GPU samples were recorded"
    return None


def _gpu_names(meta: dict) -> dict[int, str]:
    status = meta.get("gpus") or {}
    return {g["index"]: g.get("name") or "" for g in status.get("gpus") or [] if "index" in g}


def _gpu_label(index: int, names: dict[int, str]) -> str:
    name = names.get(index)
    return f"GPU {index} ({name})" if name else f"GPU {index}"


def _share(value: float | None, total: float | None) -> float | None:
    if value is None or not total:
        return None
    return 100.0 * value / total


def _no_host(host: list[dict]) -> str | None:
    return None if host else "the machine was not sampled in this recording"


def _roles_in(procs: list[dict]) -> list[str]:
    order = list(ROLE_LABELS)
    roles = {r["role"] for r in procs}
    return sorted(roles, key=lambda r: (order.index(r) if r in order else len(order), r))


def _who(pid: int, rank: int | None) -> str:
    return f"rank {rank}, pid {pid}" if rank is not None else f"pid {pid}"


def _origin(meta: dict, *tables: list[dict]) -> float:
    started = meta.get("started_at")
    if isinstance(started, (int, float)):
        return float(started)
    firsts = [rows[0].get("t", rows[0].get("t_end")) for rows in tables if rows]
    firsts = [t for t in firsts if t is not None]
    return min(firsts) if firsts else time.time()


# -- process tree ------------------------------------------------------------------------


def process_tree(infos: list[dict], samples: list[dict], t0: float) -> tuple[list[ProcessRow], int]:
    """The job's processes as a tree (depth-first, oldest first), with their peaks.

    Large groups of siblings of one role (DataLoader workers re-created every epoch) are
    folded into one row carrying the peaks over the group, so the tree stays readable.
    """
    by_key: dict[tuple[int, float], list[dict]] = defaultdict(list)
    for s in samples:
        by_key[(s["pid"], s["create_time"])].append(s)
    rows: dict[tuple[int, float], ProcessRow] = {}
    for info in infos:
        key = (info["pid"], info["create_time"])
        mine = by_key.get(key, [])
        cpu = [s["cpu_percent"] for s in mine if s["cpu_percent"] is not None]
        rows[key] = ProcessRow(
            depth=0,
            pid=info["pid"],
            ppid=info["ppid"],
            role=info["role"],
            rank=info.get("rank"),
            name=info["name"],
            cmdline=list(info.get("cmdline") or []),
            first_seen=(mine[0]["t"] - t0) if mine else None,
            last_seen=(mine[-1]["t"] - t0) if mine else None,
            mean_cpu=(sum(cpu) / len(cpu)) if cpu else None,
            peak_cpu=max(cpu) if cpu else None,
            peak_rss=_peak(s["rss"] for s in mine),
            peak_pss=_peak(s["pss"] for s in mine),
            peak_threads=_peak(s["threads"] for s in mine),
            peak_swap=_peak(s["swap"] for s in mine),
        )
    ordered = sorted(rows.items(), key=lambda kv: kv[0][1])
    children: dict[int, list[ProcessRow]] = defaultdict(list)
    roots: list[ProcessRow] = []
    alive_pids = {key[0] for key, _ in ordered}
    for _key, row in ordered:
        if row.ppid in alive_pids and row.ppid != row.pid:
            children[row.ppid].append(row)
        else:
            roots.append(row)
    out: list[ProcessRow] = []
    seen: set[int] = set()

    def visit(row: ProcessRow, depth: int) -> None:
        if id(row) in seen:  # a reused PID could make a cycle; draw each process once
            return
        seen.add(id(row))
        row.depth = depth
        out.append(row)
        kids = [k for k in children.get(row.pid, []) if id(k) not in seen]
        by_role: dict[str, list[ProcessRow]] = defaultdict(list)
        for k in kids:
            by_role[k.role].append(k)
        for group in by_role.values():
            if len(group) > FOLD_SIBLINGS_OVER:
                for k in group[:SHOWN_WHEN_FOLDED]:
                    visit(k, depth + 1)
                rest = group[SHOWN_WHEN_FOLDED:]
                for k in rest:
                    seen.add(id(k))
                out.append(_fold(rest, depth + 1))
            else:
                for k in group:
                    visit(k, depth + 1)

    for root in roots:
        visit(root, 0)
    return out, len(rows)


def _fold(group: list[ProcessRow], depth: int) -> ProcessRow:
    first = group[0]
    return ProcessRow(
        depth=depth,
        pid=first.pid,
        ppid=first.ppid,
        role=first.role,
        rank=None,
        name=first.name,
        cmdline=first.cmdline,
        first_seen=min((r.first_seen for r in group if r.first_seen is not None), default=None),
        last_seen=max((r.last_seen for r in group if r.last_seen is not None), default=None),
        mean_cpu=_mean(r.mean_cpu for r in group),
        peak_cpu=_peak(r.peak_cpu for r in group),
        peak_rss=_peak(r.peak_rss for r in group),
        peak_pss=_peak(r.peak_pss for r in group),
        peak_threads=_peak(r.peak_threads for r in group),
        peak_swap=_peak(r.peak_swap for r in group),
        folded=len(group),
    )


def _peak(values: Iterable[Any]) -> Any:
    vals = [v for v in values if v is not None]
    return max(vals) if vals else None


def _mean(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


# -- settings, DataLoaders, precision ----------------------------------------------------

_GROUP_TITLES = {
    "torch": "PyTorch threads and backends",
    "env": "Environment of the job",
    "process": "Processes",
    "distributed": "Distributed",
    "optimizer": "Optimizer",
    "params": "Model parameters",
    "amp": "Mixed precision",
    "cuda": "CUDA",
    "cudnn": "cuDNN",
    "dataloader": "DataLoader workers",
}
# A setting with more distinct values than this (worker ids...) is shown on one row.
MAX_VALUE_ROWS = 4


def settings_rows(settings: list[dict], roles: dict[int, str] | None = None) -> list[SettingRow]:
    """The last value of each setting per process; processes that agree share one row.

    ``roles`` (pid -> role) lets a row say "trainer (pid 12)" or "4 DataLoader workers"
    instead of a list of PIDs.
    """
    roles = roles or {}
    total_pids = {r["pid"] for r in settings}
    latest: dict[tuple[str, int], dict] = {}
    for r in settings:
        latest[(r["key"], r["pid"])] = r
    by_key: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for (key, _pid), r in latest.items():
        by_key[key][_setting_text(r["value"])].append(r)
    rows = []
    for key in sorted(by_key, key=lambda k: (_group_of(k)[0], k)):
        values = by_key[key]
        if len(values) > MAX_VALUE_ROWS:
            shown = sorted(values, key=_natural)
            text = ", ".join(shown[:MAX_VALUE_ROWS]) + f", … ({len(shown)} values)"
            holders = sum(len(h) for h in values.values())
            rows.append(
                SettingRow(_group_of(key)[1], key, text, f"one per process, {holders} processes")
            )
            continue
        for value, holders in sorted(values.items(), key=lambda kv: -len(kv[1])):
            if len(values) == 1 and len(holders) == len(total_pids) > 1:
                where = "all processes"
            else:
                where = _holders_text(holders, roles)
            rows.append(SettingRow(_group_of(key)[1], key, value, where))
    return rows


def _holders_text(holders: list[dict], roles: dict[int, str]) -> str:
    """ "trainer (pid 12)", "2 DataLoader workers", "rank 0, pid 7" ... for a set of processes."""
    by_role: dict[str, list[dict]] = defaultdict(list)
    for h in sorted(holders, key=lambda h: (h["rank"] is None, h["rank"], h["pid"])):
        by_role[roles.get(h["pid"], "")].append(h)
    parts = []
    for role, group in by_role.items():
        if role == "dataloader-worker":
            n = len(group)
            parts.append(f"{n} DataLoader worker{'s' if n != 1 else ''}")
        elif role == "trainer" and len(group) == 1:
            parts.append(f"trainer (pid {group[0]['pid']})")
        else:
            parts.extend(_who(h["pid"], h["rank"]) for h in group)
    return ", ".join(parts)


def _setting_text(value: Any) -> str:
    decoded = _json(value)
    return "not set" if decoded is None else _pretty_json(value)


def _natural(text: str) -> tuple[int, float | str]:
    try:
        return 0, float(text)
    except ValueError:
        return 1, text


def _group_of(key: str) -> tuple[int, str]:
    prefix = key.split(".", 1)[0]
    order = list(_GROUP_TITLES)
    if prefix in _GROUP_TITLES:
        return order.index(prefix), _GROUP_TITLES[prefix]
    return len(order), "Other settings"


def dataloader_rows(loaders: list[dict]) -> list[dict[str, str]]:
    out = []
    for d in loaders:
        dataset = _short_type(d["dataset_type"])
        if d.get("dataset_len") is not None:
            dataset += f" ({d['dataset_len']:,} items)"
        out.append(
            {
                "process": _who(d["pid"], d["rank"]),
                "loader": str(d["loader_id"]),
                "batch_size": _text(d["batch_size"]),
                "num_workers": str(d["num_workers"]),
                "prefetch_factor": _text(d["prefetch_factor"]),
                "pin_memory": _yes(d["pin_memory"]),
                "persistent_workers": _yes(d["persistent_workers"]),
                "drop_last": _yes(d["drop_last"]),
                "context": d["multiprocessing_context"] or "default",
                "dataset": dataset,
                "sampler": _short_type(d["sampler_type"]) if d["sampler_type"] else "n/a",
                "first_batch": fmt_value(d["first_batch_s"], SECONDS),
            }
        )
    return out


def _short_type(name: str) -> str:
    """``torch.utils.data.dataset.TensorDataset`` -> ``TensorDataset``: the name people know."""
    return name.rsplit(".", 1)[-1]


def precision_rows(steps: list[dict]) -> list[tuple[str, str]]:
    """How the recorded steps ran: autocast dtype, gradient scaler, CUDA allocator figures."""
    if not steps:
        return []
    n = len(steps)
    dtypes: dict[str, int] = defaultdict(int)
    for s in steps:
        dtypes[s["autocast_dtype"] or "off (float32)"] += 1
    rows = [
        (
            "autocast",
            ", ".join(
                f"{k} in {100 * v / n:.0f} % of steps"
                for k, v in sorted(dtypes.items(), key=lambda kv: -kv[1])
            ),
        ),
    ]
    scaler = [s["grad_scaler"] for s in steps if s["grad_scaler"] is not None]
    if scaler:
        rows.append(("gradient scaler", "used" if any(scaler) else "not used"))
    peak = _peak(s["cuda_max_allocated"] for s in steps)
    if peak is not None:
        rows.append(("CUDA peak allocated in a step", fmt_value(peak, BYTES)))
    reserved = _peak(s["cuda_reserved"] for s in steps)
    if reserved is not None:
        rows.append(("CUDA reserved (peak)", fmt_value(reserved, BYTES)))
    retries = _peak(s["cuda_alloc_retries"] for s in steps)
    if retries is not None:
        rows.append(("CUDA allocation retries", str(retries)))
    ooms = _peak(s["cuda_ooms"] for s in steps)
    if ooms:
        rows.append(("CUDA out-of-memory errors", str(ooms)))
    return rows


# -- findings ----------------------------------------------------------------------------


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


# -- summary -----------------------------------------------------------------------------


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
    figures = [Figure("Duration", duration, _exit_text(meta.get("exit_status")), "none")]
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
            _column(host, "cpu_busy"), th.cpu_load_best_pct, th.cpu_load_alert_pct, th
        )
        peak = fmt_value(max(busy), PERCENT)
        figures.append(
            Figure("CPU busy (mean)", fmt_value(mean, PERCENT), f"{where}, peak {peak}", level)
        )
    iowait = [r["cpu_iowait"] for r in host if r["cpu_iowait"] is not None]
    if iowait:
        mean = sum(iowait) / len(iowait)
        level = sustained_level(
            _column(host, "cpu_iowait"), th.iowait_best_pct, th.iowait_alert_pct, th
        )
        peak = fmt_value(max(iowait), PERCENT)
        figures.append(Figure("I/O wait (mean)", fmt_value(mean, PERCENT), f"peak {peak}", level))
    job_cpu = [v for _, v in _sum_by_time(procs, "cpu_percent") if v is not None]
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
    pss = [v for _, v in _sum_by_time(procs, "pss") if v is not None]
    rss = [v for _, v in _sum_by_time(procs, "rss") if v is not None]
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
    vram = [(r["t"], _share(r["memory_used"], r["memory_total"])) for r in gpus]
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


def _exit_text(status: Any) -> str:
    if status is None:
        return "exit status not recorded"
    if status == 0:
        return "exited with status 0 (success)"
    if isinstance(status, int) and status > 128:
        try:
            name = signal.Signals(status - 128).name
            return f"exited with status {status} (ended by {name})"
        except ValueError:
            pass
    return f"exited with status {status}"


def threshold_rows(th: Thresholds) -> list[tuple[str, str, str]]:
    return [
        (
            "GPU memory in use",
            f"> {fmt_value(th.gpu_memory_alert_pct, PERCENT)}",
            f"{fmt_value(th.gpu_memory_best_low_pct, '')}-{fmt_value(th.gpu_memory_best_high_pct, PERCENT)}",
        ),
        (
            "CPU load (mean)",
            f"> {fmt_value(th.cpu_load_alert_pct, PERCENT)} sustained",
            f"≤ {fmt_value(th.cpu_load_best_pct, PERCENT)}",
        ),
        (
            "Swap traffic",
            f"> {fmt_value(th.swap_alert_bytes_per_s, BYTES_PER_S)} sustained",
            f"≈ {fmt_value(th.swap_best_bytes_per_s, BYTES_PER_S)}",
        ),
        (
            "I/O wait",
            f"> {fmt_value(th.iowait_alert_pct, PERCENT)} of CPU time",
            f"≤ {fmt_value(th.iowait_best_pct, PERCENT)}",
        ),
    ]


# -- metadata and events -----------------------------------------------------------------


def meta_sections(meta: dict, rec: Recording) -> list[MetaSection]:
    started, ended = meta.get("started_at"), rec.ended_at
    run = [
        ("command", shlex.join(str(a) for a in meta.get("command") or []) or "n/a"),
        ("working directory", _text(meta.get("cwd"))),
        ("mode", _text(meta.get("mode"))),
        ("started", fmt_utc(started)),
        ("ended", fmt_utc(ended) + ("" if rec.complete else " (recording cut short: last sample)")),
        ("duration", fmt_duration(ended - started) if started and ended else "n/a"),
        ("exit status", _exit_text(meta.get("exit_status"))),
        ("sampling interval", fmt_value(meta.get("interval_s"), SECONDS)),
        ("instrumented (steps, settings)", _yes(meta.get("instrumented"))),
        ("torch version", _text(meta.get("torch_version"))),
        ("torchdoctor version", _text(meta.get("torchdoctor_version"))),
        ("recording", str(rec.path)),
    ]
    sections = [MetaSection("Run", run)]
    info = meta.get("host") or {}
    if info:
        quota = info.get("cgroup_cpu_quota")
        limit = info.get("cgroup_memory_limit")
        sections.append(
            MetaSection(
                "Machine",
                [
                    ("host name", _text(info.get("hostname"))),
                    ("kernel", _text(info.get("kernel"))),
                    ("CPU model", _text(info.get("cpu_model"))),
                    ("logical CPUs", _text(info.get("logical_cpus"))),
                    ("physical cores", _text(info.get("physical_cores"))),
                    ("allowed CPUs (affinity)", _cpu_list(info.get("allowed_cpus"))),
                    (
                        "cgroup",
                        f"v{info['cgroup_version']}"
                        if info.get("cgroup_version")
                        else "none readable",
                    ),
                    ("cgroup CPU quota", f"{fmt_value(quota, '')} CPUs" if quota else "no limit"),
                    ("cgroup memory limit", fmt_value(limit, BYTES) if limit else "no limit"),
                    ("RAM", fmt_value(info.get("mem_total"), BYTES)),
                    (
                        "swap",
                        fmt_value(info.get("swap_total"), BYTES)
                        if info.get("swap_total")
                        else "none",
                    ),
                ],
            )
        )
    status = meta.get("gpus")
    if isinstance(status, dict):
        rows = [
            (
                "NVML",
                "available"
                if status.get("available")
                else f"unavailable: {status.get('reason') or 'no reason given'}",
            ),
        ]
        for key, label in (
            ("driver_version", "driver"),
            ("cuda_driver_version", "CUDA driver"),
            ("nvml_version", "NVML version"),
        ):
            if status.get(key):
                rows.append((label, str(status[key])))
        for g in status.get("gpus") or []:
            parts = [g.get("name") or "unknown model"]
            if g.get("memory_total"):
                parts.append(fmt_value(g["memory_total"], BYTES))
            if g.get("compute_capability"):
                parts.append(f"compute capability {g['compute_capability']}")
            if g.get("power_limit_w"):
                parts.append(f"power limit {fmt_value(g['power_limit_w'], 'W')}")
            rows.append((f"GPU {g.get('index', '?')}", ", ".join(parts)))
        sections.append(MetaSection("GPUs", rows))
    env = meta.get("env")
    if isinstance(env, dict):
        rows = [(k, str(v)) for k, v in sorted(env.items())]
        sections.append(
            MetaSection(
                "Environment",
                rows or [("(none set)", "no thread, CUDA or distributed variables were set")],
            )
        )
    known = {
        "command",
        "cwd",
        "mode",
        "started_at",
        "ended_at",
        "exit_status",
        "interval_s",
        "instrumented",
        "torch_version",
        "torchdoctor_version",
        "host",
        "gpus",
        "env",
        "schema_version",
    }
    other = [(k, _pretty_json(json.dumps(v))) for k, v in sorted(meta.items()) if k not in known]
    if other:
        sections.append(MetaSection("Other metadata", other))
    return sections


def event_rows(events: list[dict], t0: float) -> list[EventRow]:
    out = []
    for e in events:
        kind = e["kind"]
        level = (
            "alert"
            if kind in ("cuda-oom",)
            else "warn"
            if "disabled" in kind or "error" in kind
            else "info"
        )
        out.append(
            EventRow(e["t"] - t0, _who(e["pid"], e["rank"]), kind, _pretty_json(e["detail"]), level)
        )
    return out


def _cpu_list(cpus: list[int] | None) -> str:
    """``[0, 1, 2, 3, 8]`` as ``"0-3,8 (5 CPUs)"``, the way taskset and cgroups write it."""
    if not cpus:
        return "n/a"
    ranges: list[str] = []
    ordered = sorted(cpus)
    start = prev = ordered[0]
    for c in ordered[1:] + [None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        ranges.append(str(start) if start == prev else f"{start}-{prev}")
        if c is not None:
            start = prev = c
    return f"{','.join(ranges)} ({len(cpus)} CPUs)"


def _json(text: Any) -> Any:
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def _pretty_json(text: Any) -> str:
    value = _json(text)
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return ", ".join(f"{k}={_pretty_json(json.dumps(v))}" for k, v in value.items()) or "{}"
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value)


def _text(value: Any) -> str:
    return "n/a" if value is None else str(value)


def _yes(value: Any) -> str:
    if value is None:
        return "n/a"
    return "yes" if value else "no"


def _title(meta: dict, rec: Recording) -> str:
    command = meta.get("command") or []
    if command:
        return shlex.join(str(a) for a in command)
    return rec.path.name
