"""The report's time series read from a recording in SQL, never a Python object per row.

A week of a 20-process job holds ~24 million process samples. Read as dicts (what the report
did) that is tens of GiB; here SQLite sums the processes per sampling instant (``GROUP BY t``
over the table's index on ``t``, which streams) and each instant's values pass once through a
:class:`~torchdoctor.report.reading.ReadingBuilder`, which keeps only the chart's buckets.
The memory is the chart's resolution (MAX_POINTS per series) whatever the recording's length.

Up to MAX_INSTANTS sampling instants (a day at 0.7 s, 16 h at the default 0.5 s) every one is
read; a longer recording is read at that many instants spread over the run
(``Recording.instants``: one index seek each, no scan), so a week costs what a day does, each
chart point still the mean of dozens of instants, and the report says so. An instant's sum is
None when any process's value is unknown (a sum over part of the job would understate it).
SQLite adds in the index's order, the order the rows were read in, so with SQLite before 3.43
(plain double sums, like Python's) the sums are Python's to the last bit; later versions sum
reals with compensation, which can differ in the last digit. Means are over every instant read
and peaks are their maxima; sustained spans are judged on every instant read, not on buckets.

A series' SQL yields ``t`` and, per series, a presence flag ``pK`` (this instant is a point
of series K: a role's series has points only where that role has processes) and a value
``vK``, ordered by ``t``. It is read twice: once for its extent (first and last times; the
median gap between measured samples, where a sustained span is asked), once streamed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torchdoctor.recording.reader import Instants, Recording
from torchdoctor.recording.steps import decode_json
from torchdoctor.report.reading import EMPTY, Extent, Reading, ReadingBuilder
from torchdoctor.sampling import roles as role_names
from torchdoctor.thresholds import Thresholds

HOST_SERIES = (
    "cpu_busy",
    "cpu_iowait",
    "disk_read_per_s",
    "disk_write_per_s",
    "mem_used",
    "swap_in_per_s",
    "swap_out_per_s",
)
SWAP_TRAFFIC = "swap_traffic"  # swap in + out per sample, the threshold table's row
BY_INDEX = '"index" = ?'  # one GPU's rows of gpu_samples
SAMPLE_TABLES = ("host_samples", "process_samples", "gpu_samples", "gpu_process_samples")
# Sampling instants read per table: a hundred per chart point at most (MAX_POINTS, 1200).
MAX_INSTANTS = 120_000


def instants_of(rec: Recording) -> dict[str, Instants]:
    """The instants of each sample table the report reads (every one, up to MAX_INSTANTS)."""
    return {table: rec.instants(table, MAX_INSTANTS) for table in SAMPLE_TABLES}


@dataclass(slots=True)
class Readings:
    """Every series the report draws or sums up, with the few other figures it shows."""

    host_sampled: bool
    host: dict[str, Reading]  # HOST_SERIES and SWAP_TRAFFIC
    mem_total: float | None  # the first recorded RAM size
    swap_used_peak: float | None
    roles: list[str]  # of the job's process samples
    job: dict[str, Reading]  # summed over all processes: cpu_percent, pss, rss, read_bytes_per_s
    compute_rss: Reading  # the trainer / ranks' RSS
    cpu_by_role: dict[str, Reading]  # cpu_percent / allowed CPUs, per role
    gpu_sampled: bool
    gpu_util: dict[int, Reading] = field(default_factory=dict)
    gpu_memory: dict[int, Reading] = field(default_factory=dict)  # % of the device
    gpu_job_memory: dict[int, Reading] = field(default_factory=dict)  # the job's part, %
    gpu_util_mean: float | None = None  # over every GPU sample
    unavailable: Callable[..., str | None] = lambda table, *fields: None


class SeriesReader:
    """Reads series from ``rec`` for charts of ``max_points`` points, times from ``t0``."""

    def __init__(
        self,
        rec: Recording,
        t0: float,
        max_points: int,
        th: Thresholds,
        instants: dict[str, Instants],
    ) -> None:
        self.rec = rec
        self.t0 = t0
        self.max_points = max_points
        self.th = th
        self.instants = instants

    def col(self, table: str, name: str) -> str:
        """``name`` quoted, or NULL where this file was written before the column existed."""
        return f'"{name}"' if name in self.rec.stored_columns(table) else "NULL"

    def read(
        self,
        sql: str,
        params: list[Any],
        names: list[str],
        limits: dict[str, tuple[float, ...]] | None = None,
        scale: dict[str, float] | None = None,
    ) -> dict[str, Reading]:
        """The readings of series ``names`` (columns pK, vK of ``sql``, in that order)."""
        limits = limits or {}
        scale = scale or {}
        extents = self._extents(sql, params, len(names))
        for k, name in enumerate(names):
            if limits.get(name) and extents[k][1] is not None:
                extents[k][0].slack = self._slack(sql, params, k, extents[k][1])
        builders = [
            ReadingBuilder(extent, self.t0, self.max_points, self.th, limits.get(name, ()))
            if count
            else None
            for name, (extent, count) in zip(names, extents, strict=True)
        ]
        factors = [scale.get(name) for name in names]
        live = [(k, b, factors[k]) for k, b in enumerate(builders) if b is not None]
        if live:
            for row in self.rec.iter_query(sql, params):
                t = row[0]
                for k, builder, factor in live:
                    if row[1 + 2 * k]:
                        v = row[2 + 2 * k]
                        builder.add(t, v / factor if factor and v is not None else v)
        return {
            name: b.reading() if b is not None else EMPTY
            for name, b in zip(names, builders, strict=True)
        }

    def _extents(self, sql: str, params: list[Any], n: int) -> list[tuple[Extent, int | None]]:
        parts = []
        for k in range(n):
            p, v = f"p{k}", f"v{k}"
            parts += [
                f"MIN(CASE WHEN {p} THEN t END)",
                f"MAX(CASE WHEN {p} THEN t END)",
                f"MIN(CASE WHEN {p} AND {v} IS NOT NULL THEN t END)",
                f"MAX(CASE WHEN {p} AND {v} IS NOT NULL THEN t END)",
                f"COUNT(CASE WHEN {p} AND {v} IS NOT NULL THEN 1 END)",
            ]
        (row,) = self.rec.iter_query(f"SELECT {', '.join(parts)} FROM ({sql})", params)
        out = []
        for k in range(n):
            first, last, m_first, m_last, measured = row[5 * k : 5 * k + 5]
            out.append((Extent(first, last, m_first, m_last), measured or None))
        return out

    def _slack(self, sql: str, params: list[Any], k: int, measured: int) -> float | None:
        """The median gap between measured samples, as sustained_span takes it."""
        if measured < 2:
            return None
        rows = list(
            self.rec.iter_query(
                f"SELECT gap FROM (SELECT t - LAG(t) OVER (ORDER BY t) AS gap FROM ({sql})"
                f" WHERE p{k} AND v{k} IS NOT NULL) WHERE gap IS NOT NULL"
                " ORDER BY gap LIMIT 1 OFFSET ?",
                [*params, (measured - 1) // 2],
            )
        )
        return rows[0][0] if rows else None


def read_readings(
    rec: Recording,
    t0: float,
    max_points: int,
    th: Thresholds,
    cpus: float | None,
    instants: dict[str, Instants] | None = None,
) -> Readings:
    """Every series of the report, read at ``instants`` (default :func:`instants_of`)."""
    instants = instants if instants is not None else instants_of(rec)
    reader = SeriesReader(rec, t0, max_points, th, instants)
    procs, gpus = instants["process_samples"], instants["gpu_samples"]
    roles = [
        r
        for (r,) in rec.iter_query(
            f"SELECT DISTINCT role FROM process_samples{procs.where()}", procs.params
        )
    ]
    gpu_indices = sorted(
        i
        for (i,) in rec.iter_query(
            f'SELECT DISTINCT "index" FROM gpu_samples{gpus.where()}', gpus.params
        )
    )
    readings = Readings(
        host_sampled=_any(rec, "host_samples"),
        host=_host(reader, th),
        mem_total=_first(rec, "SELECT mem_total FROM host_samples WHERE mem_total ORDER BY t"),
        swap_used_peak=_first(rec, "SELECT MAX(swap_used) FROM host_samples"),
        roles=_ordered_roles(roles),
        job={},
        compute_rss=EMPTY,
        cpu_by_role={},
        gpu_sampled=bool(gpu_indices),
        unavailable=lambda table, *fields: _unavailable(rec, table, fields, instants[table]),
    )
    _processes(reader, readings, cpus)
    for index in gpu_indices:
        _gpu(reader, readings, index, th)
    (total, count), *_ = rec.iter_query(
        f"SELECT SUM(utilization_gpu), COUNT(utilization_gpu) FROM gpu_samples{gpus.where()}",
        gpus.params,
    )
    readings.gpu_util_mean = total / count if count else None
    return readings


def _host(reader: SeriesReader, th: Thresholds) -> dict[str, Reading]:
    col = lambda name: reader.col("host_samples", name)  # noqa: E731
    names = [*HOST_SERIES, SWAP_TRAFFIC]
    values = [col(name) for name in HOST_SERIES]
    swap_in, swap_out = col("swap_in_per_s"), col("swap_out_per_s")
    values.append(
        f"CASE WHEN {swap_in} IS NULL AND {swap_out} IS NULL THEN NULL"
        f" ELSE IFNULL({swap_in}, 0.0) + IFNULL({swap_out}, 0.0) END"
    )
    select = ", ".join(f"1 AS p{k}, {v} AS v{k}" for k, v in enumerate(values))
    host = reader.instants["host_samples"]
    return reader.read(
        f"SELECT t, {select} FROM host_samples{host.where()} ORDER BY t",
        list(host.params),
        names,
        limits={
            "cpu_busy": (th.cpu_load_best_pct, th.cpu_load_alert_pct),
            "cpu_iowait": (th.iowait_best_pct, th.iowait_alert_pct),
            SWAP_TRAFFIC: (th.swap_best_bytes_per_s, th.swap_alert_bytes_per_s),
        },
    )


def _sum(value: str, where: str | None = None) -> tuple[str, str]:
    """(presence, value) of a per-instant sum of ``value`` over the rows ``where`` holds:
    None when any of those rows' values is unknown, as the report always summed."""
    if where is None:
        return "1", f"CASE WHEN COUNT({value}) = COUNT(*) THEN SUM({value}) END"
    kept = f"CASE WHEN {where} THEN {value} END"
    present = f"COUNT(CASE WHEN {where} THEN 1 END)"
    return present, f"CASE WHEN COUNT({kept}) = {present} THEN SUM({kept}) END"


