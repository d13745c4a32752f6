"""Recordings of bounded size: older samples folded into one row per interval, as written.

A week of a 72-process node at the default 0.5 s is 87 million process rows (about 11 GB).
The rules read at most one instant per slice of a long run (``diagnosis.context``), so most
of those rows are never read. The recorder's writer therefore folds, in the recording itself,
every ``bucket_s`` of samples older than ``recent_s`` into one row per process (per host, per
GPU) and keeps beside it summary rows with the extremes:

- the folded row is the bucket's last sample (its time, its cumulative counters: CPU seconds,
  I/O bytes, PSI totals, so rates computed from them stay exact) with every rate and level
  (``cpu_percent``, ``rss``, ``*_per_s``...) replaced by its mean over the bucket: the means
  and trends the rules compute are those of the full rows;
- a summary row (``*_summaries`` tables) per ``summary_s`` (10 minutes) per process holds the
  number of samples folded, the span they cover and the min/max of the columns whose extremes
  matter (peak RSS, lowest available memory, hottest GPU), which a mean would hide; coarser
  than the folded rows because it is as wide as one and read only for peaks (a row per minute
  of both would cost a week of a node 260 MB, over the 200 MB it must fit in).

Full resolution stays where it matters: the start-up (``startup_s``), the recent past
(``recent_s``, never folded while it is recent), ``margin_s`` around every job event (an OOM
kill, a worker exit, a NCCL timeout...) and every profiler window, and any GPU bucket that saw
an Xid error or an uncorrected ECC error.

Steps are folded in the same pass, in the same buckets and outside the same kept windows: of
each process's steps in a bucket the rows kept are those whose step number is a multiple of a
power-of-two stride (at least ``n / step_rows``: ranks stepping in lock-step keep the same step
numbers, which the rank rules compare step by step), its first steps (the warm-up rule's), the
steps a profiler window touched (``profiled``) and those that carry DDP's sampled figures
(``comm_s``). The others go into one ``step_summaries`` row per process per bucket: their
count, the sums of wall time, data wait (capped at the wall, as recording.steps counts it) and
samples, their shortest and longest wall, their CUDA peaks (allocated within a step,
reserved), and histograms of their walls and waits
(recording.step_histogram), from which recording.steps gives back every step figure: counts,
rates and shares exact, medians and p90s within 1.09 %. The table's last row is never deleted
(SQLite numbers a new row after the highest one; the running totals count steps by rowid).

Crash safety: each pass is one SQLite transaction (summary rows inserted, folded rows updated
in place, step rows thinned, the others deleted, the progress mark moved), so a copy of the file taken at any
moment is a valid recording, folded up to one mark or the next. Rows are updated in place,
never re-inserted: a live reader that follows rowids (``recording.tail``) never meets a row
twice. A recording written before compaction has no summary tables and reads as before.
"""

from __future__ import annotations

import json
import math
import sqlite3
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from torchdoctor.recording import step_histogram
from torchdoctor.recording.schema import TABLES, quote, select_list, stored_columns
from torchdoctor.recording.steps import WARMUP_MIN_STEPS, step_samples, step_wait_s

# meta keys: the policy a writer folded with, and how far it has folded (sample time)
META_POLICY = "compaction"
META_THROUGH = "compacted_through"
STEP_SUMMARIES = "step_summaries"
# One row per process per bucket whose steps were folded: the figures of the rows left out.
STEP_SUMMARY_COLUMNS = (
    ("bucket", "INTEGER"), ("pid", "INTEGER"), ("rank", "INTEGER"), ("t_from", "REAL"),
    ("t_to", "REAL"), ("n", "INTEGER"), ("wall_s", "REAL"), ("data_wait_s", "REAL"),
    ("samples", "INTEGER"), ("samples_unknown", "INTEGER"), ("wall_min", "REAL"),
    ("wall_max", "REAL"), ("wall_hist", "BLOB"), ("wait_hist", "BLOB"),
    ("cuda_max_allocated", "INTEGER"), ("cuda_reserved", "INTEGER"),  # their peaks
)  # fmt: skip
STEP_SUMMARIES_SQL = f"CREATE TABLE IF NOT EXISTS {STEP_SUMMARIES} ({', '.join(f'{n} {t}' for n, t in STEP_SUMMARY_COLUMNS)})"


