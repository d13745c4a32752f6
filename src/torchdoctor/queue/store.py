"""The queue's state: one SQLite file in WAL mode, written in short immediate transactions.

Every process of the queue writes here: the client (a submitted job), the scheduler (where a
job goes), each job's supervisor (that it runs, how it ended). A scheduler killed at any moment
therefore loses nothing, and the next one finds everything where it was left.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torchdoctor.errors import UserError
from torchdoctor.queue.model import DONE, TERMINAL, Job

APPLICATION_ID = 0x54445155  # "TDQU": tells a queue state file from any other SQLite file
SCHEMA_VERSION = 1
_JSON_FIELDS = {"argv", "env", "after", "gpu_ids", "assigned_gpus", "assigned_cpus"}
_FIELDS = [f.name for f in dataclasses.fields(Job)]


def _column(f: dataclasses.Field) -> str:
    if f.name == "id":
        return "id INTEGER PRIMARY KEY AUTOINCREMENT"
    base = f.type.split(" | ")[0] if isinstance(f.type, str) else "str"
    kind = {"int": "INTEGER", "float": "REAL", "bool": "INTEGER"}.get(base, "TEXT")
    return f"{f.name} {kind}"


_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS jobs ("
    + ", ".join(_column(f) for f in dataclasses.fields(Job))
    + ")",
    "CREATE INDEX IF NOT EXISTS jobs_state ON jobs(state)",
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT)",
)


class CorruptStateError(UserError):
    """The state file cannot be read as a queue state; it is left as it is."""


class _Busy(Exception):
    """Opening the state file met another process's lock (the cause); to be tried again."""


OPEN_BUSY_S = 30.0  # as long as a statement waits on a lock (busy_timeout)


def _is_lock(exc: sqlite3.DatabaseError) -> bool:
    """Whether ``exc`` is another connection's lock (SQLITE_BUSY / SQLITE_LOCKED), not damage."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
    return "locked" in str(exc) or "busy" in str(exc)


class QueueStore:
    """The state file; one connection per process (and per thread that uses it)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        deadline = time.monotonic() + OPEN_BUSY_S
        while True:
            try:
                self._open()
                return
            except _Busy as exc:
                # SQLite answers "locked" at once, without its busy handler, where waiting
                # could deadlock: the switch to WAL, a WAL being recovered, a read upgraded to
                # a write. Another process is opening or writing the queue; a lock is never a
                # damaged file (CI: 1 of 8 submitters started at once was told to discard it).
                if time.monotonic() > deadline:
                    raise UserError(
                        f"the queue state file {self.path} stayed locked for {OPEN_BUSY_S:g} s "
                        f"({exc.__cause__}): another torchdoctor is writing it; try again"
                    ) from None
                time.sleep(0.05)

    def _open(self) -> None:
        fresh = not self.path.exists()
        try:
            self._db = sqlite3.connect(str(self.path), timeout=30.0, isolation_level=None)
            self._db.row_factory = sqlite3.Row
            self._db.execute("PRAGMA busy_timeout=30000")
            app = self._db.execute("PRAGMA application_id").fetchone()[0]
            if not fresh and app != APPLICATION_ID:
                has_tables = self._db.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
                # Another process may have committed the schema between the two reads (8
                # submitters starting the queue at once): its tables and its application id
                # commit together, so once the tables show, the id shows too.
                app = self._db.execute("PRAGMA application_id").fetchone()[0]
                if app != APPLICATION_ID and (app != 0 or has_tables):
                    raise sqlite3.DatabaseError("not a torchdoctor queue state file")
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            with self.transaction():
                for statement in _SCHEMA:
                    self._db.execute(statement)
                _add_missing_columns(self._db)
                self._db.execute(f"PRAGMA application_id={APPLICATION_ID}")
                self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            self._db.execute("SELECT count(*) FROM jobs").fetchone()
        except sqlite3.DatabaseError as exc:
            with contextlib.suppress(Exception):
                self._db.close()
            if _is_lock(exc):
                raise _Busy from exc
            raise CorruptStateError(
                f"the queue state file {self.path} is unreadable ({exc}); it is kept as it is: "
                "move it away yourself, or run `torchdoctor queue recover` to keep it aside and "
                "start an empty queue"
            ) from None

    def close(self) -> None:
        self._db.close()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """An immediate transaction: the write lock is taken at the start, so a
        read-decide-write sequence inside it cannot interleave with another process's."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    # -- jobs -------------------------------------------------------------------------------

    def add(self, job: Job) -> int:
        values = _to_row(job)
        values.pop("id")
        names = ", ".join(values)
        marks = ", ".join("?" for _ in values)
        with self.transaction() as db:
            cursor = db.execute(
                f"INSERT INTO jobs ({names}) VALUES ({marks})", list(values.values())
            )
        return int(cursor.lastrowid)

    def get(self, job_id: int) -> Job | None:
        row = self._db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return _from_row(row) if row is not None else None

    def jobs(self, states: tuple[str, ...] | None = None) -> list[Job]:
        if states is None:
            rows = self._db.execute("SELECT * FROM jobs ORDER BY id").fetchall()
        else:
            marks = ", ".join("?" for _ in states)
            rows = self._db.execute(
                f"SELECT * FROM jobs WHERE state IN ({marks}) ORDER BY id", states
            ).fetchall()
        return [_from_row(r) for r in rows]

    def update(
        self,
        job_id: int,
        *,
        only_if: tuple[str, ...] | None = None,
        unclaimed: bool = False,
        **changes: Any,
    ) -> bool:
        """Change fields of a job; with ``only_if``, only while it is in one of those states;
        with ``unclaimed``, only while no supervisor has taken it. Whether it changed."""
        row = _to_row_partial(changes)
        sets = ", ".join(f"{k} = ?" for k in row)
        sql = f"UPDATE jobs SET {sets} WHERE id = ?"
        params = [*row.values(), job_id]
        if only_if is not None:
            sql += f" AND state IN ({', '.join('?' for _ in only_if)})"
            params += list(only_if)
        if unclaimed:
            sql += " AND supervisor_pid IS NULL"
        with self.transaction() as db:
            return db.execute(sql, params).rowcount == 1

    def delete(self, job_ids: list[int]) -> int:
        """Remove ended jobs from the state; how many went."""
        if not job_ids:
            return 0
        marks = ", ".join("?" for _ in job_ids)
        states = ", ".join("?" for _ in TERMINAL)
        with self.transaction() as db:
            return db.execute(
                f"DELETE FROM jobs WHERE id IN ({marks}) AND state IN ({states})",
                [*job_ids, *TERMINAL],
            ).rowcount

    def last_starts(self) -> dict[int | None, float]:
        """uid -> when that user's last job started (what round-robin between users reads)."""
        rows = self._db.execute(
            "SELECT uid, max(started_at) FROM jobs WHERE started_at IS NOT NULL GROUP BY uid"
        ).fetchall()
        return {row[0]: row[1] for row in rows}

    def last_finished(self, argv: list[str], uid: int | None = None) -> Job | None:
        """The most recent job of exactly this command that ran to a successful end (of this
        user's, with ``uid``: on a machine-wide queue no one is sized from another's runs)."""
        sql = "SELECT * FROM jobs WHERE argv = ? AND state = ?"
        params: list[Any] = [json.dumps(argv), DONE]
        if uid is not None:
            sql += " AND uid = ?"
            params.append(uid)
        row = self._db.execute(sql + " ORDER BY ended_at DESC, id DESC LIMIT 1", params).fetchone()
        return _from_row(row) if row is not None else None

    # -- queue-wide settings ----------------------------------------------------------------

    def meta(self, key: str, default: str | None = None) -> str | None:
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row is not None else default

    def set_meta(self, **values: str | None) -> None:
        with self.transaction() as db:
            for key, value in values.items():
                if value is None:
                    db.execute("DELETE FROM meta WHERE key = ?", (key,))
                else:
                    db.execute(
                        "INSERT INTO meta (key, value) VALUES (?, ?)"
                        " ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                        (key, value),
                    )


