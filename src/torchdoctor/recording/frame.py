"""Sample tables read column by column into compact arrays: what long recordings need.

A day of host samples at the default 0.5 s interval is 172,800 rows; read as one dict per row
with every column (``Recording.rows``) that is over a gigabyte. A :class:`SampleFrame` holds
the same rows as one array per column, each read from SQLite the first time something asks
for it: 8 bytes per number (``array('d')``, NaN standing for NULL, which SQLite never stores
as a number), so a reader pays only for the columns it uses.

    >>> frame = rec.frame("host_samples", t_from=rec.started_at, t_to=rec.ended_at)
    >>> len(frame), frame[0]["cpu_busy"], list(frame.values("cpu_iowait"))[:3]
    >>> by_pid = rec.frame("process_samples").group_by("pid")

Rows come in the order ``Recording.rows`` gives (samples by ``t``, steps by ``t_end``; then in
the order they were written) and read like the dicts
``Recording.rows`` returns: ``row["col"]`` and ``row.get("col")``, None where not measured.
The set of rows is fixed when the frame is made: rows a live recorder writes afterwards are
not in it, so columns read later still line up.
"""

from __future__ import annotations

import json
import math
from array import array
from collections.abc import Callable, Iterator, Sequence
from typing import Any, overload

from torchdoctor.recording.schema import Table

NAN = math.nan


class _IntsWithNulls:
    """An integer column with NULLs: stored as doubles (exact below 2**53), read as ints
    (None for NULL)."""

    __slots__ = ("values",)

    def __init__(self, values: array) -> None:
        self.values = values

    def __getitem__(self, i: int) -> int | None:
        v = self.values[i]
        if v != v:
            return None
        return int(v) if v.is_integer() else v  # a real in an INTEGER column stays a real

    def __len__(self) -> int:
        return len(self.values)


class _Store:
    """The columns of one table's rows, read on demand."""

    __slots__ = ("spec", "read", "columns", "length", "every_s")

    def __init__(
        self,
        spec: Table,
        read: Callable[[str], Iterator[Any]],
        length: int,
        every_s: float | None = None,
    ) -> None:
        self.spec = spec
        self.read = read  # the values of one column over the frame's rows, in row order
        self.columns: dict[str, Any] = {}
        self.length = length
        self.every_s = every_s  # one sampling instant per every_s seconds; None: all of them

    def column(self, name: str) -> Any:
        col = self.columns.get(name)
        if col is None:
            col = self.columns[name] = self._read(name)
        return col

    def _read(self, name: str) -> Any:
        kind = next((c for c in self.spec.columns if c.name == name), None)
        if kind is None:
            raise KeyError(name)
        values = self.read(name)
        if kind.kind == "json":
            return [_json(v) for v in values]
        if kind.sql_type == "TEXT":
            seen: dict[str, str] = {}  # one string object per distinct value (roles, names)
            return [None if v is None else seen.setdefault(v, v) for v in values]
        if kind.sql_type == "INTEGER":
            return _integers(values)
        return array("d", (_number(v) for v in values))


def _integers(values: Iterator[Any]) -> Any:
    """An INTEGER column: ``array('q')``, or doubles read back as ints once a NULL shows."""
    ints = array("q")
    for v in values:
        if type(v) is int:
            ints.append(v)
            continue
        doubles = array("d", ints)
        doubles.append(_number(v))
        doubles.extend(_number(w) for w in values)
        return _IntsWithNulls(doubles)
    return ints


def _number(v: Any) -> float:
    # NaN for NULL; also for text in a number column, which only a damaged file holds.
    return float(v) if isinstance(v, (int, float)) else NAN


def _json(value: Any) -> Any:
    if value is None:
        return None
    try:
        return json.loads(value)
    except ValueError:
        return None  # only a damaged file holds such a cell (see schema.from_row)


class SampleRow:
    """One row of a :class:`SampleFrame`, read like a dict of its columns."""

    __slots__ = ("_store", "_i")

    def __init__(self, store: _Store, i: int) -> None:
        self._store = store
        self._i = i

    def __getitem__(self, name: str) -> Any:
        col = self._store.columns.get(name)
        if col is None:
            col = self._store.column(name)
        v = col[self._i]
        return None if v != v else v  # NaN is how a number column holds NULL

    def get(self, name: str, default: Any = None) -> Any:
        try:
            return self[name]
        except KeyError:
            return default

    def __repr__(self) -> str:
        return f"SampleRow({self._store.spec.name}, {self._i})"


class SampleFrame(Sequence):
    """Rows of one sample table (or a subset of them), column by column."""

    __slots__ = ("_store", "_index")

    def __init__(self, store: _Store, index: array | range | None = None) -> None:
        self._store = store
        self._index = range(store.length) if index is None else index

    @property
    def table(self) -> str:
        return self._store.spec.name

    @property
    def every_s(self) -> float | None:
        """None when these rows hold every sampling instant of their span; else the frame
        was read at bounded resolution (``Recording.frame(max_instants=...)``): about one
        instant per ``every_s`` seconds, the last one always among them."""
        return self._store.every_s

    def __len__(self) -> int:
        return len(self._index)

    @overload
    def __getitem__(self, i: int) -> SampleRow: ...
    @overload
    def __getitem__(self, i: slice) -> SampleFrame: ...
    def __getitem__(self, i: int | slice) -> SampleRow | SampleFrame:
        if isinstance(i, slice):
            return SampleFrame(self._store, self._index[i])
        return SampleRow(self._store, self._index[i])

    def __iter__(self) -> Iterator[SampleRow]:
        store = self._store
        return (SampleRow(store, i) for i in self._index)

    def values(self, name: str) -> Iterator[Any]:
        """The column ``name`` over these rows, None where not measured."""
        col = self._store.column(name)
        return (None if (v := col[i]) != v else v for i in self._index)

    def series(self, name: str) -> list[tuple[float, float]]:
        """(t, value) of these rows where ``name`` was measured, values as floats."""
        return [
            (t, float(v))
            for t, v in zip(self.values("t"), self.values(name), strict=True)
            if v is not None
        ]

    def group_by(self, name: str) -> dict[Any, SampleFrame]:
        """These rows split by the value of column ``name``, each group oldest first."""
        groups: dict[Any, array] = {}
        col = self._store.column(name)
        for i in self._index:
            key = col[i]
            if key != key:
                key = None  # NaN: NULL in a number column
            rows = groups.get(key)
            if rows is None:
                rows = groups[key] = array("I")  # row numbers: 4 bytes each
            rows.append(i)
        return {key: SampleFrame(self._store, rows) for key, rows in groups.items()}


def make_frame(
    spec: Table,
    read: Callable[[str], Iterator[Any]],
    length: int,
    every_s: float | None = None,
) -> SampleFrame:
    """A frame of ``length`` rows of ``spec`` whose column NAME is ``read(NAME)``; ``every_s``
    when those rows are one sampling instant per ``every_s`` seconds, not all of them."""
    return SampleFrame(_Store(spec, read, length, every_s))


__all__ = ["SampleFrame", "SampleRow", "make_frame"]