_FIELDS = ("bucket_s", "summary_s", "recent_s", "startup_s", "margin_s")
# Added later: a policy stored without it (folded before steps were) takes the default.
_LATER_FIELDS = ("step_rows",)


@dataclass(frozen=True, slots=True)
class CompactionPolicy:
    """What a writer folds. The defaults bound a week of a 72-process node to about 150 MB."""

    bucket_s: float = 60.0  # one folded row per process per this many seconds
    summary_s: float = 600.0  # one summary row (the extremes) per process per this many
    recent_s: float = 900.0  # the last 15 minutes are never folded
    startup_s: float = 600.0  # nor the first 10 minutes (imports, warm-up, the first epoch)
    margin_s: float = 120.0  # nor this long either side of a job event or profiler window
    # Step rows kept per process per bucket, about (a power-of-two stride of step numbers),
    # beside DDP's sampled steps (1.2 a minute at 2 steps/s) and the bucket's summary row.
    step_rows: float = 1.0

    def __post_init__(self) -> None:
        for name in (*_FIELDS, *_LATER_FIELDS):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"compaction {name} must be a finite number >= 0, not {value!r}")
        if self.bucket_s <= 0 or self.summary_s <= 0 or self.step_rows < 1:
            raise ValueError("compaction bucket_s and summary_s must be above 0, step_rows >= 1")

    def to_meta(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_meta(cls, value: Any) -> CompactionPolicy | None:
        """The policy stored in a recording's meta, or None (kept full, or unreadable)."""
        if not isinstance(value, dict):
            return None
        try:
            later = {k: float(value[k]) for k in _LATER_FIELDS if k in value}
            return cls(**{k: float(value[k]) for k in _FIELDS}, **later)
        except (KeyError, TypeError, ValueError):
            return None


@dataclass(frozen=True, slots=True)
class Folding:
    """How one sample table is folded."""

    table: str
    summary: str  # its summary table
    keys: tuple[str, ...]  # one folded row per bucket per distinct value of these
    extremes: tuple[tuple[str, str], ...]  # (column, "min" or "max") kept in the summary
    last: frozenset[str]  # columns the folded row keeps from the bucket's last sample
    union: frozenset[str] = frozenset()  # JSON lists united over the bucket

    def mean_columns(self) -> list[str]:
        """Rates and levels: numeric columns neither keys, kept last nor united."""
        spec = TABLES[self.table]
        return [
            c.name
            for c in spec.columns
            if c.name not in self.last
            and c.name not in self.keys
            and c.name not in self.union
            and c.name != "t"
            and c.kind != "json"
            and c.sql_type != "TEXT"
        ]

    def create_sql(self) -> str:
        keys = "".join(f", {quote(k)}" for k in self.keys)
        ext = "".join(f", {quote(f'{c}_{how}')} REAL" for c, how in self.extremes)
        # period: the summary period's number since the start (the upsert's key with keys)
        return (
            f"CREATE TABLE IF NOT EXISTS {self.summary} (period INTEGER, t_from REAL, "
            f"t_to REAL{keys}, n INTEGER, kept INTEGER{ext})"
        )

    def upsert_sql(self) -> str:
        """Add one bucket's figures to its period's row (a pass folds one bucket at a time)."""
        names = ["period", "t_from", "t_to", *self.keys, "n", "kept", *self.extreme_names()]
        merge = ["t_from = MIN(t_from, excluded.t_from)", "t_to = MAX(t_to, excluded.t_to)"]
        merge.append("n = n + excluded.n")
        merge.append("kept = kept + excluded.kept")  # rows left: one a bucket
        for (_, how), name in zip(self.extremes, self.extreme_names(), strict=True):
            q = quote(name)
            # SQLite's two-argument MIN/MAX is NULL when either is: keep the known one
            merge.append(f"{q} = COALESCE({how.upper()}({q}, excluded.{q}), {q}, excluded.{q})")
        conflict = ", ".join(["period", *(quote(k) for k in self.keys)])
        return (
            f"INSERT INTO {self.summary} ({', '.join(quote(n) for n in names)}) VALUES "
            f"({', '.join('?' for _ in names)}) ON CONFLICT ({conflict}) DO UPDATE SET "
            + ", ".join(merge)
        )

    def extreme_names(self) -> list[str]:
        return [f"{c}_{how}" for c, how in self.extremes]


# Cumulative counters (a rate from two of them stays exact when the last is kept), text and
# figures that do not move within a run.
_PROCESS_LAST = frozenset(
    {"ppid", "create_time", "name", "role", "rank", "cpu_user_s", "cpu_system_s",
     "read_bytes", "write_bytes", "unavailable", "run_delay_s"}
)  # fmt: skip
_HOST_LAST = frozenset(
    {"mem_total", "swap_total", "per_core", "per_core_ids", "unavailable", "ctx_switches",
     "swap_in_bytes", "swap_out_bytes", "major_faults", "disk_read_bytes", "disk_written_bytes",
     "cgroup_nr_throttled", "cgroup_throttled_s", "cgroup_throttled_periods"}
    | {c.name for c in TABLES["host_samples"].columns if c.name.startswith("cpu_seconds_")}
    | {c.name for c in TABLES["host_samples"].columns if c.name.startswith("psi_") and c.name.endswith("_s")}
)  # fmt: skip
_GPU_LAST = frozenset(
    {"uuid", "memory_total", "power_limit_w", "ecc_corrected", "ecc_uncorrected", "xid_count",
     "unavailable"}
)  # fmt: skip

FOLDINGS: tuple[Folding, ...] = (
    Folding(
        "host_samples",
        "host_sample_summaries",
        (),
        (
            ("cpu_busy", "min"),
            ("cpu_busy", "max"),
            ("cpu_iowait", "max"),
            ("mem_available", "min"),
            ("swap_used", "max"),
            ("procs_running", "max"),
            ("procs_blocked", "max"),
            ("psi_memory_some", "max"),
            ("psi_io_some", "max"),
        ),
        _HOST_LAST,
    ),  # fmt: skip
    Folding(
        "process_samples",
        "process_sample_summaries",
        ("pid", "create_time"),
        (
            ("cpu_percent", "min"),
            ("cpu_percent", "max"),
            ("rss", "min"),
            ("rss", "max"),
            ("uss", "max"),
            ("swap", "max"),
            ("gpu_memory", "max"),
            # the shared memory a hand-off sizes /dev/shm from (sizing): its peak, not a mean
            ("dev_shm", "max"),
            ("shmem", "max"),
        ),
        _PROCESS_LAST - {"create_time"},
    ),  # fmt: skip
    Folding(
        "gpu_samples",
        "gpu_sample_summaries",
        ("index",),
        (
            ("utilization_gpu", "min"),
            ("utilization_gpu", "max"),
            ("memory_used", "max"),
            ("temperature_c", "max"),
            ("power_w", "max"),
        ),
        _GPU_LAST,
        frozenset({"clock_event_reasons", "xid_errors"}),
    ),  # fmt: skip
    # Every process on every GPU, every sample: on an 8-GPU node about 10 million rows a
    # week. A folded row per process per GPU holds its mean; the summary its peak, from which
    # the job's VRAM peak is read (in_job is a key: the job's rows are summed apart).
    Folding(
        "gpu_process_samples",
        "gpu_process_sample_summaries",
        ("gpu_index", "pid", "in_job"),
        (("used_memory", "max"),),
        frozenset({"local_pid"}),
    ),
)
SUMMARY_TABLES = tuple(f.summary for f in FOLDINGS)


def create_tables(db: sqlite3.Connection) -> None:
    db.execute(STEP_SUMMARIES_SQL)
    for folding in FOLDINGS:
        db.execute(folding.create_sql())
        keys = ", ".join(["period", *(quote(k) for k in folding.keys)])
        db.execute(
            f"CREATE UNIQUE INDEX IF NOT EXISTS {folding.summary}_k ON {folding.summary} ({keys})"
        )


def _protected(db: sqlite3.Connection, policy: CompactionPolicy, lo: float, hi: float) -> list:
    """Spans kept at full resolution that touch [lo, hi): around events and profile windows."""
    m = policy.margin_s
    spans = [
        (t - m, t + m)
        for (t,) in db.execute("SELECT t FROM events WHERE t >= ? AND t < ?", (lo - m, hi + m))
        if t is not None
    ]
    has_windows = db.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'profile_windows'"
    ).fetchone()
    if has_windows:
        spans += [
            (a - m, (b if b is not None else a) + m)
            for a, b in db.execute(
                "SELECT started_at, ended_at FROM profile_windows WHERE started_at IS NOT NULL"
                " AND started_at < ? AND COALESCE(ended_at, started_at) >= ?",
                (hi + m, lo - m),
            )
        ]
    return spans