def _processes(reader: SeriesReader, readings: Readings, cpus: float | None) -> None:
    col = lambda name: reader.col("process_samples", name)  # noqa: E731
    names = ["cpu_percent", "pss", "rss", "read_bytes_per_s", "compute_rss"]
    compute = ", ".join(f"'{r}'" for r in sorted(role_names.COMPUTE))
    sums = [_sum(col(name)) for name in names[:4]] + [_sum(col("rss"), f"role IN ({compute})")]
    if cpus:
        for role in readings.roles:
            names.append(f"role:{role}")
            sums.append(_sum(col("cpu_percent"), "role = ?"))
    select = ", ".join(f"{p} AS p{k}, {v} AS v{k}" for k, (p, v) in enumerate(sums))
    # A role's presence column holds one "role = ?", its value three.
    params = [role for role in readings.roles for _ in range(4)] if cpus else []
    procs = reader.instants["process_samples"]
    got = reader.read(
        f"SELECT t, {select} FROM process_samples{procs.where()} GROUP BY t ORDER BY t",
        [*params, *procs.params],
        names,
        scale={name: cpus for name in names if name.startswith("role:")} if cpus else {},
    )
    readings.job = {name: got[name] for name in names[:4]}
    readings.compute_rss = got["compute_rss"]
    readings.cpu_by_role = {n[5:]: got[n] for n in names if n.startswith("role:")}


