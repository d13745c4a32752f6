"""The SQLite layout of a recording, derived from the plain dataclasses that fill it.

One table per record type; a column per dataclass field. Nested dataclasses (``CpuSplit``)
are flattened with their field name as prefix (``cpu_user``); lists and dicts are JSON text.
Deriving the columns keeps the readers, the recording and the exporters from drifting apart.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass
from typing import Any

from torchdoctor.recording.records import DataLoaderRecord, JobEvent, SettingRecord, StepRecord
from torchdoctor.sampling.types import (
    CpuSplit,
    GpuProcessSample,
    GpuSample,
    HostSample,
    ProcessInfo,
    ProcessSample,
)

SCHEMA_VERSION = 1
# PRAGMA application_id: tells a torchdoctor recording from any other SQLite file ("TDoc").
APPLICATION_ID = 0x54446F63


@dataclass(frozen=True)
class Column:
    name: str
    sql_type: str  # INTEGER, REAL or TEXT
    kind: str  # "scalar", "json" or "flat:<field>" (a field of a nested dataclass)


@dataclass(frozen=True)
class Table:
    name: str
    record: type
    columns: tuple[Column, ...]
    indexes: tuple[str, ...] = ()

    @property
    def column_names(self) -> list[str]:
        return [c.name for c in self.columns]

    def insert_sql(self) -> str:
        names = ", ".join(quote(n) for n in self.column_names)
        marks = ", ".join("?" for _ in self.columns)
        return f"INSERT INTO {self.name} ({names}) VALUES ({marks})"

    def create_sql(self) -> list[str]:
        cols = ", ".join(f"{quote(c.name)} {c.sql_type}" for c in self.columns)
        stmts = [f"CREATE TABLE IF NOT EXISTS {self.name} ({cols})"]
        for i, idx in enumerate(self.indexes):
            stmts.append(f"CREATE INDEX IF NOT EXISTS {self.name}_i{i} ON {self.name} ({idx})")
        return stmts


_SCALARS = {int: "INTEGER", float: "REAL", str: "TEXT", bool: "INTEGER"}


def _sql_type(annotation: Any) -> tuple[str, bool]:
    """(SQL type, is_json) for a field annotation such as ``float | None``."""
    args = typing.get_args(annotation)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _sql_type(inner[0])
        return "TEXT", True
    if annotation in _SCALARS:
        return _SCALARS[annotation], False
    return "TEXT", True


def _columns(record: type) -> tuple[Column, ...]:
    hints = typing.get_type_hints(record)
    cols: list[Column] = []
    for f in dataclasses.fields(record):
        hint = hints[f.name]
        nested = [a for a in (typing.get_args(hint) or (hint,)) if dataclasses.is_dataclass(a)]
        if nested:
            for sub in dataclasses.fields(nested[0]):
                cols.append(Column(f"{f.name}_{sub.name}", "REAL", f"flat:{f.name}"))
            continue
        sql_type, is_json = _sql_type(hint)
        cols.append(Column(f.name, sql_type, "json" if is_json else "scalar"))
    return tuple(cols)


def _table(name: str, record: type, indexes: tuple[str, ...] = ()) -> Table:
    return Table(name, record, _columns(record), indexes)


TABLES: dict[str, Table] = {
    t.name: t
    for t in (
        _table("host_samples", HostSample, ("t",)),
        _table("processes", ProcessInfo, ("pid",)),
        _table("process_samples", ProcessSample, ("t", "pid")),
        _table("gpu_samples", GpuSample, ("t", '"index"')),
        _table("gpu_process_samples", GpuProcessSample, ("t",)),
        _table("steps", StepRecord, ("t_end", "pid")),
        _table("dataloaders", DataLoaderRecord, ()),
        _table("settings", SettingRecord, ("key",)),
        _table("events", JobEvent, ("t",)),
    )
}

META_SQL = "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)"

# Profiler windows (records.ProfileWindow, ProfileSyncSite), outside TABLES: a recording
# written before them has neither table and reads as having no window (the reader checks),
# and they are written once per window, never by the samplers' batches.
PROFILE_TABLES_SQL = (
    "CREATE TABLE IF NOT EXISTS profile_windows (id INTEGER PRIMARY KEY, rank INTEGER, "
    "pid INTEGER, first_step INTEGER, last_step INTEGER, warmup_step INTEGER, "
    "started_at REAL, ended_at REAL, trace_path TEXT, trace_bytes INTEGER, state TEXT, "
    "reason TEXT)",
    "CREATE TABLE IF NOT EXISTS profile_sync_sites (window_id INTEGER, op TEXT, file TEXT, "
    "line INTEGER, function TEXT, count INTEGER, total_s REAL)",
)
PROFILE_TABLES = ("profile_windows", "profile_sync_sites")


def to_row(table: Table, record: Any) -> tuple:
    """The values of ``record`` in the column order of ``table``."""
    values: list[Any] = []
    for col in table.columns:
        if col.kind == "scalar":
            v = getattr(record, col.name)
            values.append(int(v) if isinstance(v, bool) else v)
        elif col.kind == "json":
            v = getattr(record, col.name)
            values.append(
                None if v is None else json.dumps(v, separators=(",", ":"), default=_compact)
            )
        else:
            parent = getattr(record, col.kind[5:])
            sub = col.name[len(col.kind) - 4 :]
            values.append(None if parent is None else getattr(parent, sub))
    return tuple(values)


def _compact(value: Any) -> Any:
    # Dataclasses inside JSON columns (per-core CPU splits) are stored as plain lists of their
    # field values, in field order: a 128-core host must not write 128 dicts per sample.
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return list(dataclasses.astuple(value))
    raise TypeError(f"cannot store {type(value).__name__} in a recording")


def from_row(table: Table, row: dict[str, Any]) -> dict[str, Any]:
    """Decode JSON columns of a row fetched from ``table`` (flattened columns stay flat)."""
    out = dict(row)
    for col in table.columns:
        if col.kind == "json" and out.get(col.name) is not None:
            try:
                out[col.name] = json.loads(out[col.name])
            except ValueError:
                # Only a damaged file holds such a cell (the writer stores json.dumps text):
                # a page salvaged from a cut file can end inside one. The value is unknown.
                out[col.name] = None
    return out


def quote(name: str) -> str:
    return f'"{name}"'


def stored_columns(db: Any, table: str) -> set[str]:
    """The columns ``table`` has in the recording open on ``db`` (a sqlite3 connection)."""
    return {row[1] for row in db.execute(f"PRAGMA table_info({table})")}


def select_list(columns: list[str], stored: set[str]) -> str:
    """A SELECT list for ``columns``. Columns are only ever added to the schema, never
    removed or changed: one that a recording written before it lacks reads as NULL (not
    measured), so every recording reads with the current column set."""
    return ", ".join(quote(c) if c in stored else f"NULL AS {quote(c)}" for c in columns)


__all__ = [
    "APPLICATION_ID",
    "META_SQL",
    "PROFILE_TABLES",
    "PROFILE_TABLES_SQL",
    "SCHEMA_VERSION",
    "TABLES",
    "Column",
    "CpuSplit",
    "Table",
    "from_row",
    "select_list",
    "stored_columns",
    "to_row",
]
