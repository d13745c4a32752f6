"""Reading a recording back: the documented Python API for tools and notebooks.

    >>> from torchdoctor import open_recording
    >>> rec = open_recording("torchdoctor-runs/20261130T101500Z-python.sqlite")
    >>> rec.meta["command"], rec.meta["exit_status"]
    >>> cpu = rec.rows("host_samples", columns=["t", "cpu_busy", "cpu_iowait"])
    >>> workers = [p for p in rec.processes() if p["role"] == "dataloader-worker"]
    >>> day = rec.frame("process_samples")  # a long recording: one array per column read
    >>> rss = list(day.group_by("pid")[1234].values("rss"))

Tables: ``host_samples``, ``processes``, ``process_samples``, ``gpu_samples``,
``gpu_process_samples``, ``steps``, ``dataloaders``, ``settings``, ``events``. Columns are the
fields of the dataclasses in :mod:`torchdoctor.sampling.types` and
:mod:`torchdoctor.recording.records` (nested ``cpu`` split flattened as ``cpu_user``...);
JSON columns (``per_core``, ``unavailable``, ``cmdline``...) come back decoded; ``per_core``
holds one list per core: [user, nice, system, idle, iowait, irq, softirq, steal] in percent.

``rec.state`` says whether the recording is complete, in progress (its writer alive) or cut
short; ``rec.damage`` lists what a damaged file lost (empty when intact): such a file is read
as far as it can be, and everything above works on what was read.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sqlite3
import stat
import typing
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchdoctor.errors import NotARecordingError, UserError
from torchdoctor.recording import file_head, step_histogram
from torchdoctor.recording.compaction import (
    FOLDINGS,
    META_POLICY,
    STEP_SUMMARIES,
    STEP_SUMMARY_COLUMNS,
    CompactionPolicy,
    SummarisedSpan,
    summarised_spans,
)
from torchdoctor.recording.frame import SampleFrame, make_frame
from torchdoctor.recording.records import ProfileSyncSite, ProfileWindow
from torchdoctor.recording.salvage import is_damage, salvage
from torchdoctor.recording.schema import (
    APPLICATION_ID,
    SCHEMA_VERSION,
    TABLES,
    Table,
    from_row,
    quote,
    select_list,
    stored_columns,
)
from torchdoctor.recording.state import (
    DEFAULT_CHECKPOINT_S,
    RecordingState,
    describe_state,
    journal_is_wal,
    missing_wal_hint,
    recording_state,
)
from torchdoctor.recording.steps import (
    FIGURE_COLUMNS,
    FoldedSteps,
    ProcessSteps,
    StepStats,
    process_step_stats,
)


@dataclass(frozen=True, slots=True)
class Instants:
    """Which sampling instants of a table a reader takes (:meth:`Recording.instants`): every
    one, or at most one per ``every_s`` seconds and the last, for a bounded resolution."""

    every_s: float | None  # None: every instant
    condition: str  # an SQL condition on the table's column t; "" when every instant
    params: tuple[Any, ...]

    def where(self, *conditions: str) -> str:
        """`` WHERE`` with ``conditions`` and then this one ("" when there are none): the
        parameters of ``conditions`` come first, then :attr:`params`."""
        parts = [c for c in (*conditions, self.condition) if c]
        return f" WHERE {' AND '.join(parts)}" if parts else ""


EVERY_INSTANT = Instants(None, "", ())


class Recording:
    """A recording opened for reading. Use :func:`open_recording` to get one."""

    def __init__(
        self,
        path: Path,
        db: sqlite3.Connection,
        schema_version: int,
        damage: list[str] | None = None,
        wal_beside: bool | None = None,
    ) -> None:
        self.path = path
        # Whether NAME.sqlite-wal existed before we opened it (opening creates one).
        self._wal_beside = Path(f"{path}-wal").exists() if wal_beside is None else wal_beside
        self.schema_version = schema_version
        # What a damaged file lost, one line each; empty for an intact recording.
        self.damage: list[str] = list(damage or [])
        self._db = db
        self._db.row_factory = sqlite3.Row
        self._state: RecordingState | None = None
        self.meta: dict[str, Any] = _decoded_meta(path, self._fetch("SELECT key, value FROM meta"))
        self._stored: dict[str, set[str]] = {}
        self._step_stats: tuple[tuple, StepStats] | None = None  # (the steps' mark, stats)

    # -- generic access ----------------------------------------------------------------
    def tables(self) -> list[str]:
        return list(TABLES)

    def columns(self, table: str) -> list[str]:
        return TABLES[self._check(table)].column_names

    def count(self, table: str) -> int:
        return self._fetch(f"SELECT COUNT(*) FROM {self._check(table)}")[0][0]

    def rows(
        self,
        table: str,
        columns: list[str] | None = None,
        where: dict[str, Any] | None = None,
        order_by: str | None = None,
    ) -> list[dict[str, Any]]:
        """Rows of ``table`` as dicts, oldest first, optionally filtered by equality."""
        spec = TABLES[self._check(table)]
        cols = columns or spec.column_names
        unknown = set(cols) - set(spec.column_names)
        if unknown:
            raise UserError(f"table {table!r} has no column {sorted(unknown)[0]!r}")
        sql = f"SELECT {self._select_list(table, cols)} FROM {table}"
        params: list[Any] = []
        if where:
            bad = set(where) - set(spec.column_names)
            if bad:
                raise UserError(f"table {table!r} has no column {sorted(bad)[0]!r}")
            sql += " WHERE " + " AND ".join(f"{quote(k)} = ?" for k in where)
            params = list(where.values())
        order = order_by or _default_order(table)
        if order:
            sql += f" ORDER BY {order}"
        rows = [from_row(spec, dict(r)) for r in self._fetch(sql, params)]
        self._check_types(spec, cols, rows)
        return rows

    def _check_types(self, spec: Table, columns: list[str], rows: list[dict[str, Any]]) -> None:
        """Raise "damaged or edited" for a value no writer stores in its column (a blob, text
        where a number belongs): it would travel into summaries and JSON and fail there."""
        wanted = {
            c.name: (str,) if c.sql_type == "TEXT" else (int, float)
            for c in spec.columns
            if c.kind != "json" and c.name in columns
        }
        # NULL where the record's field cannot be None (a process's pid and role): a column
        # this file lacks (added to the schema later) reads as NULL and is no damage
        required = _required_fields(spec) & set(columns) & self.stored_columns(spec.name)
        for row in rows:
            for name, types in wanted.items():
                value = row[name]
                if value is None and name in required:
                    raise damaged(self.path, f"{spec.name}.{name} is NULL")
                if value is not None and not isinstance(value, types):
                    raise damaged(self.path, f"{spec.name}.{name} holds {str(value)[:40]!r}")

    def iter_rows(self, table: str):
        """Stream every row of ``table`` (for exports of long recordings)."""
        spec = TABLES[self._check(table)]
        cols = self._select_list(table, spec.column_names)
        order = f"{_default_order(table) or 'rowid'}, rowid"
        sql = f"SELECT rowid AS _rowid, {cols} FROM {table}"
        done = 0  # rows yielded: a read that meets damage resumes after them, salvaged
        while True:
            try:
                for r in self._db.execute(f"{sql} ORDER BY {order} LIMIT -1 OFFSET ?", (done,)):
                    row = dict(r)
                    del row["_rowid"]
                    done += 1
                    yield from_row(spec, row)
                return
            except sqlite3.DatabaseError as exc:
                if not self._salvage_after(exc):
                    raise

    def last_rows(self, table: str, by: str, n: int) -> list[dict[str, Any]]:
        """The last ``n`` rows of ``table`` by the column ``by``, as dicts in that column's
        order: what a reader needs of the recent past without reading a long table whole."""
        spec = TABLES[self._check(table)]
        if by not in spec.column_names:
            raise UserError(f"table {table!r} has no column {by!r}")
        cols = self._select_list(table, spec.column_names)
        sql = (
            f"SELECT * FROM (SELECT {cols} FROM {table} ORDER BY {quote(by)} DESC LIMIT ?)"
            f" ORDER BY {quote(by)}"
        )
        return [dict(r) for r in self._fetch(sql, (n,))]

    def frame(
        self,
        table: str,
        t_from: float | None = None,
        t_to: float | None = None,
        where: dict[str, Any] | None = None,
        max_instants: int | None = None,
        instants: Instants | None = None,
    ) -> SampleFrame:
        """The rows of ``table`` (``t`` between ``t_from`` and ``t_to`` when given, optionally
        filtered by equality), in the order of :meth:`rows`, as a
        :class:`~torchdoctor.recording.frame.SampleFrame`: one compact array per column, each
        read on first use. For long recordings (samples, steps), where :meth:`rows` would
        hold a dict per row.

        ``max_instants``: read at most about that many sampling instants, evenly spread
        (:meth:`instants`), so that a week costs what a day does; the frame's ``every_s``
        says when that thinned it. ``instants``: the instants to read, chosen by the caller
        (:meth:`bucket_instants`), in place of ``max_instants``."""
        spec = TABLES[self._check(table)]
        timed = t_from is not None or t_to is not None or max_instants is not None
        if timed and "t" not in spec.column_names:
            raise UserError(f"table {table!r} has no sample time t: read it without t_from/t_to")
        bad = set(where or {}) - set(spec.column_names)
        if bad:
            raise UserError(f"table {table!r} has no column {sorted(bad)[0]!r}")
        conds, params = _time_bounds(t_from, t_to)
        for key, value in (where or {}).items():
            conds.append(f"{quote(key)} = ?")
            params.append(value)
        if instants is None:
            instants = EVERY_INSTANT
            if max_instants is not None:
                instants = self.instants(table, max_instants, t_from, t_to)
        if instants.condition:
            conds.append(instants.condition)
            params.extend(instants.params)
        # The rows are those there now: a live recorder's later rows (higher rowids) are
        # left out, so every column read later lines up with the first.
        last = self._fetch(f"SELECT MAX(rowid) FROM {table}")[0][0] or 0
        conds.append("rowid <= ?")
        params.append(last)
        cond = " WHERE " + " AND ".join(conds)
        length = self._fetch(f"SELECT COUNT(*) FROM {table}{cond}", params)[0][0]
        first = _default_order(table)
        order = f"{first}, rowid" if first and first != "rowid" else "rowid"

        def read(column: str):
            sql = f"SELECT {self._select_list(table, [column])} FROM {table}{cond} ORDER BY {order}"
            return self._iter_plain(sql, params)

        return make_frame(spec, read, length, instants.every_s)

    def instants(
        self,
        table: str,
        max_instants: int,
        t_from: float | None = None,
        t_to: float | None = None,
    ) -> Instants:
        """The sampling instants of ``table`` (between ``t_from`` and ``t_to``) a reader at
        bounded resolution takes: every one when there are no more than about
        ``max_instants`` (the span over the recording's interval), else the first instant of
        each of ``max_instants`` equal slices of the span, and the last instant.

        Found by index seeks (one per slice), never by reading the table, so choosing
        costs the same for a day as for a week; slices without a sample are left out."""
        if max_instants < 1:
            raise UserError(f"max_instants must be at least 1, not {max_instants}")
        table = self._check(table)
        bounds, params = _time_bounds(t_from, t_to)
        cond = f" WHERE {' AND '.join(bounds)}" if bounds else ""
        # Two subqueries: SQLite answers a lone MIN or MAX from the index on t, both in one
        # SELECT by reading the whole table.
        lo, hi = self._fetch(
            f"SELECT (SELECT MIN(t) FROM {table}{cond}), (SELECT MAX(t) FROM {table}{cond})",
            params * 2,
        )[0]
        if lo is None or hi <= lo:
            return EVERY_INSTANT
        # No more rows than instants asked for (a short run): every instant, found by
        # reading at most that many entries of the index.
        (rows,) = self._fetch(
            f"SELECT COUNT(*) FROM (SELECT 1 FROM {table}{cond} LIMIT ?)",
            [*params, max_instants + 1],
        )[0]
        if rows <= max_instants:
            return EVERY_INSTANT
        every = (hi - lo) / max_instants
        try:
            interval = float(self.meta.get("interval_s") or 0.0)
        except (TypeError, ValueError):
            interval = 0.0  # unknown: slices shorter than it only cost seeks, never instants
        if every <= interval:
            return EVERY_INSTANT
        condition = (
            "t IN (WITH RECURSIVE slice(s) AS (SELECT ? UNION ALL SELECT s + ? FROM slice"
            f" WHERE s + ? <= ?) SELECT (SELECT MIN(t) FROM {table} WHERE t >= s AND t < s + ?)"
            " FROM slice UNION SELECT ?)"
        )
        return Instants(every, condition, (lo, every, every, hi, every, hi))

    def bucket_instants(self, table: str, origin: float, every_s: float) -> Instants:
        """The last instant of each slice ``[origin + k * every_s, origin + (k + 1) *
        every_s)`` of ``table``: on a recording the writer folded (recording.compaction) with
        buckets of ``every_s`` (or a divisor of it) aligned on ``origin``, exactly the
        instants its folded rows stand at, and the same instants where it kept every
        sample, so a series reads at one resolution throughout. Index seeks, one a slice."""
        if not (every_s > 0 and math.isfinite(every_s) and math.isfinite(origin)):
            raise UserError(f"bucket_instants needs a finite every_s above 0, not {every_s}")
        table = self._check(table)
        lo, hi = self._fetch(f"SELECT (SELECT MIN(t) FROM {table}), (SELECT MAX(t) FROM {table})")[
            0
        ]
        if lo is None:
            return EVERY_INSTANT
        first = origin + math.floor((lo - origin) / every_s) * every_s
        condition = (
            "t IN (WITH RECURSIVE slice(s) AS (SELECT ? UNION ALL SELECT s + ? FROM slice"
            f" WHERE s + ? <= ?) SELECT (SELECT MAX(t) FROM {table} WHERE t >= s AND t < s + ?)"
            " FROM slice)"
        )
        return Instants(every_s, condition, (first, every_s, every_s, hi, every_s))

    def query(self, sql: str, params: tuple | list = ()) -> list[dict[str, Any]]:
        """Run a read-only SQL query (for aggregates the helpers above do not cover)."""
        if not sql.lstrip().upper().startswith(("SELECT", "WITH")):
            raise UserError("Recording.query runs SELECT statements only")
        return [dict(r) for r in self._fetch(sql, params)]

    def iter_query(self, sql: str, params: tuple | list = ()) -> Iterator[tuple]:
        """Rows of a read-only SQL query as tuples, streamed: aggregates over long recordings
        (a report's time buckets) without a Python object per row of the table."""
        if not sql.lstrip().upper().startswith(("SELECT", "WITH")):
            raise UserError("Recording.iter_query runs SELECT statements only")
        # A subquery, so that the read can resume with LIMIT/OFFSET after salvaging.
        return self._iter_tuples(f"SELECT * FROM ({sql})", params)

    def stored_columns(self, table: str) -> set[str]:
        """The columns ``table`` has in this file: one added to the schema after it was
        written is missing (:meth:`rows` reads it as NULL; raw SQL must too)."""
        stored = self._stored.get(self._check(table))
        if stored is None:
            try:
                stored = self._stored[table] = stored_columns(self._db, table)
            except sqlite3.Error as exc:  # e.g. its schema text is not UTF-8
                raise damaged(self.path, exc) from None
        return stored

    # -- convenience -------------------------------------------------------------------
    def processes(self) -> list[dict[str, Any]]:
        """Every process seen in the job, once, with its role and command line.

        A process that exec()s is described again under the same (pid, create_time): the
        latest description wins, so a shell that became python shows as the python.
        """
        latest: dict[tuple[int, float], dict[str, Any]] = {}
        for row in self.rows("processes"):
            latest[(row["pid"], row["create_time"])] = row
        return list(latest.values())

    def steps(self) -> list[dict[str, Any]]:
        """The step rows: every step, or where the writer folded steps (:meth:`folded_steps`)
        an evenly spread few of each process's steps per bucket there."""
        return self.rows("steps")

    @functools.cached_property
    def folded_steps(self) -> dict[int, FoldedSteps]:
        """Per pid, the steps whose rows the writer folded away (recording.compaction):
        their count, sums and histograms. Empty when every step row is kept."""
        if not self._has_table(STEP_SUMMARIES):
            return {}
        stored = stored_columns(self._db, STEP_SUMMARIES)
        columns = [name for name, _ in STEP_SUMMARY_COLUMNS]
        out: dict[int, FoldedSteps] = {}
        for row in self._fetch(
            f"SELECT {select_list(columns, stored)} FROM {STEP_SUMMARIES} ORDER BY t_to"
        ):
            r = dict(zip(columns, row, strict=True))
            f = out.get(r["pid"])
            if f is None:
                f = out[r["pid"]] = FoldedSteps()
            f.count += r["n"]
            f.wall_s += r["wall_s"]
            f.data_wait_s += r["data_wait_s"]
            f.samples += r["samples"]
            f.samples_unknown += r["samples_unknown"]
            f.add(
                FoldedSteps(
                    wall_min_s=r["wall_min"],
                    wall_max_s=r["wall_max"],
                    spans=[(r["t_from"], r["t_to"], r["n"])],
                    cuda_max_allocated=r["cuda_max_allocated"],
                    cuda_reserved=r["cuda_reserved"],
                )
            )
            step_histogram.decode(r["wall_hist"], f.walls)
            step_histogram.decode(r["wait_hist"], f.waits)
        return out

    def step_pids(self) -> list[int]:
        """The processes that recorded steps, in the order their first step ended."""
        rows = self._fetch("SELECT pid FROM steps GROUP BY pid ORDER BY MIN(t_end), MIN(rowid)")
        return [r[0] for r in rows]

    def process_steps(
        self, pids: Iterable[int] | None = None, columns: Sequence[str] = FIGURE_COLUMNS
    ) -> Iterator[ProcessSteps]:
        """Each process's step rows (``pids``, by default every one that stepped), one
        process at a time, column by column (:class:`~torchdoctor.recording.steps.
        ProcessSteps`): a reader that keeps only what it computes from each holds one
        process's columns at a time, however long the recording. Rows written after the
        first is read are left out (a live recorder's)."""
        last = self._fetch("SELECT MAX(rowid) FROM steps")[0][0] or 0
        names = list(dict.fromkeys(("step", *columns)))
        select = self._select_list("steps", names)
        # In step order; rows of one step as Recording.rows orders them (by their end)
        sql = f"SELECT {select} FROM steps WHERE pid = ? AND rowid <= ? ORDER BY step, t_end, rowid"
        folded = self.folded_steps
        for pid in self.step_pids() if pids is None else pids:
            yield ProcessSteps.from_chunks(
                pid, names, self._iter_chunks(sql, (pid, last)), folded.get(pid)
            )

    def step_ends(self, pid: int) -> array:
        """The ends of ``pid``'s step rows, in no set order (read off the index on t_end)."""
        return array("d", self._iter_plain("SELECT t_end FROM steps WHERE pid = ?", (pid,)))

    def step_stats(self, each: Callable[[ProcessSteps], None] | None = None) -> StepStats | None:
        """The job's step summary (:mod:`torchdoctor.recording.steps`), None without steps.

        ``show``, ``diagnose`` and ``report`` all print this one summary of the recording.
        Read one process at a time (a day of steps as dicts would be gigabytes); kept until
        the steps change (``diagnose --json`` prints the one its rules read). ``each``: also
        called with each process's steps as they are read (the rank rules' summaries): the
        steps are then read again even where the summary is kept."""
        # The steps' mark: their last row, and the folded ones' (a compaction pass adds some)
        key: tuple = (self._fetch("SELECT MAX(rowid) FROM steps")[0][0],)
        if self._has_table(STEP_SUMMARIES):
            key += (self._fetch(f"SELECT MAX(rowid) FROM {STEP_SUMMARIES}")[0][0],)
        if each is None and self._step_stats is not None and self._step_stats[0] == key:
            return self._step_stats[1]
        if key[0] is None:
            return None
        loaders, settings = self.rows("dataloaders"), self.rows("settings")
        try:
            processes = self.process_steps()
            if each is not None:
                processes = _calling(each, processes)
            stats = process_step_stats(processes, loaders, settings)
        except (TypeError, ValueError) as exc:
            # A step without a figure every step has (its time NULL, or text read as NULL):
            # edited, and every reader of the summary would fail on it, each rule on its own.
            raise damaged(self.path, f"a step lacks a figure ({exc})") from None
        self._step_stats = (key, stats)
        return stats

    def profile_windows(self) -> list[ProfileWindow]:
        """The profiler windows of the job (``run --profile-steps``, ``torchdoctor profile``),
        in the order they ended; none in a recording written before windows existed."""
        if not self._has_table("profile_windows"):
            return []
        names = [f.name for f in dataclasses.fields(ProfileWindow)]
        rows = self._fetch_profile(f"SELECT {', '.join(names)} FROM profile_windows ORDER BY id")
        return [ProfileWindow(*row) for row in rows]

    def profile_sync_sites(self, window_id: int) -> list[ProfileSyncSite]:
        """The source lines that synchronised with the device in window ``window_id``, the
        costliest first."""
        if not self._has_table("profile_sync_sites"):
            return []
        names = [f.name for f in dataclasses.fields(ProfileSyncSite)]
        rows = self._fetch_profile(
            f"SELECT {', '.join(names)} FROM profile_sync_sites WHERE window_id = ? "
            "ORDER BY total_s DESC, count DESC, file, line",
            (window_id,),
        )
        return [ProfileSyncSite(*row) for row in rows]

    def _fetch_profile(self, sql: str, params: tuple | list = ()) -> list[sqlite3.Row]:
        """A read of a profile table whose columns the writer always makes: one that lost a
        column was edited, which is the one 'damaged or edited' line (each profile rule
        reading it would otherwise fail apart, one line each, before the error)."""
        try:
            return self._fetch(sql, params)
        except sqlite3.OperationalError as exc:
            raise damaged(self.path, exc) from None

    @functools.cached_property
    def compaction(self) -> CompactionPolicy | None:
        """How the writer folded older samples (recording.compaction), or None: every sample
        kept (``--keep full``, or a recording written before compaction). Folded rows are
        read like any other: one row per process per bucket, its rates and levels the
        bucket's means; :meth:`summaries` holds the buckets' extremes."""
        policy = CompactionPolicy.from_meta(self.meta.get(META_POLICY))
        # A damaged file read through salvage keeps the sample tables, not the summaries:
        # it is read as kept full (what it holds of the folded rows reads as rows)
        if policy is None or not self._has_table(FOLDINGS[0].summary):
            return None
        return policy

    def summarised_spans(self) -> list[SummarisedSpan]:
        """The spans of the run whose samples are folded, oldest first (none when kept
        full)."""
        policy = self.compaction
        if policy is None:
            return []
        return summarised_spans(self._db, policy)

    def summaries(self, table: str) -> list[dict[str, Any]]:
        """The summary rows of a folded sample table (``host_samples``, ``process_samples``,
        ``gpu_samples``): per summary period (``summary_s``) and process (GPU), the span
        folded, the samples folded (n) and the extremes (``rss_max``...); empty when nothing
        was folded."""
        folding = next((f for f in FOLDINGS if f.table == table), None)
        if folding is None:
            raise UserError(f"table {table!r} has no summaries")
        if not self._has_table(folding.summary):
            return []
        return [dict(r) for r in self._fetch(f"SELECT * FROM {folding.summary} ORDER BY t_from")]

    def _has_table(self, name: str) -> bool:
        return bool(
            self._fetch("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,))
        )

    @property
    def started_at(self) -> float | None:
        return self.meta.get("started_at")

    @property
    def ended_at(self) -> float | None:
        """End of the run; for a recording cut short, the last sample's time."""
        end = self.meta.get("ended_at")
        if end is None:
            end = self._last_sample_at()
        return end

    @property
    def complete(self) -> bool:
        """False when the recorder stopped before it could write the end of the run."""
        return "ended_at" in self.meta

    @property
    def state(self) -> RecordingState:
        """Complete, in progress (its writer alive, last write when), or cut short."""
        if self._state is None:
            from torchdoctor.recording.writer import STOPPED_HERE

            self._state = recording_state(
                self.meta,
                self._last_sample_at(),
                journal_is_wal(self.path),
                self._wal_beside,
                stopped_here=str(self.path.resolve()) in STOPPED_HERE,
            )
        return self._state

    def notes(self) -> list[str]:
        """Lines to print before anything read from this recording: what a damaged file
        lost, and unless complete its state (in progress: figures cover the run so far)."""
        notes = list(self.damage)
        if not self.complete:
            notes.append(describe_state(self.state, self.path))
        return notes + self.instrumentation_off()

    def instrumentation_off(self) -> list[str]:
        """One line per process whose in-job instrumentation switched itself off (the agent
        records why, once): its steps and settings stop there, and every figure read from
        them says less than the job did, so whatever prints figures says so first."""
        rows = self.rows("events", where={"kind": "instrumentation-disabled"})
        lines = []
        for row in rows:
            detail = row["detail"]
            if isinstance(detail, str):
                try:
                    detail = json.loads(detail)
                except ValueError:
                    detail = {"error": detail}
            if not isinstance(detail, dict):
                detail = {}
            who = f"pid {row['pid']}" + (
                f" (rank {row['rank']})" if row["rank"] is not None else ""
            )
            at = f" {row['t'] - self.started_at:.1f} s into the run" if self.started_at else ""
            lines.append(
                f"the in-job instrumentation of {who} switched itself off{at}, in"
                f" {detail.get('where') or 'unknown'} ({detail.get('error') or 'no reason given'}):"
                " its steps and settings after that are missing; the job itself ran on untouched"
            )
        return lines

    def _last_sample_at(self) -> float | None:
        rows = self._fetch("SELECT MAX(t) FROM host_samples")
        return rows[0][0] if rows else None

    def _fetch(self, sql: str, params: tuple | list = ()) -> list[sqlite3.Row]:
        """Run ``sql``; a damaged file met on the way is salvaged once and the query rerun."""
        try:
            return self._db.execute(sql, params).fetchall()
        except sqlite3.DatabaseError as exc:
            if not self._salvage_after(exc):
                raise
            return self._db.execute(sql, params).fetchall()

    def _iter_plain(self, sql: str, params: tuple | list = ()):
        """The first value of each row of ``sql``, streamed: a column of millions of rows
        never sits in memory as one Python object per value."""
        return (row[0] for row in self._iter_tuples(sql, params))

    def _iter_tuples(self, sql: str, params: tuple | list = ()) -> Iterator[tuple]:
        """The rows of ``sql`` as tuples, streamed (:meth:`_iter_chunks` one row at a time)."""
        for rows in self._iter_chunks(sql, params):
            yield from rows

    def _iter_chunks(self, sql: str, params: tuple | list = ()) -> Iterator[list[tuple]]:
        """The rows of ``sql`` as lists of tuples, streamed. A damaged file met on the way is
        salvaged once and the read resumes after the rows already given."""
        done = 0
        while True:
            try:
                cur = self._db.cursor()
                cur.row_factory = None
                cur.execute(f"{sql} LIMIT -1 OFFSET ?", (*params, done))
                while rows := cur.fetchmany(8192):
                    done += len(rows)
                    yield rows
                return
            except sqlite3.DatabaseError as exc:
                if not self._salvage_after(exc):
                    raise

    def _salvage_after(self, exc: sqlite3.DatabaseError) -> bool:
        """Switch to the readable part of a damaged file; False when that cannot help."""
        if self.damage or not is_damage(exc):
            return False
        db, notes = salvage(self.path, str(exc))
        self._db.close()
        self._db = db
        self._db.row_factory = sqlite3.Row
        self._stored = {}  # the salvaged copy has every column of the current schema
        self.damage = notes
        return True

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Recording:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb) -> None:
        self.close()
        # Every reader works inside `with open_recording(...)`: a value of the wrong type, a
        # dropped table or column met anywhere in its reading is the file's fault, and the
        # user gets one line instead of a traceback from deep in a summary or a report.
        if isinstance(exc, DAMAGE_ERRORS):
            raise damaged(self.path, exc) from exc

    def _select_list(self, table: str, columns: list[str]) -> str:
        return select_list(columns, self.stored_columns(table))

    def _check(self, table: str) -> str:
        if table not in TABLES:
            raise UserError(f"unknown table {table!r}; tables are: {', '.join(TABLES)}")
        return table


def _calling(each: Callable[[ProcessSteps], None], processes: Iterable[ProcessSteps]):
    for proc in processes:
        each(proc)
        yield proc


@functools.cache
def _required_fields(spec: Table) -> frozenset[str]:
    """The scalar columns of ``spec`` whose record field is never None."""
    hints = typing.get_type_hints(spec.record)
    return frozenset(
        c.name
        for c in spec.columns
        if c.kind == "scalar" and type(None) not in typing.get_args(hints.get(c.name, object))
    )


def _time_bounds(t_from: float | None, t_to: float | None) -> tuple[list[str], list[Any]]:
    """SQL conditions (and their parameters) for ``t`` between ``t_from`` and ``t_to``."""
    conds: list[str] = []
    params: list[Any] = []
    if t_from is not None:
        conds.append("t >= ?")
        params.append(t_from)
    if t_to is not None:
        conds.append("t <= ?")
        params.append(t_to)
    return conds, params


def _default_order(table: str) -> str | None:
    return {
        "steps": "t_end",
        "processes": "rowid",
        "dataloaders": "t",
    }.get(table, "t")


# What reading a recording whose tables or values were edited (or damaged past what salvage
# notices) raises: a missing table or column, text where a number belongs, a NULL figure.
DAMAGE_ERRORS = (sqlite3.Error, ValueError, TypeError, LookupError, AttributeError)

# The type of each meta value the readers compute with (None is allowed for each: unknown).
_META_TIMES = ("started_at", "ended_at", "closed_at")  # seconds since the epoch
_LAST_TIME = 253_402_300_800  # 10000-01-01 UTC
_META_TYPES: dict[str, type | tuple[type, ...]] = {
    "schema_version": int,
    "started_at": (int, float),
    "ended_at": (int, float),
    "closed_at": (int, float),
    "interval_s": (int, float),
    "checkpoint_every_s": (int, float),
    "exit_status": int,
    "exit_signal": str,
    "root_pid": int,
    "command": list,
    "mode": str,
    "host": dict,
    "gpus": dict,
    "env": dict,
    "writer": dict,
    "totals": dict,
}
# The type of the items of a meta list the readers join as text (the command line is printed).
_META_ITEMS: dict[str, type] = {"command": str}


def damaged(path: Path, what: BaseException | str) -> NotARecordingError:
    """The one line for a recording that cannot be read as one because it was damaged or
    edited after it was written (``what``: the error met, or what is wrong)."""
    if isinstance(what, BaseException):
        what = f"{type(what).__name__}: {what}"
    return NotARecordingError(
        f"{str(path)!r} is damaged or edited: {what}; it cannot be read as a recording "
        "(record the job again, or read its tables with sqlite3)"
    )


def require_regular_file(path: Path) -> None:
    """Raise the one-line UserError unless ``path`` is a regular file: a reader must never
    open a FIFO (opening and reading one waits for a writer forever), a device or a folder."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise UserError(f"no such file: {str(path)!r}") from None
    except OSError as exc:
        raise UserError(f"cannot read {str(path)!r}: {exc.strerror}") from None
    if stat.S_ISDIR(mode):
        raise UserError(f"{str(path)!r} is a folder, not a recording (.sqlite file)")
    if not stat.S_ISREG(mode):
        raise NotARecordingError(
            f"{str(path)!r} is not a regular file; give the path of a recording "
            "(a .sqlite file written by `torchdoctor run`)"
        )


def _read_head(path: Path) -> bytes:
    """The first 100 bytes (SQLite's header), through :mod:`.file_head` (never blocking, and
    never releasing the locks of a writer in this process)."""
    try:
        return file_head.read_head(path, 100)
    except file_head.NotRegularFile:
        require_regular_file(path)  # says what it is now
        raise UserError(f"cannot read {str(path)!r}: not a regular file") from None
    except OSError as exc:
        raise UserError(f"cannot read {str(path)!r}: {exc.strerror}") from None


def _decoded_meta(path: Path, rows: list[sqlite3.Row]) -> dict[str, Any]:
    """The meta table decoded, each value the readers compute with checked for its type."""
    meta: dict[str, Any] = {}
    for key, value in rows:
        try:
            meta[key] = json.loads(value)
        except (TypeError, ValueError):
            raise damaged(path, f"meta {key!r} is not JSON ({str(value)[:40]!r})") from None
        wanted, got = _META_TYPES.get(key), meta[key]
        # JSON's true is a Python int too: no figure is a bool
        if wanted and got is not None and (not isinstance(got, wanted) or isinstance(got, bool)):
            raise damaged(path, f"meta {key!r} is {str(value)[:40]!r}")
        item = _META_ITEMS.get(key)
        if item and got is not None and not all(isinstance(v, item) for v in got):
            raise damaged(path, f"meta {key!r} is {str(value)[:40]!r}")
        # A time every reader prints as a date: the C library takes none past year 9999 (and
        # JSON's NaN is no time either)
        if key in _META_TIMES and got is not None and not 0 <= got < _LAST_TIME:
            raise damaged(path, f"meta {key!r} is {str(value)[:40]!r}, not a time")
    return meta


def open_recording(path: str | os.PathLike[str]) -> Recording:
    """Open a recording, checking that it is one and that this torchdoctor can read it.

    A damaged file opens with what could be read of it (see ``Recording.damage``); one whose
    tables or meta were edited raises NotARecordingError ("damaged or edited")."""
    p = Path(path)
    require_regular_file(p)
    head = _read_head(p)
    try:
        return _open(p, head)
    except DAMAGE_ERRORS as exc:
        # Met below SQLite's own checks: text that is not UTF-8 in the schema or the meta
        # table, a value salvage cannot copy.
        raise damaged(p, exc) from None


def _open(p: Path, head: bytes) -> Recording:
    """open_recording once the path is known to be a regular file starting with ``head``."""
    if not head:
        raise NotARecordingError(
            f"{str(p)!r} is empty: a recording that is just starting, or whose recorder stopped "
            "before writing anything; wait a second and try again"
        )
    if head[:16] != b"SQLite format 3\x00":
        raise NotARecordingError(
            f"{str(p)!r} is not a torchdoctor recording (not a SQLite file); "
            "recordings are written by `torchdoctor run`"
        )
    wal_beside = Path(f"{p}-wal").exists()
    reason = _truncated(p, head, wal_beside)
    if reason is None:
        try:
            db = _connect(p)
            app_id = db.execute("PRAGMA application_id").fetchone()[0]
            version = db.execute("PRAGMA user_version").fetchone()[0]
            tables = db.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()[0]
        except sqlite3.DatabaseError as exc:
            if not is_damage(exc):
                raise NotARecordingError(
                    f"{str(p)!r} cannot be read as a recording: {exc}"
                ) from None
            reason = str(exc)
    if reason is not None:
        return _salvaged(p, reason)
    if app_id != APPLICATION_ID:
        db.close()
        if app_id == 0 and tables == 0 and journal_is_wal(p):
            # Written before recordings kept their schema in the main file: all in the WAL.
            raise NotARecordingError(
                f"{str(p)!r} holds nothing yet: its data is still in {p.name}-wal; "
                f"{missing_wal_hint(p, DEFAULT_CHECKPOINT_S)}"
            )
        raise NotARecordingError(
            f"{str(p)!r} is a SQLite file but not a torchdoctor recording; "
            "recordings are written by `torchdoctor run`"
        )
    if version > SCHEMA_VERSION:
        db.close()
        raise NotARecordingError(
            f"{str(p)!r} comes from a newer torchdoctor (schema {version}; this one reads up to "
            f"{SCHEMA_VERSION}): upgrade with `pip install -U torchdoctor`"
        )
    try:
        _check_tables(p, db)
        return Recording(p, db, version, wal_beside=wal_beside)
    except sqlite3.DatabaseError as exc:
        db.close()
        if not is_damage(exc):
            raise damaged(p, exc) from None
        return _salvaged(p, str(exc))
    except UserError:
        db.close()
        raise


def _check_tables(p: Path, db: sqlite3.Connection) -> None:
    """Every table of the schema is there (a table dropped by hand fails every reader)."""
    names = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    missing = [t for t in ("meta", *TABLES) if t not in names]
    if len(missing) == len(TABLES) + 1:
        # The writer marks the file as a recording just before it creates the tables.
        raise NotARecordingError(
            f"{str(p)!r} holds no tables yet: a recording that is just starting, or whose "
            "recorder stopped before writing anything; wait a second and try again"
        )
    if missing:
        raise damaged(p, f"its table {missing[0]!r} is missing")


def _salvaged(p: Path, reason: str) -> Recording:
    wal_beside = Path(f"{p}-wal").exists()
    db, notes = salvage(p, reason)
    version = _header_int(p, 60)
    return Recording(p, db, version or SCHEMA_VERSION, damage=notes, wal_beside=wal_beside)


def _truncated(p: Path, head: bytes, wal_beside: bool) -> str | None:
    """Why the file is shorter than its header says (a copy cut short), or None.

    With a -wal beside it the pages past the end may be there: SQLite is left to judge."""
    if len(head) < 100 or wal_beside:
        return None if len(head) == 100 else "the file ends inside its header"
    page_size = int.from_bytes(head[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    pages = int.from_bytes(head[28:32], "big")
    # The in-header size is valid only when the change counter matches its copy.
    if pages == 0 or head[24:28] != head[92:96]:
        return None
    expected, actual = pages * page_size, p.stat().st_size
    if actual < expected:
        return f"the file holds {actual:,} of its {expected:,} bytes"
    return None


def _header_int(p: Path, offset: int) -> int | None:
    try:
        return int.from_bytes(file_head.read_head(p, 4, offset), "big")
    except OSError:
        return None


def _connect(p: Path) -> sqlite3.Connection:
    # A recording cut short still has its -wal file; a normal connection replays it. When the
    # folder is read-only that fails, and the immutable read-only mode reads the main file.
    try:
        db = sqlite3.connect(str(p))
        db.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
        return db
    except sqlite3.OperationalError:
        uri = f"file:{p.resolve()}?mode=ro&immutable=1"
        return sqlite3.connect(uri, uri=True)
