"""Is a recording complete, still being written, or cut short? And what a copy of one lacks.

The writer puts its identity in the metadata (process, its start time, host, boot). A reader
on the same machine can then tell a live writer (in progress) from a dead one (cut short);
on another machine it cannot, and says so. A recording in WAL mode whose ``-wal`` file is not
beside it (a copy of the .sqlite alone) holds what the last checkpoint folded in.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchdoctor.recording import file_head
from torchdoctor.sampling import procfs
from torchdoctor.units import fmt_duration

COMPLETE = "complete"
IN_PROGRESS = "in progress"
CUT_SHORT = "cut short"
UNFINISHED = "unfinished"  # written on another machine: whether its writer lives is unknown
DEFAULT_CHECKPOINT_S = 10.0
_BOOT_ID = "/proc/sys/kernel/random/boot_id"


@dataclass(frozen=True, slots=True)
class RecordingState:
    kind: str  # COMPLETE, IN_PROGRESS, CUT_SHORT or UNFINISHED
    writer_pid: int | None
    writer_host: str | None
    last_write_at: float | None  # wall time of the newest sample in the file
    wal_missing: bool  # WAL mode, not complete, and no NAME.sqlite-wal beside the file
    checkpoint_every_s: float
    writer_gone: bool = False  # cut short because the writer died (not because it stopped)

    @property
    def complete(self) -> bool:
        return self.kind == COMPLETE


def writer_identity() -> dict[str, Any]:
    """Who writes a recording: enough for a reader to tell later whether it still runs."""
    return {
        "pid": os.getpid(),
        "create_time": _create_time(os.getpid()),
        "host": socket.gethostname(),
        "boot_id": _boot_id(),
    }


def writer_alive(identity: dict[str, Any] | None) -> bool | None:
    """True/False for a writer on this machine since its last boot; None when unknowable."""
    if not identity or identity.get("host") != socket.gethostname():
        return None
    if identity.get("boot_id") != _boot_id():
        return False  # the machine rebooted since: nothing of that boot runs
    pid, started = identity.get("pid"), identity.get("create_time")
    if not isinstance(pid, int):
        return None
    now_started = _create_time(pid)
    if now_started is None:
        return False
    return started is None or abs(now_started - started) < 1.0


def recording_state(
    meta: dict[str, Any],
    last_write_at: float | None,
    journal_is_wal: bool,
    wal_beside: bool,
    stopped_here: bool = False,
) -> RecordingState:
    """``stopped_here``: a writer of this process stopped writing it (and could not say so)."""
    identity = meta.get("writer") if isinstance(meta.get("writer"), dict) else None
    every = float(meta.get("checkpoint_every_s") or DEFAULT_CHECKPOINT_S)
    complete = "ended_at" in meta
    # the writer finished its file without the end of the run, or stopped (a full disk)
    closed = "closed_at" in meta or stopped_here
    if complete:
        kind = COMPLETE
    elif closed:
        kind = CUT_SHORT
    else:
        alive = writer_alive(identity)
        if identity is None or alive is False:
            kind = CUT_SHORT  # recordings older than the writer identity: as before
        elif alive:
            kind = IN_PROGRESS
        else:
            kind = UNFINISHED
    wal_missing = not complete and journal_is_wal and kind != CUT_SHORT and not wal_beside
    return RecordingState(
        kind=kind,
        writer_pid=identity.get("pid") if identity else None,
        writer_host=identity.get("host") if identity else None,
        last_write_at=last_write_at,
        wal_missing=wal_missing,
        checkpoint_every_s=every,
        writer_gone=kind == CUT_SHORT and not closed and identity is not None,
    )


def describe_state(
    state: RecordingState, path: Path, now: float | None = None, *, hint: bool = True
) -> str:
    """One line for people: "recording in progress (pid 12 writing, last write 3 s ago)";
    with ``hint``, what a copy without its WAL lacks, and how to get it."""
    now = time.time() if now is None else now
    ago = (
        f"last write {fmt_duration(max(0.0, now - state.last_write_at))} ago"
        if state.last_write_at is not None
        else "nothing sampled yet"
    )
    if state.kind == COMPLETE:
        line = "recording complete"
    elif state.kind == IN_PROGRESS:
        line = f"recording in progress (pid {state.writer_pid} writing, {ago})"
    elif state.kind == UNFINISHED:
        line = (
            f"recording not finished: written by pid {state.writer_pid} on "
            f"{state.writer_host}, which cannot be checked from here ({ago})"
        )
    elif state.writer_gone:
        line = f"recording cut short (its recorder, pid {state.writer_pid}, is gone; {ago})"
    else:
        line = f"recording cut short (the recorder stopped before the job ended; {ago})"
    if hint and state.wal_missing:
        line += "; " + missing_wal_hint(path, state.checkpoint_every_s)
    return line


def missing_wal_hint(path: Path, every_s: float) -> str:
    return (
        f"this copy holds what the last checkpoint folded in: copy {path.name}-wal along, "
        f"or wait {every_s:g} s and copy again"
    )


def journal_is_wal(path: Path) -> bool:
    """The file header's read/write versions are 2 in WAL mode."""
    try:
        header = file_head.read_head(path, 20)
    except OSError:
        return False
    return len(header) == 20 and header[18] == 2 and header[19] == 2


def _create_time(pid: int) -> float | None:
    try:
        return procfs.create_time(pid)
    except (OSError, ValueError, IndexError):  # gone, or a stat file cut short or unknown
        return None


_boot_id_read: str | None = None


def _boot_id() -> str | None:
    """This boot's id, read once: it cannot change under a running process, and a reader
    that follows many recordings (``top``, the exporter) asks at every refresh of each."""
    global _boot_id_read
    if _boot_id_read is None:
        try:
            with open(_BOOT_ID) as fh:
                _boot_id_read = fh.read().strip()
        except OSError:
            return None
    return _boot_id_read
