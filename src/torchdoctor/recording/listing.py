"""The recordings folder as a list: what ``torchdoctor ls`` shows and what ``last`` names.

Each recording's line (when, command, duration, status, steps/s, worst finding) costs a
summary and a diagnosis to work out, so it is kept in an index beside the recordings
(``.torchdoctor-index.json``), keyed by the file's size and modification time: a recording
that has not changed since it was listed is not read again. The command that finishes a
recording (``torchdoctor run``'s end report) stores its line, having just computed it.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from torchdoctor.errors import UserError
from torchdoctor.recording.paths import SUFFIX, runs_dir

INDEX_NAME = ".torchdoctor-index.json"
LAST = ("last", "@last")
_INDEX_VERSION = 1


@dataclass(slots=True)
class Listed:
    """One recording's line in ``torchdoctor ls`` (and its JSON, ``schema_version`` 1)."""

    path: str
    name: str
    started_at: float | None
    command: list[str]
    duration_s: float | None
    status: str  # "exit 0", "exit 1", "running", "cut short", "unreadable"
    exit_status: int | None
    steps_per_s: float | None
    worst_finding: str | None  # the rule id of the most severe finding
    worst_severity: str | None  # critical, warning, info
    # what the line was computed from: (size, mtime_ns) of the file (and its -wal)
    key: list[int] | None = None


def recording_files(folder: Path) -> list[Path]:
    """The recordings directly in ``folder``, newest first (by modification time)."""
    try:
        found = [p for p in folder.iterdir() if p.suffix == SUFFIX and p.is_file()]
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise UserError(
            f"cannot read the recordings folder {str(folder)!r}: {exc.strerror}"
        ) from None
    return sorted(found, key=_mtime, reverse=True)


def last_recording(folder: Path | None = None) -> Path:
    """The newest recording in the recordings folder: what ``last``/``@last`` names."""
    where = folder or runs_dir()
    found = recording_files(where)
    if not found:
        raise UserError(
            f"no recording in {str(where)!r} for `last` to name: record one with "
            "`torchdoctor run -- CMD`, or set TORCHDOCTOR_RUNS_DIR to where they are"
        )
    return found[0]


def resolve_recording(text: str) -> str:
    """A recording as the user named it: ``last``/``@last`` is the newest in the recordings
    folder, ``last~N`` the one N before it (as git names commits), unless a file of that name
    exists here; anything else is a path."""
    base, sep, back = text.partition("~")
    if base not in LAST or Path(text).exists():
        return text
    if not sep:
        return str(last_recording())
    if not (back.isascii() and back.isdigit() and len(back) < 10):
        raise UserError(f"{text!r}: after ~ comes how many recordings back, e.g. last~1")
    n = int(back)
    if n == 0:
        return str(last_recording())
    where = runs_dir()
    found = recording_files(where)
    if n >= len(found):
        raise UserError(
            f"{text!r} names the recording {n} before the newest, but {str(where)!r} "
            f"holds {len(found)}"
        )
    return str(found[n])


def file_key(path: Path) -> list[int]:
    """What changes when a recording is written: size and mtime of the file and its WAL."""
    key: list[int] = []
    for p in (path, path.with_name(path.name + "-wal")):
        try:
            st = p.stat()
            key += [st.st_size, st.st_mtime_ns]
        except OSError:
            key += [0, 0]
    return key


def read_index(folder: Path) -> dict[str, Listed]:
    """The stored lines of ``folder``, by file name; empty when there is no usable index."""
    try:
        data = json.loads((folder / INDEX_NAME).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != _INDEX_VERSION:
        return {}
    names = {f.name for f in fields(Listed)}
    out: dict[str, Listed] = {}
    for name, entry in (data.get("recordings") or {}).items():
        if isinstance(entry, dict) and set(entry) == names:
            out[name] = Listed(**entry)
    return out


def store_lines(folder: Path, lines: list[Listed]) -> None:
    """Add or replace lines in ``folder``'s index (written whole, then renamed into place, so
    a reader never sees half a file). An index that cannot be written only costs speed."""
    index = read_index(folder)
    for line in lines:
        index[line.name] = line
    present = {p.name for p in recording_files(folder)}
    data = {
        "version": _INDEX_VERSION,
        "recordings": {n: asdict(v) for n, v in index.items() if n in present},
    }
    tmp = folder / f"{INDEX_NAME}.{os.getpid()}.tmp"
    with contextlib.suppress(OSError):
        tmp.write_text(json.dumps(data))
        os.replace(tmp, folder / INDEX_NAME)
    with contextlib.suppress(OSError):
        tmp.unlink()


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
