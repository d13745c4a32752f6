"""The timelines of a report: drawable series for each chart, from a recording's readings.

Series are downsampled (min/max per bucket) so peaks survive; values stay in base units
(percent, bytes, bytes/s, seconds) and times become seconds since the start of the run.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from torchdoctor.recording.frame import SampleFrame
from torchdoctor.recording.reader import EVERY_INSTANT, Instants, Recording
from torchdoctor.recording.steps import decode_json
from torchdoctor.report.downsample import Point
from torchdoctor.report.model import (
    AlertSpan,
    Band,
    Chart,
    Heatmap,
    Marker,
    RefLine,
    Series,
)
from torchdoctor.report.reading import Extent, Reading, read_points
from torchdoctor.report.readings import SWAP_TRAFFIC, Readings
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


def series_of(label: str, reading: Reading, *, dashed: bool = False) -> Series | None:
    """The drawable series of a reading; None when nothing was measured."""
    if not reading.measured:
        return None
    return Series(
        label=label,
        points=reading.points,
        samples=reading.samples,
        mean=reading.mean,
        peak=reading.peak,
        dashed=dashed,
    )


def sustained_level(reading: Reading, best: float, alert: float) -> str:
    """'alert' or 'warn' when the reading stays beyond that limit (as the diagnosis counts
    sustained), else 'ok': a single spike does not colour the summary."""
    if reading.spans.get(alert):
        return "alert"
    if reading.spans.get(best):
        return "warn"
    return "ok"


def alert_spans(
    reading: Reading, limit: float, what: str, unit: str, ctx: ChartContext
) -> list[AlertSpan]:
    """The longest sustained stretch beyond ``limit``, in elapsed time, to shade on a chart."""
    span = reading.spans.get(limit)
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


def _nothing(chart: Chart, reason: str) -> Chart:
    chart.series = []
    chart.unavailable = reason
    return chart


def _present(series: Iterable[Series | None]) -> list[Series]:
    return [s for s in series if s is not None]


def cpu_chart(readings: Readings, cpus: float | None, ctx: ChartContext) -> Chart:
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
    busy = readings.host["cpu_busy"]
    chart.alerts = alert_spans(busy, th.cpu_load_alert_pct, "CPU load", PERCENT, ctx)
    series: list[Series | None] = [series_of("machine busy", busy)]
    for role, reading in readings.cpu_by_role.items():  # per role, as a share of the CPUs
        series.append(series_of(f"job: {ROLE_LABELS.get(role, role)}", reading))
    chart.series = _present(series)
    if not chart.series:
        return _nothing(chart, _no_host(readings) or "no CPU figures were recorded")
    return chart


MAX_GPUS_WITH_JOB_LINE = 4

# Cells drawn in the per-CPU heatmap at most (rows x columns), and columns at most.
MAX_HEATMAP_CELLS = 24_000
MAX_HEATMAP_COLUMNS = 300


def core_heatmap(
    rec: Recording, meta: dict, ctx: ChartContext, instants: Instants = EVERY_INSTANT
) -> Heatmap:
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
    # Streamed twice: a week of 0.5 s samples of a 64-CPU host is 77 million CPU splits.
    valid = "json_valid(per_core) AND json_array_length(per_core) > 0"
    if "per_core" not in rec.stored_columns("host_samples"):
        valid = "0"
    (count, t_first, t_last, ncores), *_ = rec.iter_query(
        f"SELECT COUNT(*), MIN(t), MAX(t), MAX(json_array_length(per_core)) FROM host_samples"
        f"{instants.where(valid)}",
        instants.params,
    )
    if not count:
        heatmap.unavailable = "no per-CPU figures were recorded"
        return heatmap
    ids = None
    if "per_core_ids" in rec.stored_columns("host_samples"):
        for (text,) in rec.iter_query(
            f"SELECT per_core_ids FROM host_samples WHERE {valid} ORDER BY t DESC, rowid DESC"
            " LIMIT 1"
        ):
            ids = decode_json(text)
    ids = ids or (meta.get("host") or {}).get("allowed_cpus")
    if not ids or len(ids) != ncores:
        ids = list(range(ncores))
    heatmap.rows = [f"CPU {i}" for i in ids]
    ncols = max(1, min(MAX_HEATMAP_COLUMNS, MAX_HEATMAP_CELLS // ncores, count))
    t_first -= ctx.t0
    t_last -= ctx.t0
    width = (t_last - t_first) / ncols if t_last > t_first else 1.0
    sums = [[0.0] * ncols for _ in range(ncores)]
    counts = [[0] * ncols for _ in range(ncores)]
    for t, text in rec.iter_query(
        f"SELECT t, per_core FROM host_samples{instants.where(valid)} ORDER BY t", instants.params
    ):
        col = min(ncols - 1, int((t - ctx.t0 - t_first) / width))
        for core, split in enumerate((decode_json(text) or [])[:ncores]):
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


def iowait_chart(readings: Readings, ctx: ChartContext) -> Chart:
    th = ctx.thresholds
    chart = Chart(
        id="iowait",
        title="I/O wait",
        unit=PERCENT,
        series=_present([series_of("I/O wait", readings.host["cpu_iowait"])]),
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
        reason = readings.unavailable("host_samples", "cpu")
        return _nothing(chart, _no_host(readings) or reason or "not recorded")
    iowait = readings.host["cpu_iowait"]
    chart.alerts = alert_spans(iowait, th.iowait_alert_pct, "I/O wait", PERCENT, ctx)
    return chart


def disk_chart(readings: Readings, ctx: ChartContext) -> Chart:
    chart = Chart(
        id="disk",
        title="Disk throughput",
        unit=BYTES_PER_S,
        series=_present(
            [
                series_of("machine reads", readings.host["disk_read_per_s"]),
                series_of("machine writes", readings.host["disk_write_per_s"]),
                series_of("job reads", readings.job["read_bytes_per_s"], dashed=True),
            ]
        ),
        note="Bytes per second over whole disks, and what the job's processes read themselves.",
    )
    if not chart.series:
        reason = readings.unavailable("host_samples", "disk_read_per_s") or "not recorded"
        return _nothing(chart, _no_host(readings) or reason)
    return chart


def memory_chart(readings: Readings, meta: dict, ctx: ChartContext) -> Chart:
    info = meta.get("host") or {}
    refs = []
    total = info.get("mem_total") or readings.mem_total
    if total:
        refs.append(RefLine(float(total), f"RAM {fmt_value(total, BYTES)}"))
    if info.get("cgroup_memory_limit"):
        limit = info["cgroup_memory_limit"]
        refs.append(RefLine(float(limit), f"cgroup limit {fmt_value(limit, BYTES)}"))
    series: list[Series | None] = [
        series_of("machine used", readings.host["mem_used"]),
        series_of("job PSS (shared pages split)", readings.job["pss"]),
        series_of("job RSS (shared pages counted per process)", readings.job["rss"], dashed=True),
    ]
    if len(readings.roles) > 1:
        series.append(series_of("trainer RSS", readings.compute_rss))
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
        return _nothing(chart, _no_host(readings) or "no memory figures were recorded")
    return chart


def swap_chart(readings: Readings, ctx: ChartContext) -> Chart:
    th = ctx.thresholds
    chart = Chart(
        id="swap",
        title="Swap traffic",
        unit=BYTES_PER_S,
        series=_present(
            [
                series_of("swap in", readings.host["swap_in_per_s"]),
                series_of("swap out", readings.host["swap_out_per_s"]),
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
        reason = readings.unavailable("host_samples", "swap_in_per_s") or "not recorded"
        return _nothing(chart, _no_host(readings) or reason)
    if readings.swap_used_peak is not None:
        chart.note += f" Swap in use peaked at {fmt_value(readings.swap_used_peak, BYTES)}."
    traffic = readings.host[SWAP_TRAFFIC]
    chart.alerts = alert_spans(traffic, th.swap_alert_bytes_per_s, "swap traffic", BYTES_PER_S, ctx)
    return chart


def gpu_util_chart(readings: Readings, meta: dict, ctx: ChartContext) -> Chart:
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
    reason = gpu_unavailable_reason(meta, readings.gpu_sampled)
    if reason:
        return _nothing(chart, reason)
    names = _gpu_names(meta)
    for index, reading in readings.gpu_util.items():
        chart.series += _present([series_of(_gpu_label(index, names), reading)])
    if not chart.series:
        return _nothing(
            chart,
            "NVML reported no utilization for any GPU: "
            + (readings.unavailable("gpu_samples", "utilization_gpu") or "no reason given"),
        )
    return chart


def vram_chart(readings: Readings, meta: dict, ctx: ChartContext) -> Chart:
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
    reason = gpu_unavailable_reason(meta, readings.gpu_sampled)
    if reason:
        return _nothing(chart, reason)
    names = _gpu_names(meta)
    indices = list(readings.gpu_memory)
    # Two lines per GPU stay readable up to four GPUs; beyond, the job's share is left out.
    with_job = len(indices) <= MAX_GPUS_WITH_JOB_LINE
    if not with_job:
        chart.note = "Memory in use on each GPU as NVML reports it."
    for index in indices:
        used = readings.gpu_memory[index]
        label = _gpu_label(index, names)
        chart.alerts += alert_spans(used, th.gpu_memory_alert_pct, f"{label} memory", PERCENT, ctx)
        chart.series += _present([series_of(f"{label}: all processes", used)])
        if with_job:
            job = readings.gpu_job_memory[index]
            chart.series += _present([series_of(f"{label}: this job", job, dashed=True)])
    if not chart.series:
        return _nothing(
            chart,
            "NVML reported no memory figures for any GPU: "
            + (readings.unavailable("gpu_samples", "memory_used") or "no reason given"),
        )
    return chart


def step_chart(steps: SampleFrame, markers: list[Marker], ctx: ChartContext) -> Chart:
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
    if not len(steps):
        return _nothing(
            chart,
            "no training steps were recorded: the job ran without instrumentation "
            "or never called optimizer.step()",
        )
    owners = sorted(
        set(zip(steps.values("pid"), steps.values("rank"), strict=True)),
        key=lambda o: (o[1] is None, o[1], o[0]),
    )
    per_owner = len(owners) <= 4
    by_pid = steps.group_by("pid") if per_owner else {}
    for owner in owners if per_owner else [None]:
        mine = steps if owner is None else by_pid[owner[0]]
        suffix = "" if owner is None or len(owners) == 1 else f" ({who(*owner)})"
        chart.series += _present(
            [
                series_of(f"step time{suffix}", _step_reading(mine, owner, "wall_s", ctx)),
                series_of(
                    f"data wait{suffix}",
                    _step_reading(mine, owner, "data_wait_s", ctx),
                    dashed=True,
                ),
            ]
        )
    if not per_owner:
        chart.note += f" All {len(owners)} processes' steps are drawn together."
    return chart


def _step_reading(
    steps: SampleFrame, owner: tuple[int, int | None] | None, key: str, ctx: ChartContext
) -> Reading:
    """(t_end, ``key``) of the steps of ``owner`` (all when None), read from the frame's
    arrays twice: once for the first and last times, once into the reading."""

    def points() -> Iterator[Point]:
        for rank, t, v in zip(
            steps.values("rank"), steps.values("t_end"), steps.values(key), strict=True
        ):
            if owner is None or rank == owner[1]:
                yield t, v

    first = last = None
    for t, _ in points():
        first = t if first is None else first
        last = t
    extent = Extent(t_first=first, t_last=last)
    return read_points(points(), extent, ctx.t0, ctx.max_points, ctx.thresholds)


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


def gpu_unavailable_reason(meta: dict, sampled: bool) -> str | None:
    """Why there is no GPU chart, in words, or None when there is GPU data."""
    status = meta.get("gpus")
    if isinstance(status, dict) and not status.get("available", True):
        return f"no GPU / NVML unavailable: {status.get('reason') or 'no reason given'}"
    if (
        isinstance(status, dict)
        and status.get("available")
        and not status.get("gpus")
        and not sampled
    ):
        return "no GPU / NVML unavailable: NVML works but found no GPU"
    if not sampled:
        return "no GPU / NVML unavailable: no GPU samples were recorded"
    return None


def _gpu_names(meta: dict) -> dict[int, str]:
    status = meta.get("gpus") or {}
    return {g["index"]: g.get("name") or "" for g in status.get("gpus") or [] if "index" in g}


def _gpu_label(index: int, names: dict[int, str]) -> str:
    name = names.get(index)
    return f"GPU {index} ({name})" if name else f"GPU {index}"


def _no_host(readings: Readings) -> str | None:
    return None if readings.host_sampled else "the machine was not sampled in this recording"