def compact(
    db: sqlite3.Connection, policy: CompactionPolicy, started_at: float, latest_t: float
) -> int:
    """Fold every whole bucket older than ``latest_t - recent_s`` not yet folded; runs inside
    the caller's transaction. Returns the number of rows removed."""
    row = db.execute("SELECT value FROM meta WHERE key = ?", (META_THROUGH,)).fetchone()
    through = json.loads(row[0]) if row else started_at + policy.startup_s
    b = policy.bucket_s
    # Buckets are aligned to the start of the run, so a copy folded later folds the same ones.
    first = started_at + math.ceil((through - started_at) / b - 1e-9) * b
    last = started_at + math.floor((latest_t - policy.recent_s - started_at) / b + 1e-9) * b
    if last <= first:
        return 0
    # Made by the first pass, not with the recording: a short run's file stays as it was
    # (its first pages, all a 256 KiB disk holds, the schema in page 1 of a cut copy).
    create_tables(db)
    spans = _protected(db, policy, first, last)
    removed = 0
    for folding in FOLDINGS:
        removed += _fold_table(db, folding, policy, started_at, first, last, spans)
    removed += _fold_steps(db, policy, started_at, first, last, spans)
    db.execute(
        "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (META_THROUGH, json.dumps(last))
    )
    return removed


