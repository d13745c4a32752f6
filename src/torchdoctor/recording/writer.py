"""Writes one recording: a SQLite file in WAL mode, filled in batches.

Durability contract: everything handed to the writer is committed at the latest
``flush_every_s`` after it arrived (default 1 s, checked on every call and by the recorder's
loop), so a recorder killed with SIGKILL leaves a file that opens and holds all data older
than that. WAL with ``synchronous=NORMAL`` loses no committed transaction when a process dies;
only power loss could cost the last commits, which is an acceptable trade for a monitor.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from torchdoctor.errors import UserError
from torchdoctor.recording.records import DataLoaderRecord, JobEvent, SettingRecord, StepRecord
from torchdoctor.recording.schema import APPLICATION_ID, META_SQL, SCHEMA_VERSION, TABLES, to_row
from torchdoctor.sampling.types import Snapshot


def prepare_output(path: str | os.PathLike[str], option: str = "--out") -> Path:
    """Check that a recording can be created at ``path`` before anything is started.

    ``option`` is how the user named the path (the CLI's --out, an API argument), for the
    message that says what to change."""
    target = Path(path)
    folder = target.parent if str(target.parent) else Path(".")
    blocker = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise UserError(
            f"cannot create the output folder {str(folder)!r}: {str(blocker)!r} is a file, "
            f"not a folder; choose another place with {option}"
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(
            f"cannot create the output folder {str(folder)!r}: {exc.strerror}; "
            f"choose another place with {option}"
        ) from None
    if target.exists() and target.is_dir():
        raise UserError(f"{str(target)!r} is a folder; give {option} a file name ending in .sqlite")
    if target.exists():
        raise UserError(f"{str(target)!r} already exists; choose a new name with {option}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(
            f"the output folder {str(folder)!r} is not writable; choose another place with {option}"
        )
    return target


class RecordingWriter:
    """Buffers records and commits them in batches; safe to call from several threads."""

    def __init__(
        self, path: str | os.PathLike[str], meta: dict[str, Any], *, flush_every_s: float = 1.0
    ) -> None:
        self.path = Path(path)
        self.flush_every_s = flush_every_s
        self._lock = threading.Lock()
        self._pending: dict[str, list[tuple]] = {name: [] for name in TABLES}
        self._last_flush = time.monotonic()
        self._closed = False
        self.rows_written: dict[str, int] = {name: 0 for name in TABLES}
        try:
            self._db = sqlite3.connect(
                str(self.path), check_same_thread=False, isolation_level=None
            )
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute(f"PRAGMA application_id={APPLICATION_ID}")
            self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            self._db.execute("BEGIN")
            self._db.execute(META_SQL)
            for table in TABLES.values():
                for stmt in table.create_sql():
                    self._db.execute(stmt)
            self._set_meta_locked({"schema_version": SCHEMA_VERSION, **meta})
            self._db.execute("COMMIT")
        except sqlite3.Error as exc:
            raise UserError(f"cannot create the recording {str(self.path)!r}: {exc}") from None

    # -- adding data -------------------------------------------------------------------
    def write_snapshot(self, snap: Snapshot) -> None:
        with self._lock:
            if snap.host is not None:
                self._pending["host_samples"].append(to_row(TABLES["host_samples"], snap.host))
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

    def set_meta(self, values: dict[str, Any]) -> None:
        with self._lock:
            if self._closed:
                return
            self._db.execute("BEGIN")
            self._set_meta_locked(values)
            self._db.execute("COMMIT")

    def _add(self, table: str, records: Iterable[Any]) -> None:
        with self._lock:
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
            if self._closed:
                return
            self._last_flush = time.monotonic()
            if not any(self._pending.values()):
                return
            self._db.execute("BEGIN")
            for name, rows in self._pending.items():
                if rows:
                    self._db.executemany(TABLES[name].insert_sql(), rows)
                    self.rows_written[name] += len(rows)
            self._db.execute("COMMIT")
            for rows in self._pending.values():
                rows.clear()

    def close(self, final_meta: dict[str, Any] | None = None) -> None:
        """Commit everything, write the end metadata and leave one self-contained file."""
        self.flush()
        with self._lock:
            if self._closed:
                return
            if final_meta:
                self._db.execute("BEGIN")
                self._set_meta_locked(final_meta)
                self._db.execute("COMMIT")
            self._closed = True
            try:
                # Fold the WAL back so the recording is one file that can be copied alone.
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                self._db.execute("PRAGMA journal_mode=DELETE")
            except sqlite3.Error:
                pass  # another reader holds the WAL open; the data is committed anyway
            self._db.close()


def _json_default(value: Any) -> Any:
    import dataclasses

    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if isinstance(value, Path):
        return str(value)
    return str(value)