def _gpu(reader: SeriesReader, readings: Readings, index: int, th: Thresholds) -> None:
    used, total = (
        reader.col("gpu_samples", "memory_used"),
        reader.col("gpu_samples", "memory_total"),
    )
    share = f"CASE WHEN {used} IS NOT NULL AND {total} THEN 100.0 * {used} / {total} END"
    util = reader.col("gpu_samples", "utilization_gpu")
    gpus, procs = reader.instants["gpu_samples"], reader.instants["gpu_process_samples"]
    got = reader.read(
        f"SELECT t, 1 AS p0, {util} AS v0, 1 AS p1, {share} AS v1 FROM gpu_samples"
        f"{gpus.where(BY_INDEX)} ORDER BY t",
        [index, *gpus.params],
        ["util", "memory"],
        limits={"memory": (th.gpu_memory_best_high_pct, th.gpu_memory_alert_pct)},
    )
    readings.gpu_util[index] = got["util"]
    readings.gpu_memory[index] = got["memory"]
    # The job's processes summed per instant, as a share of the device's total at that instant.
    _, job = _sum("used_memory")
    # The device's total at the same instant, found by the index on t (the unary + keeps
    # SQLite from choosing the index on "index", which holds every row of a one-GPU job).
    device_total = (
        f'(SELECT {total} FROM gpu_samples AS g WHERE +g."index" = ? AND g.t = p.t'
        " ORDER BY g.rowid DESC LIMIT 1)"
    )
    readings.gpu_job_memory[index] = reader.read(
        "SELECT t, 1 AS p0, CASE WHEN v IS NOT NULL AND total THEN 100.0 * v / total END AS v0"
        f" FROM (SELECT p.t AS t, p.v AS v, {device_total} AS total FROM (SELECT t, {job} AS v"
        f" FROM gpu_process_samples{procs.where('gpu_index = ?', 'in_job')} GROUP BY t) AS p)"
        " ORDER BY t",
        [index, index, *procs.params],
        ["job"],
    )["job"]


def _ordered_roles(found: list[str]) -> list[str]:
    order = [
        role_names.TRAINER,
        role_names.WORKER,
        role_names.RANK,
        role_names.LAUNCHER,
        role_names.OTHER,
    ]
    return sorted(found, key=lambda r: (order.index(r) if r in order else len(order), r))


def _any(rec: Recording, table: str) -> bool:
    return bool(list(rec.iter_query(f"SELECT 1 FROM {table} LIMIT 1")))


def _first(rec: Recording, sql: str) -> Any:
    for (value,) in rec.iter_query(sql):
        return value
    return None


def _unavailable(
    rec: Recording, table: str, fields: tuple[str, ...], instants: Instants
) -> str | None:
    """The reason a reader gave for a field it could not read: the first sample's that names
    one (streamed: asked only for a chart left empty)."""
    if "unavailable" not in rec.stored_columns(table):
        return None
    named = instants.where("unavailable IS NOT NULL", "unavailable != '{}'")
    for (text,) in rec.iter_query(
        f"SELECT unavailable FROM {table}{named} ORDER BY t", instants.params
    ):
        missing = decode_json(text)
        if not isinstance(missing, dict):
            continue
        for name in fields:
            if name in missing:
                return f"{name}: {missing[name]}"
    return None
