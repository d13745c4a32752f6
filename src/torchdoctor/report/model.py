"""The plain data a report is drawn from: charts, the process tree, settings, findings, metadata.

:mod:`torchdoctor.report.data` builds these from a recording; :mod:`torchdoctor.report.html`
draws them. Times on charts are seconds elapsed since the start of the run; values are in
base units (percent, bytes, bytes/s, seconds).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torchdoctor.diagnosis.cuda_memory import RecordedSnapshot
from torchdoctor.diagnosis.findings import Finding
from torchdoctor.recording.profiles import WindowProfile
from torchdoctor.report.downsample import Point


@dataclass(slots=True)
class Series:
    label: str
    points: list[Point]  # downsampled for drawing
    samples: int  # measured values before downsampling
    mean: float | None
    peak: float | None
    dashed: bool = False


@dataclass(slots=True)
class Band:
    """A shaded range of the threshold table: ``kind`` is "best" or "alert"."""

    kind: str
    low: float
    high: float | None  # None: to the top of the chart
    label: str


@dataclass(slots=True)
class RefLine:
    """A horizontal line for a fixed limit, e.g. the RAM of the machine."""

    value: float
    label: str


@dataclass(slots=True)
class Marker:
    """A moment on the time axis, e.g. an epoch start or a CUDA out-of-memory error."""

    t: float
    label: str
    kind: str  # "epoch", "error", "event"


@dataclass(slots=True)
class AlertSpan:
    """A stretch of time in which a reading stayed beyond its alert limit (sustained)."""

    t_start: float
    t_end: float
    label: str


@dataclass(slots=True)
class Chart:
    id: str
    title: str
    unit: str  # one of torchdoctor.report.scales' units
    series: list[Series]
    note: str = ""
    bands: list[Band] = field(default_factory=list)
    refs: list[RefLine] = field(default_factory=list)
    markers: list[Marker] = field(default_factory=list)
    alerts: list[AlertSpan] = field(default_factory=list)
    y_max: float | None = None  # fixed top, e.g. 100 for shares of the machine
    y_min_top: float = 0.0  # the top is at least this, so that the alert band shows
    unavailable: str | None = None  # why there is nothing to draw


@dataclass(slots=True)
class Heatmap:
    """Busy share per CPU over time: one row per allowed CPU, one column per time bucket."""

    id: str
    title: str
    rows: list[str]  # row labels, e.g. "CPU 3"
    t_edges: list[float]  # column boundaries, elapsed seconds (len = columns + 1)
    cells: list[list[float | None]]  # [row][column], percent busy
    note: str = ""
    unavailable: str | None = None


@dataclass(slots=True)
class Figure:
    """One headline number of the summary."""

    label: str
    value: str
    detail: str = ""
    level: str = "ok"  # "ok", "warn", "alert" or "none" (not judged)


@dataclass(slots=True)
class ProcessRow:
    depth: int
    pid: int
    ppid: int
    role: str
    rank: int | None
    name: str
    cmdline: list[str]
    first_seen: float | None  # elapsed seconds
    last_seen: float | None
    mean_cpu: float | None  # 100 = one core
    peak_cpu: float | None
    peak_rss: int | None
    peak_pss: int | None
    peak_threads: int | None
    peak_swap: int | None
    folded: int = 0  # >0: this row stands for that many similar siblings (peaks over all)


@dataclass(slots=True)
class SettingRow:
    group: str
    key: str
    value: str
    where: str  # which processes hold this value


@dataclass(slots=True)
class MetaSection:
    title: str
    rows: list[tuple[str, str]]


@dataclass(slots=True)
class EventRow:
    t: float  # elapsed seconds
    where: str
    kind: str
    detail: str
    level: str  # "info", "warn", "alert"


@dataclass(slots=True)
class ReportData:
    title: str
    command: str | None  # the recorded command line, shell-quoted; None when not recorded
    source: str
    started_at: float | None
    span_s: float
    complete: bool
    verdict: str
    verdict_level: str  # "ok", "warn", "alert", "none"
    summary: list[Figure]
    charts: list[Chart]
    cores: Heatmap
    processes: list[ProcessRow]
    process_count: int
    settings: list[SettingRow]
    dataloaders: list[dict[str, str]]
    precision: list[tuple[str, str]]  # mixed precision as the steps saw it
    findings: list[Finding]
    diagnosis_note: str | None  # why there are no findings to show, when the engine could not run
    meta: list[MetaSection]
    events: list[EventRow]
    thresholds: list[tuple[str, str, str]]  # (metric, alert, best range) as applied
    # what a damaged file lost, and a run in progress or cut short (banners above the summary)
    state_notes: list[str] = field(default_factory=list)
    # the resolution the timelines were read at, when not every sample (a long recording)
    resolution_note: str | None = None
    # profiler windows (run --profile-steps), parsed or not; [] without any
    profiles: list[WindowProfile] = field(default_factory=list)
    # memory snapshots the events name (run --memory-history), read or not; [] without any
    memory: list[RecordedSnapshot] = field(default_factory=list)
