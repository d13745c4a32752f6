"""Exporting a recording to files: every format `torchdoctor export` knows, in :data:`FORMATS`.

CSV, Parquet and JSON Lines write one file per table plus meta.json; TensorBoard writes the
recording's scalars as a run. A new format is one more entry in :data:`FORMATS`.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torchdoctor.errors import UserError
from torchdoctor.recording.paths import prepare_folder
from torchdoctor.recording.reader import Recording

TABLE_FORMATS = ("csv", "parquet", "jsonl")


def export(rec: Recording, fmt: str, folder: Path) -> list[Path]:
    """Export ``rec`` as ``fmt`` into ``folder``; the files to show the user."""
    if fmt not in FORMATS:
        raise UserError(f"unknown format {fmt!r}: use one of {', '.join(FORMATS)}")
    return FORMATS[fmt](rec, folder)


def export_tables(rec: Recording, fmt: str, folder: Path) -> list[Path]:
    """Write every non-empty table of ``rec`` into ``folder`` as ``fmt`` (one of
    :data:`TABLE_FORMATS`), plus meta.json; the files written."""
    if fmt == "parquet":
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise UserError(
                "Parquet export needs pyarrow: `pip install pyarrow` (or `pip install torchdoctor[parquet]`)"
            ) from None
    prepare_folder(folder, "--out-dir")
    written = [_write_meta(rec, folder)]
    for table in rec.tables():
        if rec.count(table) == 0:
            continue
        target = folder / f"{table}.{fmt}"
        columns = rec.columns(table)
        rows = rec.iter_rows(table)
        if fmt == "csv":
            _write_csv(target, columns, rows)
        elif fmt == "jsonl":
            _write_jsonl(target, rows)
        else:
            _write_parquet(target, columns, rows)
        written.append(target)
    return written


def _write_meta(rec: Recording, folder: Path) -> Path:
    target = folder / "meta.json"
    target.write_text(json.dumps(rec.meta, indent=2) + "\n")
    return target


def _cell(value: Any) -> Any:
    """CSV and Parquet cells are scalars: nested values travel as JSON text."""
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"))
    return value


def _write_csv(target: Path, columns: list[str], rows) -> None:
    with open(target, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(columns)
        for row in rows:
            writer.writerow(["" if row[c] is None else _cell(row[c]) for c in columns])


def _write_jsonl(target: Path, rows) -> None:
    with open(target, "w") as fh:
        for row in rows:
            fh.write(json.dumps(row, separators=(",", ":")) + "\n")


def _write_parquet(target: Path, columns: list[str], rows) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    data: dict[str, list[Any]] = {c: [] for c in columns}
    for row in rows:
        for c in columns:
            data[c].append(_cell(row[c]))
    pq.write_table(pa.table(data), target)


def _export_tensorboard(rec: Recording, folder: Path) -> list[Path]:
    from torchdoctor.exporters.tensorboard import export_tensorboard

    return sorted(export_tensorboard(rec.path, folder).glob("*tfevents*"))[-1:]


def _tables_as(fmt: str) -> Callable[[Recording, Path], list[Path]]:
    return lambda rec, folder: export_tables(rec, fmt, folder)


# Every export format: its name (the value of `--format`) and what writes it.
FORMATS: dict[str, Callable[[Recording, Path], list[Path]]] = {
    **{fmt: _tables_as(fmt) for fmt in TABLE_FORMATS},
    "tensorboard": _export_tensorboard,
}
