"""Reading what is left of a damaged recording: a file cut short by a copy, a full disk, a crash.

Every table is read in rowid order; where a page cannot be read, the rows after the damage
are looked for further on (rowids double from the last good one), so one bad page costs only
the rows it held, not the rest of the table. What was read goes into a temporary database
with the recording's own layout, which every reader (show, diagnose, report, export) then
uses unchanged; the notes say, per table, what was lost.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

from torchdoctor.errors import NotARecordingError
from torchdoctor.recording.compaction import (
    STEP_SUMMARIES,
    STEP_SUMMARIES_SQL,
    STEP_SUMMARY_COLUMNS,
)
from torchdoctor.recording.schema import META_SQL, TABLES, quote, stored_columns
from torchdoctor.units import fmt_duration

_BATCH = 5000
_PROBES = 48  # rowid jumps tried past damage: up to 2**47 rows further on
# SQLite's primary result codes that mean "this file is damaged" (not "busy", not "no table").
DAMAGE_CODES = (10, 11, 26)  # SQLITE_IOERR, SQLITE_CORRUPT, SQLITE_NOTADB


def is_damage(exc: BaseException) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return (code & 0xFF) in DAMAGE_CODES
    text = str(exc)
    return "malformed" in text or "not a database" in text or "disk I/O" in text


def salvage(path: Path, reason: str) -> tuple[sqlite3.Connection, list[str]]:
    """A temporary database holding every row of ``path`` that can be read, and the notes."""
    src = _open_source(path)
    dst = sqlite3.connect("", check_same_thread=False)  # a private temporary file
    dst.execute(META_SQL)
    for table in TABLES.values():
        for stmt in table.create_sql():
            dst.execute(stmt)
    notes = [f"recording damaged ({reason}): what follows is what could be read"]
    try:
        meta_rows, meta_gaps = _copy(src, dst, "meta", ["key", "value"])
    except sqlite3.Error:
        meta_rows, meta_gaps = 0, []
    if meta_rows == 0:
        src.close()
        dst.close()
        raise NotARecordingError(
            f"{str(path)!r} is too damaged to read ({reason}): not even its metadata is left; "
            "copy it again from the machine that recorded it"
        )
    if meta_gaps:
        notes.append("part of the run's metadata is lost")
    for name, spec in TABLES.items():
        try:
            copied, gaps = _copy(src, dst, name, spec.column_names)
        except sqlite3.Error as exc:
            notes.append(f"{name}: unreadable, every row lost ({exc})")
            continue
        if gaps and copied == 0:
            notes.append(f"{name}: nothing could be read")
        elif gaps:
            notes.append(f"{name}: {copied:,} rows read; {_describe_gaps(dst, name, gaps)}")
    notes += _copy_step_summaries(src, dst)
    coverage = _coverage(dst)
    if coverage:
        notes.insert(1, coverage)
    dst.commit()
    src.close()
    return dst, notes


def _copy_step_summaries(src: sqlite3.Connection, dst: sqlite3.Connection) -> list[str]:
    """The step summaries of a recording whose steps were folded (recording.compaction):
    without them the step figures would count only the step rows kept. Notes of what was lost."""
    if not stored_columns(src, STEP_SUMMARIES):
        return []  # never folded a step (or the table's schema is lost with it)
    dst.execute(STEP_SUMMARIES_SQL)
    try:
        copied, gaps = _copy(src, dst, STEP_SUMMARIES, [n for n, _ in STEP_SUMMARY_COLUMNS])
    except sqlite3.Error as exc:
        return [f"{STEP_SUMMARIES}: unreadable, the folded steps are not counted ({exc})"]
    if gaps:
        return [
            f"{STEP_SUMMARIES}: {copied:,} rows read, some lost: fewer steps counted than taken"
        ]
    return []


def _open_source(path: Path) -> sqlite3.Connection:
    # immutable: read the bytes as they are, no locks, no WAL replay that could fail halfway.
    uri = f"file:{path.resolve()}?mode=ro&immutable=1"
    db = sqlite3.connect(uri, uri=True, check_same_thread=False)
    # A file shorter than its header says is refused as corrupt, unless the schema is
    # "writable": then SQLite takes the pages that are there (nothing is written: read-only).
    db.execute("PRAGMA writable_schema=ON")
    return db


def _copy(
    src: sqlite3.Connection, dst: sqlite3.Connection, table: str, columns: list[str]
) -> tuple[int, list[tuple[int, int | None]]]:
    """Copy readable rows, keeping rowids; the gaps as (last good rowid, next readable or None)."""
    # A recording from before a column was added lacks it: it stays NULL in the copy.
    stored = stored_columns(src, table)
    if not stored:
        raise sqlite3.DatabaseError("the table is missing from what is left of the schema")
    columns = [c for c in columns if c in stored]
    # The column every real row fills: its time, or the meta table's key.
    key = 1 + columns.index("t" if "t" in columns else columns[0])
    cols = ", ".join(quote(c) for c in columns)
    insert = f"INSERT INTO {table} (rowid, {cols}) VALUES (?, {', '.join('?' for _ in columns)})"
    copied = 0
    last = 0
    stuck_at = -1  # where the last resume started: failing there again means no progress
    gaps: list[tuple[int, int | None]] = []
    while True:
        batch: list[tuple] = []
        try:
            cursor = src.execute(
                f"SELECT rowid, {cols} FROM {table} WHERE rowid > ? ORDER BY rowid", (last,)
            )
            for row in cursor:
                last = row[0]
                if row[key] is None:
                    # A page cut mid-way reads as zeros: cells whose every field is NULL.
                    continue
                batch.append(row)
                if len(batch) >= _BATCH:
                    dst.executemany(insert, batch)
                    copied += len(batch)
                    batch.clear()
            dst.executemany(insert, batch)
            copied += len(batch)
            return copied, gaps
        except sqlite3.DatabaseError as exc:
            if not is_damage(exc):
                raise
            dst.executemany(insert, batch)
            copied += len(batch)
            if copied == 0 and last == 0 and _root_unreadable(src, table):
                raise
            if stuck_at == last and gaps:
                # Found readable, yet reading its row fails (an overflow page is lost): skip
                # it, as part of the same gap.
                resume = _next_readable(src, table, last + 1)
                gaps[-1] = (gaps[-1][0], resume)
            else:
                resume = _next_readable(src, table, last)
                gaps.append((last, resume))
            if resume is None:
                return copied, gaps
            stuck_at = last = resume - 1


def _root_unreadable(src: sqlite3.Connection, table: str) -> bool:
    try:
        src.execute(f"SELECT rowid FROM {table} LIMIT 0").fetchall()
        return False
    except sqlite3.DatabaseError:
        return True


def _next_readable(src: sqlite3.Connection, table: str, last: int) -> int | None:
    for k in range(_PROBES):
        try:
            row = src.execute(
                f"SELECT rowid FROM {table} WHERE rowid >= ? ORDER BY rowid LIMIT 1",
                (last + (1 << k),),
            ).fetchone()
        except sqlite3.DatabaseError:
            continue
        if row is None:
            # Readable up to the end from here: rows of the damaged part may lie between.
            return None
        return row[0]
    return None


def _describe_gaps(dst: sqlite3.Connection, table: str, gaps: list[tuple[int, int | None]]) -> str:
    has_t = "t" in TABLES[table].column_names
    parts = []
    for last, resume in gaps:
        if last == 0 and resume is None:
            parts.append("none could be read")
        elif not has_t:
            parts.append("the rest lost" if resume is None else "some rows in between lost")
        elif resume is None:
            parts.append(f"the rows after {_clock(_t_at(dst, table, last))} lost")
        else:
            start, end = _clock(_t_at(dst, table, last)), _clock(_t_at(dst, table, resume))
            parts.append(f"rows between {start} and {end} lost")
    return "; ".join(parts)


def _coverage(dst: sqlite3.Connection) -> str | None:
    """How much of the run the samples read span."""
    first, last = dst.execute("SELECT MIN(t), MAX(t) FROM host_samples").fetchone()
    meta = dict(dst.execute("SELECT key, value FROM meta WHERE key IN ('started_at', 'ended_at')"))
    try:
        started = float(meta["started_at"])
    except (KeyError, ValueError):
        return None
    run = (
        f" of the run's {fmt_duration(float(meta['ended_at']) - started)}"
        if "ended_at" in meta
        else ""
    )
    if first is None:
        return f"no host sample could be read{run}"
    return f"the samples read span {fmt_duration(last - started)}{run} (up to {_clock(last)})"


def _t_at(dst: sqlite3.Connection, table: str, rowid: int) -> float | None:
    row = dst.execute(f"SELECT t FROM {table} WHERE rowid = ?", (rowid,)).fetchone()
    return row[0] if row else None


def _clock(t: float | None) -> str:
    return "?" if t is None else time.strftime("%H:%M:%S UTC", time.gmtime(t))
