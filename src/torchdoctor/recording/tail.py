"""Reading a recording while it is written: the one reader `top` and the exporters share.

Rows are only ever appended to a recording, so each table's largest rowid seen is the whole
position; a read costs one indexed query per table, however long the recording is. The
connection is read-only: the recorder keeps writing (WAL mode lets readers in beside it).
Errors are ``sqlite3.Error``, or ``NotARecordingError`` for a path that is not a regular file
(never opened: a FIFO would block the open forever) and for a meta value that is not JSON: the
caller says what it could not read and goes on.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Collection
from pathlib import Path
from typing import Any

from torchdoctor.recording.reader import damaged, require_regular_file
from torchdoctor.recording.schema import TABLES, from_row, quote, select_list, stored_columns


class RecordingTail:
    """New rows of a recording's tables, table by table; ``meta`` is re-read on demand.

    ``meta_skip``: meta keys this reader never reads, left out of ``meta``: ``top`` leaves out
    the running totals, which the writer rewrites at every flush (decoding them was half of
    a re-read of meta: 21 us against 9 a job, at every refresh of each).
    """

    def __init__(self, path: str | Path, meta_skip: Collection[str] = ()) -> None:
        self.path = Path(path)
        # The run id every series of this job carries: the recording's file name, unique on
        # the machine and the same on every endpoint that reads it.
        self.run_id = self.path.stem
        # Checked before SQLite opens it: opening a FIFO waits for a writer forever, and the
        # exporter reads paths any user's registry entry names.
        require_regular_file(self.path)
        self._db = sqlite3.connect(
            f"file:{self.path.resolve()}?mode=ro", uri=True, check_same_thread=False
        )
        self._last: dict[str, int] = {}
        self._stored: dict[str, set[str]] = {}
        # What a read of these columns selects, and whether any is JSON, made once: the same
        # few reads repeat at every scrape.
        self._selects: dict[tuple[str, ...], tuple[str, bool]] = {}
        self.meta: dict[str, Any] = {}
        self._raw_meta: dict[str, str] = {}  # meta's values as stored (JSON text)
        self._meta_skip = tuple(meta_skip)
        self._meta_sql = "SELECT key, value FROM meta"
        if self._meta_skip:
            self._meta_sql += f" WHERE key NOT IN ({', '.join('?' * len(self._meta_skip))})"
        try:
            self.refresh_meta()
        except BaseException:
            self._db.close()  # the caller never gets the tail to close
            raise

    def refresh_meta(self) -> dict[str, Any]:
        """Re-read ``meta``. Values are decoded only where their text changed: a live job's
        meta is re-read at every scrape, and decoding its host description each time cost
        about 1 ms a job."""
        raw = dict(self._db.execute(self._meta_sql, self._meta_skip))
        if raw != self._raw_meta:
            old, known = self.meta, self._raw_meta
            meta: dict[str, Any] = {}
            for k, v in raw.items():
                try:
                    meta[k] = old[k] if known.get(k) == v else json.loads(v)
                except (TypeError, ValueError):
                    raise damaged(self.path, f"meta {k!r} is not JSON ({str(v)[:40]!r})") from None
            self.meta = meta
            self._raw_meta = raw
        return self.meta

    def new_rows(self, table: str, columns: list[str] | None = None) -> list[dict[str, Any]]:
        """Rows added to ``table`` since the previous call (all rows at the first), in order.

        Columns the recording lacks (added to the schema after it was written) read as None.
        """
        spec = TABLES[table]
        cols = columns or spec.column_names
        rows = self.new_tuples(table, cols)
        if rows and self._select(table, cols)[1]:
            return [from_row(spec, dict(zip(cols, r, strict=True))) for r in rows]
        return [dict(zip(cols, r, strict=True)) for r in rows]

    def new_tuples(self, table: str, columns: list[str], limit: int | None = None) -> list[tuple]:
        """As :meth:`new_rows`, as tuples of ``columns`` in that order and JSON left as text:
        for readers of many rows (a dict per row costs more than the rest of their work).
        With ``limit``, at most that many: a reader of a long history takes it in parts."""
        select = self.selection(table, columns)
        last = self._last.get(table, 0)
        if limit is None:
            # One query, the rowid beside the columns: a follower reads several tables at
            # every scrape, most of them with nothing new.
            rows = self._db.execute(
                f"SELECT rowid, {select} FROM {table} WHERE rowid > ? ORDER BY rowid", (last,)
            ).fetchall()
            if not rows:
                return []
            self._last[table] = rows[-1][0]
            return [r[1:] for r in rows]
        # rowids of rows only ever appended follow each other
        end = min(self.count(table), last + limit)
        if end <= last:
            return []
        rows = self._db.execute(
            f"SELECT {select} FROM {table} WHERE rowid > ? AND rowid <= ? ORDER BY rowid",
            (last, end),
        ).fetchall()
        self._last[table] = end
        return rows

    def position(self, table: str) -> int:
        """The last rowid of ``table`` read so far (0 before any)."""
        return self._last.get(table, 0)

    def seek(self, table: str, rowid: int) -> None:
        """Go on from ``rowid``: the next :meth:`new_rows` returns the rows after it (a reader
        that summed the history itself, in SQL, starts there)."""
        self._last[table] = rowid

    def column(self, table: str, column: str) -> str:
        """``column`` for a SELECT over ``table``: NULL where the recording lacks it."""
        return quote(column) if column in self._columns(table) else "NULL"

    def query(self, sql: str, params: tuple | list = ()) -> list[tuple]:
        """A read-only aggregate over the recording (the connection is read-only)."""
        return self._db.execute(sql, params).fetchall()

    def count(self, table: str) -> int:
        """Rows in ``table`` so far (only ever appended: the last rowid, without a scan)."""
        return self._db.execute(f"SELECT COALESCE(MAX(rowid), 0) FROM {table}").fetchone()[0]

    def newest(self, table: str, column: str) -> Any:
        """The largest ``column`` of ``table`` (a time: the latest), None when it is empty."""
        return self._db.execute(f"SELECT MAX({column}) FROM {table}").fetchone()[0]

    def recent_rows(
        self,
        table: str,
        columns: list[str],
        *,
        by: str,
        since: float | None = None,
        last: int | None = None,
    ) -> list[dict[str, Any]]:
        """Rows of ``table`` in order of ``by``: those with ``by >= since``, else the ``last``."""
        select = self.selection(table, columns)
        if since is not None:
            query, args = f"SELECT {select} FROM {table} WHERE {by} >= ? ORDER BY {by}", (since,)
        else:
            query, args = f"SELECT {select} FROM {table} ORDER BY {by} DESC LIMIT ?", (last,)
        rows = [dict(zip(columns, r, strict=True)) for r in self._db.execute(query, args)]
        return rows if since is not None else rows[::-1]

    def selection(self, table: str, columns: list[str]) -> str:
        """The SELECT list of ``columns`` over ``table``: NULL where the recording lacks one."""
        return self._select(table, columns)[0]

    def _select(self, table: str, columns: list[str]) -> tuple[str, bool]:
        """(The SELECT list of ``columns`` over ``table``, whether any of them is JSON)."""
        key = (table, *columns)
        known = self._selects.get(key)
        if known is not None:
            return known
        stored = self._columns(table)
        names = set(columns)
        made = (
            select_list(columns, stored),
            any(c.kind == "json" for c in TABLES[table].columns if c.name in names),
        )
        if stored:  # a table not created yet is asked again
            self._selects[key] = made
        return made

    def _columns(self, table: str) -> set[str]:
        stored = self._stored.get(table)
        if not stored:  # empty until the recorder has created its tables
            stored = self._stored[table] = stored_columns(self._db, table)
        return stored

    def close(self) -> None:
        self._db.close()
