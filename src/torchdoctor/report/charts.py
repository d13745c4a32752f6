"""The timelines of a report: drawable series for each chart, from the rows of a recording.

Series are downsampled (min/max per bucket) so peaks survive; values stay in base units
(percent, bytes, bytes/s, seconds) and times become seconds since the start of the run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torchdoctor.diagnosis.series import sustained_span
from torchdoctor.recording.reader import Recording
from torchdoctor.recording.steps import decode_json
from torchdoctor.report.downsample import Point, downsample_minmax
from torchdoctor.report.model import (
    AlertSpan,
    Band,
    Chart,
    Heatmap,
    Marker,
    RefLine,
    Series,
)
from torchdoctor.report.scales import (
    BYTES,
    BYTES_PER_S,
    PERCENT,
    SECONDS,
    fmt_value,
)
from torchdoctor.report.tables import who
from torchdoctor.sampling import roles
from torchdoctor.thresholds import Thresholds
from torchdoctor.units import fmt_duration

# Points drawn per series: two per bucket, about one per pixel of a 1000 px wide chart.
MAX_POINTS = 1200

ROLE_LABELS = {
    roles.TRAINER: "trainer",
    roles.WORKER: "DataLoader workers",
    roles.RANK: "ranks",
    roles.LAUNCHER: "launcher",
    roles.OTHER: "other processes",
}


class ChartContext:
    """What every chart builder needs: the time origin, the point budget, the thresholds."""

    __slots__ = ("t0", "max_points", "thresholds")

    def __init__(self, t0: float, max_points: int, thresholds: Thresholds) -> None:
        self.t0 = t0
        self.max_points = max_points
        self.thresholds = thresholds


def make_series(
    label: str, points: Iterable[Point], ctx: ChartContext, *, dashed: bool = False
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


def column(rows: list[dict[str, Any]], key: str) -> list[Point]:
    return [(r["t"], r[key]) for r in rows]


def sum_by_time(
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
    points: list[Point], limit: float, what: str, unit: str, ctx: ChartContext
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


def cpu_chart(host: list[dict], procs: list[dict], cpus: float | None, ctx: ChartContext) -> Chart:
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
    busy = column(host, "cpu_busy")
    chart.alerts = alert_spans(busy, th.cpu_load_alert_pct, "CPU load", PERCENT, ctx)
    series: list[Series | None] = [make_series("machine busy", busy, ctx)]
    if cpus:
        for role in _roles_in(procs):
            points = sum_by_time(procs, "cpu_percent", lambda r, role=role: r["role"] == role)
            scaled = [(t, None if v is None else v / cpus) for t, v in points]
            series.append(make_series(f"job: {ROLE_LABELS.get(role, role)}", scaled, ctx))
    chart.series = _present(series)
    if not chart.series:
        return _nothing(chart, _no_host(host) or "no CPU figures were recorded")
    return chart


MAX_GPUS_WITH_JOB_LINE = 4

# Cells drawn in the per-CPU heatmap at most (rows x columns), and columns at most.
MAX_HEATMAP_CELLS = 24_000
MAX_HEATMAP_COLUMNS = 300


def core_heatmap(rec: Recording, meta: dict, ctx: ChartContext) -> Heatmap:
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


def iowait_chart(host: list[dict], ctx: ChartContext) -> Chart:
    th = ctx.thresholds
    chart = Chart(
        id="iowait",
        title="I/O wait",
        unit=PERCENT,
        series=_present([make_series("I/O wait", column(host, "cpu_iowait"), ctx)]),
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
    iowait = column(host, "cpu_iowait")
    chart.alerts = alert_spans(iowait, th.iowait_alert_pct, "I/O wait", PERCENT, ctx)
    return chart


def disk_chart(host: list[dict], procs: list[dict], ctx: ChartContext) -> Chart:
    chart = Chart(
        id="disk",
        title="Disk throughput",
        unit=BYTES_PER_S,
        series=_present(
            [
                make_series("machine reads", column(host, "disk_read_per_s"), ctx),
                make_series("machine writes", column(host, "disk_write_per_s"), ctx),
                make_series("job reads", sum_by_time(procs, "read_bytes_per_s"), ctx, dashed=True),
            ]
        ),
        note="Bytes per second over whole disks, and what the job's processes read themselves.",
    )
    if not chart.series:
        reason = _unavailable_reason(host, "disk_read_per_s") or "not recorded"
        return _nothing(chart, _no_host(host) or reason)
    return chart


def memory_chart(host: list[dict], procs: list[dict], meta: dict, ctx: ChartContext) -> Chart:
    info = meta.get("host") or {}
    refs = []
    total = info.get("mem_total") or next((r["mem_total"] for r in host if r["mem_total"]), None)
    if total:
        refs.append(RefLine(float(total), f"RAM {fmt_value(total, BYTES)}"))
    if info.get("cgroup_memory_limit"):
        limit = info["cgroup_memory_limit"]
        refs.append(RefLine(float(limit), f"cgroup limit {fmt_value(limit, BYTES)}"))
    series: list[Series | None] = [
        make_series("machine used", column(host, "mem_used"), ctx),
        make_series("job PSS (shared pages split)", sum_by_time(procs, "pss"), ctx),
        make_series(
            "job RSS (shared pages counted per process)",
            sum_by_time(procs, "rss"),
            ctx,
            dashed=True,
        ),
    ]
    if len({r["role"] for r in procs}) > 1:
        trainer = sum_by_time(procs, "rss", lambda r: r["role"] in roles.COMPUTE)
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


def swap_chart(host: list[dict], ctx: ChartContext) -> Chart:
    th = ctx.thresholds
    chart = Chart(
        id="swap",
        title="Swap traffic",
        unit=BYTES_PER_S,
        series=_present(
            [
                make_series("swap in", column(host, "swap_in_per_s"), ctx),
                make_series("swap out", column(host, "swap_out_per_s"), ctx),
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


def gpu_util_chart(gpus: list[dict], meta: dict, ctx: ChartContext) -> Chart:
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
            [make_series(_gpu_label(index, names), column(rows, "utilization_gpu"), ctx)]
        )
    if not chart.series:
        return _nothing(
            chart,
            "NVML reported no utilization for any GPU: "
            + (_unavailable_reason(gpus, "utilization_gpu") or "no reason given"),
        )
    return chart


def vram_chart(gpus: list[dict], gpu_procs: list[dict], meta: dict, ctx: ChartContext) -> Chart:
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
    indices = sorted({r["index"] for r in gpus})
    # Two lines per GPU stay readable up to four GPUs; beyond, the job's share is left out.
    with_job = len(indices) <= MAX_GPUS_WITH_JOB_LINE
    if not with_job:
        chart.note = "Memory in use on each GPU as NVML reports it."
    for index in indices:
        rows = [r for r in gpus if r["index"] == index]
        totals = {r["t"]: r["memory_total"] for r in rows}
        used = [(t, share(v, totals.get(t))) for t, v in column(rows, "memory_used")]
        label = _gpu_label(index, names)
        chart.alerts += alert_spans(used, th.gpu_memory_alert_pct, f"{label} memory", PERCENT, ctx)
        chart.series += _present([make_series(f"{label}: all processes", used, ctx)])
        if with_job:
            job_rows = [r for r in gpu_procs if r["gpu_index"] == index and r["in_job"]]
            job = [(t, share(v, totals.get(t))) for t, v in sum_by_time(job_rows, "used_memory")]
            chart.series += _present([make_series(f"{label}: this job", job, ctx, dashed=True)])
    if not chart.series:
        return _nothing(
            chart,
            "NVML reported no memory figures for any GPU: "
            + (_unavailable_reason(gpus, "memory_used") or "no reason given"),
        )
    return chart


def step_chart(steps: list[dict], markers: list[Marker], ctx: ChartContext) -> Chart:
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
        suffix = "" if owner is None or len(owners) == 1 else f" ({who(*owner)})"
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


def event_markers(events: list[dict], ctx: ChartContext) -> list[Marker]:
    out = []
    for e in events:
        if e["kind"] == "epoch-start":
            detail = decode_json(e["detail"])
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


def share(value: float | None, total: float | None) -> float | None:
    if value is None or not total:
        return None
    return 100.0 * value / total


def _no_host(host: list[dict]) -> str | None:
    return None if host else "the machine was not sampled in this recording"


def _roles_in(procs: list[dict]) -> list[str]:
    order = list(ROLE_LABELS)
    roles = {r["role"] for r in procs}
    return sorted(roles, key=lambda r: (order.index(r) if r in order else len(order), r))