def _add_missing_columns(db: sqlite3.Connection) -> None:
    """A state file written by an older torchdoctor gets the job fields added since (NULL)."""
    have = {row[1] for row in db.execute("PRAGMA table_info(jobs)")}
    for f in dataclasses.fields(Job):
        if f.name not in have:
            db.execute(f"ALTER TABLE jobs ADD COLUMN {_column(f)}")


def end_fields(state: str, reason: str | None, exit_status: int | None) -> dict[str, Any]:
    """The fields every ending writes."""
    assert state in TERMINAL
    return {"state": state, "reason": reason, "exit_status": exit_status, "ended_at": time.time()}


def _to_row(job: Job) -> dict[str, Any]:
    return _to_row_partial(dataclasses.asdict(job))


def _to_row_partial(values: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in values.items():
        if key not in _FIELDS:
            raise KeyError(f"no job field {key}")
        if key in _JSON_FIELDS and value is not None:
            value = json.dumps(value)
        elif isinstance(value, bool):
            value = int(value)
        elif isinstance(value, str):
            value = _storable(value)
        out[key] = value
    return out


def _storable(text: str) -> str | bytes:
    """``text`` as SQLite can hold it. A path or command of non-UTF-8 bytes (a legal Linux
    name: Python hands it over with surrogate escapes) cannot be a TEXT value, whose UTF-8
    encoding fails: it is stored as its original bytes (a BLOB), which _from_row turns back
    into the same str. JSON fields need nothing: json.dumps writes a surrogate as \\udcXX."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogateescape")
    return text


def _from_row(row: sqlite3.Row) -> Job:
    values = {}
    for key, value in zip(row.keys(), tuple(row), strict=True):
        if key in _JSON_FIELDS and value is not None:
            value = json.loads(value)
        elif key in ("cancel_requested", "held"):
            value = bool(value) if value is not None else False
        elif isinstance(value, bytes):  # a text field of non-UTF-8 bytes (_storable)
            value = value.decode("utf-8", "surrogateescape")
        values[key] = value
    return Job(**values)
