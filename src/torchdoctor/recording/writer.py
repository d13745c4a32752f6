"""Writes one recording: a SQLite file in WAL mode, filled in batches.

Durability contract: everything handed to the writer is committed at the latest
``flush_every_s`` after it arrived (default 1 s, checked on every call and by the recorder's
loop), so a recorder killed with SIGKILL leaves a file that opens and holds all data older
than that. WAL with ``synchronous=NORMAL`` loses no committed transaction when a process dies;
only power loss could cost the last commits, which is an acceptable trade for a monitor.

Copies: committed data sits in ``NAME.sqlite-wal`` until a checkpoint folds it into the main
file, and people copy the .sqlite alone (``cp``, ``scp``) to look at a running job. The schema
and metadata are written before WAL mode is switched on, and the WAL is checkpointed every
``checkpoint_every_s`` (10 s), so the main file alone is a recording at most that old.

A full disk (or any other write failure) stops the recording, never the job: one line says
so, later data is dropped, and what was committed stays readable.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import sqlite3
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from torchdoctor.errors import UserError
from torchdoctor.recording import file_head
from torchdoctor.recording.compaction import META_POLICY, CompactionPolicy, compact
from torchdoctor.recording.paths import claim_recording_file
from torchdoctor.recording.records import (
    DataLoaderRecord,
    JobEvent,
    ProfileSyncSite,
    ProfileWindow,
    SettingRecord,
    StepRecord,
)
from torchdoctor.recording.schema import (
    APPLICATION_ID,
    META_SQL,
    PROFILE_TABLES_SQL,
    SCHEMA_VERSION,
    TABLES,
    to_row,
)
from torchdoctor.recording.state import writer_identity
from torchdoctor.recording.totals import (
    PROCESS_COLUMNS,
    STEP_COLUMNS,
    TOTALS_KEY,
    RunningTotals,
)
from torchdoctor.sampling.types import Snapshot
from torchdoctor.units import fmt_bytes

CHECKPOINT_EVERY_S = 10.0
CACHE_KIB = 1024
PAGE_SIZE = 8192
_SQLITE_FULL = 13
# Recordings whose writer in this process stopped (a full disk): their file could not say so.
STOPPED_HERE: set[str] = set()


def _positions(table: str, columns: list[str]) -> tuple[int, ...]:
    names = TABLES[table].column_names
    return tuple(names.index(c) for c in columns)


# Where the running totals' columns lie in the rows the writer inserts.
_PROCESS_PICK = _positions("process_samples", PROCESS_COLUMNS)
_STEP_PICK = _positions("steps", STEP_COLUMNS)
(_EVENT_KIND,) = _positions("events", ["kind"])


class RecordingWriter:
    """Buffers records and commits them in batches; safe to call from several threads.

    ``path`` is a new file, or the empty file :func:`~torchdoctor.recording.paths.
    create_recording_file` made for this recording; never one that holds data.
    ``on_stop`` receives the one line said when writing fails (default: printed on stderr).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        meta: dict[str, Any],
        *,
        flush_every_s: float = 1.0,
        checkpoint_every_s: float = CHECKPOINT_EVERY_S,
        on_stop: Callable[[str], None] | None = None,
        compaction: CompactionPolicy | None = None,
    ) -> None:
        self.path = Path(path)
        # None keeps every sample (--keep full); else older samples are folded as written.
        self.compaction = compaction
        self._latest_t: float | None = None  # the newest sample time handed over
        self._compact_at: float | None = None  # the sample time of the next folding pass
        self.flush_every_s = flush_every_s
        self.checkpoint_every_s = checkpoint_every_s
        self.stopped: str | None = None  # why writing stopped (the line that was said)
        self._on_stop = on_stop or _print_stderr
        self._lock = threading.Lock()
        self._pending: dict[str, list[tuple]] = {name: [] for name in TABLES}
        self._last_flush = self._last_checkpoint = time.monotonic()
        self._closed = False
        self.rows_written: dict[str, int] = {name: 0 for name in TABLES}
        # The counters' sums so far, committed with the rows (see recording.totals).
        self._totals = RunningTotals()
        self._windows = 0  # profiler windows written (their ids are 1, 2, ...)
        if not self.path.exists():
            claim_recording_file(self.path, option="another path")
        elif self.path.is_dir() or self.path.stat().st_size > 0:
            raise UserError(
                f"{str(self.path)!r} already exists; choose a new name for the recording"
            )
        try:
            self._db = sqlite3.connect(
                str(self.path), check_same_thread=False, isolation_level=None
            )
            # Schema and metadata go straight into the main file (rollback journal), so a copy
            # of it taken at any time after this is a recording; then WAL for the samples.
            # 8 KiB pages: the whole schema (3.9 KB of SQL) fits in page 1, so a copy cut short
            # anywhere still says which tables it holds; with 4 KiB it spills onto pages
            # written after the tables' first pages, and a short copy loses it all.
            self._db.execute(f"PRAGMA page_size={PAGE_SIZE}")
            self._db.execute(f"PRAGMA application_id={APPLICATION_ID}")
            self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            self._db.execute("BEGIN")
            self._db.execute(META_SQL)
            for table in TABLES.values():
                for stmt in table.create_sql():
                    self._db.execute(stmt)
            for stmt in PROFILE_TABLES_SQL:
                self._db.execute(stmt)
            self._set_meta_locked(
                {
                    "schema_version": SCHEMA_VERSION,
                    "writer": writer_identity(),
                    "checkpoint_every_s": checkpoint_every_s,
                    **({META_POLICY: compaction.to_meta()} if compaction is not None else {}),
                    **meta,
                }
            )
            self._started_at = _number(meta.get("started_at"))
            self._db.execute("COMMIT")
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            # Appends touch the last pages of each table and index: 1 MiB of page cache is
            # plenty, and it is the bound of the writer's memory however long the run.
            self._db.execute(f"PRAGMA cache_size=-{CACHE_KIB}")
            # A read opens NAME.sqlite-wal now: from here on, a file without one is a copy.
            self._db.execute("SELECT COUNT(*) FROM meta").fetchone()
        except sqlite3.Error as exc:
            with contextlib.suppress(OSError, sqlite3.Error, AttributeError):
                self._db.close()
            with contextlib.suppress(OSError):
                if self.path.stat().st_size == 0:
                    self.path.unlink()  # the file this recording claimed, never written
            raise UserError(f"cannot create the recording {str(self.path)!r}: {exc}") from None
        # This process's own reads of the file's header share one descriptor from here on:
        # closing another would release the connection's locks (recording.file_head).
        self._held = file_head.hold(self.path)

    # -- adding data -------------------------------------------------------------------
    def write_snapshot(self, snap: Snapshot) -> None:
        with self._lock:
            if self.stopped:
                return
            if snap.host is not None:
                self._pending["host_samples"].append(to_row(TABLES["host_samples"], snap.host))
            if isinstance(snap.t, int | float):
                self._latest_t = snap.t
            for rows, table in (
                (snap.new_processes, "processes"),
                (snap.processes, "process_samples"),
                (snap.gpus, "gpu_samples"),
                (snap.gpu_processes, "gpu_process_samples"),
            ):
                self._queue_locked(table, rows)
        self.maybe_flush()

    def add_steps(self, records: Iterable[StepRecord]) -> None:
        self._add("steps", records)

    def add_dataloaders(self, records: Iterable[DataLoaderRecord]) -> None:
        self._add("dataloaders", records)

    def add_settings(self, records: Iterable[SettingRecord]) -> None:
        self._add("settings", records)

    def add_events(self, records: Iterable[JobEvent]) -> None:
        self._add("events", records)

    def add_profile_window(self, window: ProfileWindow, sites: Iterable[ProfileSyncSite]) -> int:
        """Write a profiler window and its sync sites now (one transaction: they are few, and
        whoever reads the trace next wants the row there); the window's id (``window.id`` and
        the sites' ``window_id`` are set to it). 0 when the recording has stopped."""
        with self._lock:
            if self._closed or self.stopped:
                return 0
            self._windows += 1
            window.id = self._windows
            rows = []
            for site in sites:
                site.window_id = window.id
                rows.append(
                    (site.window_id, site.op, site.file, site.line, site.function)
                    + (site.count, site.total_s)
                )

            def write() -> None:
                # What came before the window's end (its steps) is committed with it: a
                # reader never sees a window whose steps are not there yet.
                self._insert_pending_locked()
                self._db.execute(
                    "INSERT INTO profile_windows (id, rank, pid, first_step, last_step, "
                    "warmup_step, started_at, ended_at, trace_path, trace_bytes, state, reason) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    dataclasses.astuple(window),
                )
                self._db.executemany(
                    "INSERT INTO profile_sync_sites (window_id, op, file, line, function, "
                    "count, total_s) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    rows,
                )

            self._write_locked(write)
            for pending in self._pending.values():
                pending.clear()
            return 0 if self.stopped else window.id

    def write_in_transaction(self, work: Callable[[sqlite3.Connection], None]) -> bool:
        """Run ``work(connection)`` in one transaction of this writer (its lock held): for
        tables written once per event, such as a profiler trace's (recording/profiles.py).
        False when the recording has stopped or the work failed (said once, as any write)."""
        with self._lock:
            if self._closed or self.stopped:
                return False
            try:
                self._write_locked(lambda: work(self._db))
            except Exception:
                # Not SQLite's (those stop the recording in _write_locked): the work's own
                # bug. Its rows go, the recording goes on.
                with contextlib.suppress(sqlite3.Error):
                    self._db.execute("ROLLBACK")
                raise
            return not self.stopped

    def set_meta(self, values: dict[str, Any]) -> None:
        with self._lock:
            if self._closed or self.stopped:
                return
            self._write_locked(lambda: self._set_meta_locked(values))

    def _add(self, table: str, records: Iterable[Any]) -> None:
        with self._lock:
            if self.stopped:
                return
            self._queue_locked(table, records)
        self.maybe_flush()

    def _queue_locked(self, table: str, records: Iterable[Any]) -> None:
        spec = TABLES[table]
        self._pending[table].extend(to_row(spec, r) for r in records)

    def _set_meta_locked(self, values: dict[str, Any]) -> None:
        self._db.executemany(
            "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
            [(k, json.dumps(v, default=_json_default)) for k, v in values.items()],
        )

    # -- committing --------------------------------------------------------------------
    def maybe_flush(self) -> None:
        if time.monotonic() - self._last_flush >= self.flush_every_s:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            if self._closed or self.stopped:
                return
            self._last_flush = time.monotonic()
            if any(self._pending.values()):
                self._write_locked(self._insert_pending_locked)
                for rows in self._pending.values():
                    rows.clear()
                self._maybe_compact_locked()
            if (
                not self.stopped
                and self._last_flush - self._last_checkpoint >= self.checkpoint_every_s
            ):
                self._last_checkpoint = self._last_flush
                try:
                    # PASSIVE: copies what no reader needs, never waits for one.
                    self._db.execute("PRAGMA wal_checkpoint(PASSIVE)")
                except sqlite3.Error as exc:
                    self._stop_locked(exc)

    def _maybe_compact_locked(self) -> None:
        """Fold the samples that left the recent window, at most once per bucket of sample
        time, in a transaction of its own (recording.compaction: a copy taken at any moment
        holds the rows before the pass or after it, never half)."""
        policy, latest, started = self.compaction, self._latest_t, self._started_at
        if policy is None or latest is None or started is None or self.stopped:
            return
        if self._compact_at is not None and latest < self._compact_at:
            return
        self._compact_at = latest + policy.bucket_s
        try:
            self._write_locked(lambda: compact(self._db, policy, started, latest))
        except Exception as exc:  # noqa: BLE001 - a folding bug must not stop the recording
            with contextlib.suppress(sqlite3.Error):
                self._db.execute("ROLLBACK")
            self.compaction = None  # every later sample is kept: more bytes, nothing lost
            self._on_stop(
                f"torchdoctor: stopped folding older samples ({type(exc).__name__}: {exc});"
                " the recording keeps every sample from here on"
            )

    def _insert_pending_locked(self) -> None:
        for name, rows in self._pending.items():
            if rows:
                self._db.executemany(TABLES[name].insert_sql(), rows)
                self.rows_written[name] += len(rows)
        self._add_to_totals_locked()

    def _add_to_totals_locked(self) -> None:
        """Bring the running totals up to the rows of this transaction and save them in it:
        a reader that starts late takes them and reads only the rows after them."""
        pending = self._pending
        totals = self._totals
        processes = pending["process_samples"]
        if processes:
            pick = _PROCESS_PICK
            rows = [tuple(r[i] for i in pick) for r in processes]
            totals.add_process_rows(rows)
            t = rows[-1][0]
            totals.forget_except({(r[1], r[2]) for r in rows if r[0] == t})
        if pending["steps"]:
            pick = _STEP_PICK
            totals.add_steps([tuple(r[i] for i in pick) for r in pending["steps"]])
        if pending["events"]:
            totals.add_events([r[_EVENT_KIND] for r in pending["events"]])
        if processes or pending["steps"] or pending["events"]:
            # Rowids of a table only appended to follow each other from 1.
            totals.through = {t: self.rows_written[t] for t in totals.through}
            self._set_meta_locked({TOTALS_KEY: totals.to_json()})

    def _write_locked(self, work: Callable[[], None]) -> None:
        """One transaction; a failure stops the recording (said once), never raises."""
        try:
            self._db.execute("BEGIN")
            work()
            self._db.execute("COMMIT")
        except sqlite3.Error as exc:
            with contextlib.suppress(sqlite3.Error):
                self._db.execute("ROLLBACK")
            self._stop_locked(exc)

    def _stop_locked(self, exc: sqlite3.Error) -> None:
        for rows in self._pending.values():
            rows.clear()
        if self.stopped:
            return
        self.stopped = self._stop_message(exc)
        STOPPED_HERE.add(str(self.path.resolve()))
        self._on_stop(self.stopped)

    def _stop_message(self, exc: sqlite3.Error) -> str:
        folder = self.path.parent if str(self.path.parent) else Path(".")
        if getattr(exc, "sqlite_errorcode", None) == _SQLITE_FULL or "full" in str(exc):
            try:
                free = fmt_bytes(shutil.disk_usage(folder).free)
            except OSError:
                free = "unknown"
            return (
                f"torchdoctor: recording stopped: no space left on {folder} (free {free}); "
                "the job keeps running; free space or pass --out elsewhere"
            )
        return (
            f"torchdoctor: recording stopped: cannot write {self.path} ({exc}); the job keeps "
            "running and the recording keeps what was written"
        )

    def close(self, final_meta: dict[str, Any] | None = None) -> None:
        """Commit everything, write the end metadata and leave one self-contained file."""
        self.flush()
        with self._lock:
            if self._closed:
                return
            if not self.stopped:
                end = {"closed_at": time.time(), **(final_meta or {})}
                self._write_locked(lambda: self._set_meta_locked(end))
            self._closed = True
            try:
                # Fold the WAL back so the recording is one file that can be copied alone.
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                self._db.execute("PRAGMA journal_mode=DELETE")
            except sqlite3.Error:
                pass  # another reader holds the WAL open, or no space: the data is committed
            with contextlib.suppress(sqlite3.Error):
                self._db.close()
            file_head.release(self._held)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _print_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _json_default(value: Any) -> Any:
    import dataclasses

    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if isinstance(value, Path):
        return str(value)
    return str(value)