def _fold_table(
    db: sqlite3.Connection,
    folding: Folding,
    policy: CompactionPolicy,
    started_at: float,
    first: float,
    last: float,
    spans: list[tuple[float, float]],
) -> int:
    spec = TABLES[folding.table]
    stored = {r[1] for r in db.execute(f"PRAGMA table_info({folding.table})")}
    means = [c for c in folding.mean_columns() if c in stored]
    unions = [c for c in folding.union if c in stored]
    keys = list(folding.keys)
    cols = ["t", *keys, *means, *unions]
    select = ", ".join(quote(c) for c in cols)
    cursor = db.execute(
        f"SELECT rowid, {select} FROM {folding.table} WHERE t >= ? AND t < ? ORDER BY t, rowid",
        (first, last),
    )
    groups: dict[tuple, list[tuple]] = {}
    for r in cursor:
        t = r[1]
        if any(lo <= t < hi for lo, hi in spans):
            continue
        bucket = int((t - started_at) // policy.bucket_s)
        groups.setdefault((bucket, *r[2 : 2 + len(keys)]), []).append(r)
    integer = {c.name for c in spec.columns if c.sql_type == "INTEGER"}
    at = {c: i + 1 for i, c in enumerate(cols)}
    updates: list[tuple] = []
    deletes: list[tuple[int]] = []
    summaries: list[tuple] = []
    for key, rows in groups.items():
        if folding.table == "gpu_samples" and _gpu_trouble(rows, at):
            continue  # an Xid or a lost ECC bit: every sample around it stays
        values: list[Any] = []
        for c in means:
            seen = [r[at[c]] for r in rows if isinstance(r[at[c]], int | float)]
            mean = sum(seen) / len(seen) if seen else None
            values.append(round(mean) if mean is not None and c in integer else mean)
        for c in unions:
            united: list[Any] = []
            for r in rows:
                for item in _json_list(r[at[c]]):
                    if item not in united:
                        united.append(item)
            values.append(json.dumps(united, separators=(",", ":")) if united else rows[-1][at[c]])
        extremes = []
        for c, how in folding.extremes:
            seen = [r[at[c]] for r in rows if c in at and isinstance(r[at[c]], int | float)]
            extremes.append((min if how == "min" else max)(seen) if seen else None)
        period = int((rows[0][1] - started_at) // policy.summary_s)
        summaries.append((period, rows[0][1], rows[-1][1], *key[1:], len(rows), 1, *extremes))
        if len(rows) > 1:
            updates.append((*values, rows[-1][0]))
            deletes.extend((r[0],) for r in rows[:-1])
    if summaries:
        db.executemany(folding.upsert_sql(), summaries)
    if updates and (means or unions):
        sets = ", ".join(f"{quote(c)} = ?" for c in (*means, *unions))
        db.executemany(f"UPDATE {folding.table} SET {sets} WHERE rowid = ?", updates)
    if deletes:
        db.executemany(f"DELETE FROM {folding.table} WHERE rowid = ?", deletes)
    return len(deletes)


_STEP_COLUMNS = ["pid", "rank", "step", "t_end", "wall_s", "data_wait_s", "samples",
                 "batch_size", "profiled", "comm_s", "cuda_max_allocated",
                 "cuda_reserved"]  # fmt: skip


def _fold_steps(
    db: sqlite3.Connection,
    policy: CompactionPolicy,
    started_at: float,
    first: float,
    last: float,
    spans: list[tuple[float, float]],
) -> int:
    """Thin the step rows that ended in [first, last) outside ``spans``; one summary row per
    process per bucket for the rows deleted. Returns the rows deleted."""
    select = select_list(_STEP_COLUMNS, stored_columns(db, "steps"))
    (top,) = db.execute("SELECT MAX(rowid) FROM steps").fetchone()
    groups: dict[tuple[int, Any], list[tuple]] = {}
    for r in db.execute(
        f"SELECT rowid, {select} FROM steps WHERE t_end >= ? AND t_end < ? ORDER BY t_end, rowid",
        (first, last),
    ):
        t = r[4]
        if any(lo <= t < hi for lo, hi in spans):
            continue
        groups.setdefault((int((t - started_at) // policy.bucket_s), r[1]), []).append(r)
    deletes: list[tuple[int]] = []
    summaries: list[tuple] = []
    for (bucket, pid), rows in groups.items():
        stride = 1 << max(0, math.ceil(math.log2(len(rows) / policy.step_rows)))
        gone = [
            r
            for r in rows
            if r[3] % stride
            and r[3] >= WARMUP_MIN_STEPS
            and not r[9]  # profiled
            and r[10] is None  # comm_s: DDP's figures, on its sampled iterations only
            and r[0] != top
        ]
        if not gone:
            continue
        deletes.extend((r[0],) for r in gone)
        walls = [float(r[5] or 0.0) for r in gone]
        waits = [step_wait_s({"wall_s": r[5], "data_wait_s": r[6]}) for r in gone]
        counted = [step_samples({"samples": r[7], "batch_size": r[8]}) for r in gone]
        summaries.append(
            (bucket, pid, rows[0][2], gone[0][4], gone[-1][4], len(gone), sum(walls), sum(waits),
             sum(n for n in counted if n is not None), counted.count(None), min(walls),
             max(walls), step_histogram.encode(step_histogram.histogram(walls)),
             step_histogram.encode(step_histogram.histogram(waits)), max((r[11] for r in gone if r[11] is not None), default=None),
             max((r[12] for r in gone if r[12] is not None), default=None))
        )  # fmt: skip
    if summaries:
        db.executemany(
            f"INSERT INTO {STEP_SUMMARIES} VALUES ({', '.join('?' for _ in summaries[0])})",
            summaries,
        )
    if deletes:
        db.executemany("DELETE FROM steps WHERE rowid = ?", deletes)
    return len(deletes)


def _json_list(text: Any) -> list[Any]:
    if not isinstance(text, str):
        return []
    try:
        value = json.loads(text)
    except ValueError:
        return []
    return value if isinstance(value, list) else []


def _gpu_trouble(rows: list[tuple], at: dict[str, int]) -> bool:
    return "xid_errors" in at and any(_json_list(r[at["xid_errors"]]) for r in rows)


@dataclass(frozen=True, slots=True)
class SummarisedSpan:
    t_from: float
    t_to: float
    periods: int  # summary periods (summary_s) it holds
    samples: int  # host samples folded into them


def summarised_spans(db: sqlite3.Connection, policy: CompactionPolicy) -> list[SummarisedSpan]:
    """The spans whose samples are folded (from the host summaries; consecutive periods
    merged), oldest first. Empty for a recording kept full or written before compaction."""
    gap_s = max(policy.bucket_s, policy.summary_s)
    if not db.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'host_sample_summaries'"
    ).fetchone():
        return []
    spans: list[SummarisedSpan] = []
    cur: list[float] | None = None
    for t_from, t_to, n in db.execute(
        "SELECT t_from, t_to, n FROM host_sample_summaries ORDER BY t_from"
    ):
        if cur is not None and t_from - cur[1] <= gap_s * 1.5:
            cur[1], cur[2], cur[3] = t_to, cur[2] + 1, cur[3] + (n or 0)
            continue
        if cur is not None:
            spans.append(SummarisedSpan(cur[0], cur[1], int(cur[2]), int(cur[3])))
        cur = [t_from, t_to, 1, n or 0]
    if cur is not None:
        spans.append(SummarisedSpan(cur[0], cur[1], int(cur[2]), int(cur[3])))
    return spans


def compact_file(path: str, policy: CompactionPolicy, chunks: Iterable[float] | None = None) -> int:
    """Fold a finished recording at ``path`` with ``policy`` as its writer would have (tests,
    benchmarks), one transaction per chunk end in ``chunks`` (sample times; default: one pass
    at the end). Returns the rows removed."""
    db = sqlite3.connect(path, isolation_level=None)
    try:
        meta = {k: json.loads(v) for k, v in db.execute("SELECT key, value FROM meta")}
        started_at = float(meta["started_at"])
        (latest,) = db.execute("SELECT MAX(t) FROM host_samples").fetchone()
        if latest is None:
            return 0
        removed = 0
        db.execute("BEGIN")
        create_tables(db)
        db.execute(
            "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
            (META_POLICY, json.dumps(policy.to_meta())),
        )
        db.execute("COMMIT")
        for end in [*(chunks or ()), latest]:
            db.execute("BEGIN IMMEDIATE")
            removed += compact(db, policy, started_at, min(end, latest))
            db.execute("COMMIT")
        return removed
    finally:
        db.close()


__all__ = [
    "FOLDINGS",
    "META_POLICY",
    "META_THROUGH",
    "STEP_SUMMARIES",
    "SUMMARY_TABLES",
    "CompactionPolicy",
    "SummarisedSpan",
    "compact",
    "compact_file",
    "create_tables",
    "summarised_spans",
]
