"""Exporting a recording to files: every format `torchdoctor export` knows, in :data:`FORMATS`.

CSV, Parquet and JSON Lines write one file per table plus meta.json; TensorBoard writes the
recording's scalars as a run. A new format is one more entry in :data:`FORMATS`.
"""

from __future__ import annotations

import contextlib
import csv
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torchdoctor.errors import UserError
from torchdoctor.output_files import check_output_file, open_output_file
from torchdoctor.recording.paths import prepare_folder
from torchdoctor.recording.reader import Recording

TABLE_FORMATS = ("csv", "parquet", "jsonl")
OPTION = "--out-dir"  # the option that moves the files, for every message about them


def export(rec: Recording, fmt: str, folder: Path, *, force: bool = False) -> list[Path]:
    """Export ``rec`` as ``fmt`` into ``folder``; the files to show the user. ``force``
    replaces files of an earlier export (never a recording, a folder or a device)."""
    if fmt not in FORMATS:
        raise UserError(f"unknown format {fmt!r}: use one of {', '.join(FORMATS)}")
    return FORMATS[fmt](rec, folder, force)


def export_tables(rec: Recording, fmt: str, folder: Path, force: bool = False) -> list[Path]:
    """Write every non-empty table of ``rec`` into ``folder`` as ``fmt`` (one of
    :data:`TABLE_FORMATS`), plus meta.json; the files written.

    Each file is written by :mod:`torchdoctor.output_files`, and every one is checked before
    the first is written: an existing file stops the export unless ``force``, with nothing
    written. A failure part way (a full disk) removes what this export wrote, and the folder
    when this export made it."""
    if fmt == "parquet":
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise UserError(
                "Parquet export needs pyarrow: `pip install pyarrow` (or `pip install torchdoctor[parquet]`)"
            ) from None
    made = not folder.exists()
    prepare_folder(folder, OPTION)
    tables = [t for t in rec.tables() if rec.count(t) > 0]
    targets = [folder / "meta.json", *(folder / f"{t}.{fmt}" for t in tables)]
    written: list[Path] = []
    try:
        for target in targets:
            check_output_file(target, OPTION, force=force)
        _write_meta(rec, targets[0], force)
        written.append(targets[0])
        for table, target in zip(tables, targets[1:], strict=True):
            columns = rec.columns(table)
            rows = rec.iter_rows(table)
            if fmt == "csv":
                _write_csv(target, columns, rows, force)
            elif fmt == "jsonl":
                _write_jsonl(target, rows, force)
            else:
                _write_parquet(target, columns, rows, force)
            written.append(target)
    except BaseException:
        # Files replaced with --force are gone either way; new ones, and a folder this export
        # made, are removed so that a failed export leaves no half of one.
        if made:
            for path in written:
                path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
    return written


def _write_meta(rec: Recording, target: Path, force: bool) -> None:
    with open_output_file(target, OPTION, force=force) as fh:
        fh.write(json.dumps(rec.meta, indent=2) + "\n")


def _cell(value: Any) -> Any:
    """CSV and Parquet cells are scalars: nested values travel as JSON text."""
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"))
    return value


def _write_csv(target: Path, columns: list[str], rows, force: bool) -> None:
    with open_output_file(target, OPTION, force=force, newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(columns)
        for row in rows:
            writer.writerow(["" if row[c] is None else _cell(row[c]) for c in columns])


def _write_jsonl(target: Path, rows, force: bool) -> None:
    with open_output_file(target, OPTION, force=force) as fh:
        for row in rows:
            fh.write(json.dumps(row, separators=(",", ":")) + "\n")


def _write_parquet(target: Path, columns: list[str], rows, force: bool) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    data: dict[str, list[Any]] = {c: [] for c in columns}
    for row in rows:
        for c in columns:
            data[c].append(_cell(row[c]))
    with open_output_file(target, OPTION, force=force, binary=True) as fh:
        pq.write_table(pa.table(data), fh)


def _export_tensorboard(rec: Recording, folder: Path, force: bool) -> list[Path]:
    # A TensorBoard run is a folder of its own, which the writer refuses to reuse: no --force.
    from torchdoctor.exporters.tensorboard import export_tensorboard

    return sorted(export_tensorboard(rec.path, folder).glob("*tfevents*"))[-1:]


def _tables_as(fmt: str) -> Callable[[Recording, Path, bool], list[Path]]:
    return lambda rec, folder, force: export_tables(rec, fmt, folder, force)


# Every export format: its name (the value of `--format`) and what writes it, given the
# recording, the folder and whether --force replaces earlier files.
FORMATS: dict[str, Callable[[Recording, Path, bool], list[Path]]] = {
    **{fmt: _tables_as(fmt) for fmt in TABLE_FORMATS},
    "tensorboard": _export_tensorboard,
}
