"""Reading a recording back: the documented Python API for tools and notebooks.

    >>> from torchdoctor import open_recording
    >>> rec = open_recording("torchdoctor-runs/20261130T101500Z-python.sqlite")
    >>> rec.meta["command"], rec.meta["exit_status"]
    >>> cpu = rec.rows("host_samples", columns=["t", "cpu_busy", "cpu_iowait"])
    >>> workers = [p for p in rec.processes() if p["role"] == "dataloader-worker"]

Tables: ``host_samples``, ``processes``, ``process_samples``, ``gpu_samples``,
``gpu_process_samples``, ``steps``, ``dataloaders``, ``settings``, ``events``. Columns are the
fields of the dataclasses in :mod:`torchdoctor.sampling.types` and
:mod:`torchdoctor.recording.records` (nested ``cpu`` split flattened as ``cpu_user``...);
JSON columns (``per_core``, ``unavailable``, ``cmdline``...) come back decoded; ``per_core``
holds one list per core: [user, nice, system, idle, iowait, irq, softirq, steal] in percent.
"""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path
from typing import Any

from torchdoctor.errors import NotARecordingError, UserError
from torchdoctor.recording.schema import (
    APPLICATION_ID,
    SCHEMA_VERSION,
    TABLES,
    from_row,
    quote,
    select_list,
    stored_columns,
)


class Recording:
    """A recording opened for reading. Use :func:`open_recording` to get one."""

    def __init__(self, path: Path, db: sqlite3.Connection, schema_version: int) -> None:
        self.path = path
        self.schema_version = schema_version
        self._db = db
        self._db.row_factory = sqlite3.Row
        self.meta: dict[str, Any] = {
            key: json.loads(value) for key, value in db.execute("SELECT key, value FROM meta")
        }
        self._stored: dict[str, set[str]] = {}

    # -- generic access ----------------------------------------------------------------
    def tables(self) -> list[str]:
        return list(TABLES)

    def columns(self, table: str) -> list[str]:
        return TABLES[self._check(table)].column_names

    def count(self, table: str) -> int:
        return self._db.execute(f"SELECT COUNT(*) FROM {self._check(table)}").fetchone()[0]

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
        return [from_row(spec, dict(r)) for r in self._db.execute(sql, params)]

    def iter_rows(self, table: str):
        """Stream every row of ``table`` (for exports of long recordings)."""
        spec = TABLES[self._check(table)]
        cols = self._select_list(table, spec.column_names)
        order = _default_order(table)
        sql = f"SELECT {cols} FROM {table}" + (f" ORDER BY {order}" if order else "")
        for r in self._db.execute(sql):
            yield from_row(spec, dict(r))

    def query(self, sql: str, params: tuple | list = ()) -> list[dict[str, Any]]:
        """Run a read-only SQL query (for aggregates the helpers above do not cover)."""
        if not sql.lstrip().upper().startswith(("SELECT", "WITH")):
            raise UserError("Recording.query runs SELECT statements only")
        return [dict(r) for r in self._db.execute(sql, params)]

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
        return self.rows("steps")

    @property
    def started_at(self) -> float | None:
        return self.meta.get("started_at")

    @property
    def ended_at(self) -> float | None:
        """End of the run; for a recording cut short, the last sample's time."""
        end = self.meta.get("ended_at")
        if end is None:
            row = self._db.execute("SELECT MAX(t) FROM host_samples").fetchone()
            end = row[0] if row else None
        return end

    @property
    def complete(self) -> bool:
        """False when the recorder stopped before it could write the end of the run."""
        return "ended_at" in self.meta

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Recording:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _select_list(self, table: str, columns: list[str]) -> str:
        stored = self._stored.get(table)
        if stored is None:
            stored = self._stored[table] = stored_columns(self._db, table)
        return select_list(columns, stored)

    def _check(self, table: str) -> str:
        if table not in TABLES:
            raise UserError(f"unknown table {table!r}; tables are: {', '.join(TABLES)}")
        return table


def _default_order(table: str) -> str | None:
    return {
        "steps": "t_end",
        "processes": "rowid",
        "dataloaders": "t",
    }.get(table, "t")


def open_recording(path: str | os.PathLike[str]) -> Recording:
    """Open a recording, checking that it is one and that this torchdoctor can read it."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"no such file: {str(p)!r}")
    if p.is_dir():
        raise UserError(f"{str(p)!r} is a folder, not a recording (.sqlite file)")
    with open(p, "rb") as fh:
        head = fh.read(16)
    if head != b"SQLite format 3\x00":
        raise NotARecordingError(
            f"{str(p)!r} is not a torchdoctor recording (not a SQLite file); "
            "recordings are written by `torchdoctor run`"
        )
    try:
        db = _connect(p)
        app_id = db.execute("PRAGMA application_id").fetchone()[0]
        version = db.execute("PRAGMA user_version").fetchone()[0]
    except sqlite3.DatabaseError as exc:
        raise NotARecordingError(f"{str(p)!r} cannot be read as a recording: {exc}") from None
    if app_id != APPLICATION_ID:
        db.close()
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
    return Recording(p, db, version)


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
