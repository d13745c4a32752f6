"""Which jobs are being recorded right now, so that ``torchdoctor top`` can find their recordings.

Every recorded job announces itself, whichever path records it (`torchdoctor run`, `attach`,
`launch`, a queued job, tune's and bench scaling's trials, ``torchdoctor.watch()``: all through
:class:`torchdoctor.run.session.RecordingSession`, which calls :func:`announce` once the job's
process runs and :func:`withdraw` when it ends), so that `top` and the host exporter find it.
Each entry is one small JSON file named after the PID, in a
folder only this user can write: ``$XDG_RUNTIME_DIR/torchdoctor`` or ``/tmp/torchdoctor-$UID``.
An entry whose process is gone (or whose PID now belongs to another process) is stale: a
recorder killed with SIGKILL never unregisters, so :func:`active` prunes such entries.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from torchdoctor.sampling import procfs


@dataclass(frozen=True, slots=True)
class RegistryEntry:
    pid: int  # the recorded job's root process
    create_time: float  # when ``pid`` started (procfs.create_time): guards against PID reuse
    recording_path: Path
    registered_at: float


def registry_dir() -> Path:
    """The folder holding the entries (not created here)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    # A relative value is invalid (the XDG spec): it would name another folder in each cwd.
    if (
        runtime
        and os.path.isabs(runtime)
        and os.path.isdir(runtime)
        and os.access(runtime, os.W_OK | os.X_OK)
    ):
        return Path(runtime) / "torchdoctor"
    return Path(tempfile.gettempdir()) / f"torchdoctor-{os.getuid()}"


def register(pid: int, recording_path: str | os.PathLike[str]) -> Path:
    """Announce that process ``pid`` is being recorded into ``recording_path``.

    Returns the entry's file. Raises ``ProcessLookupError`` when ``pid`` is not running and
    ``OSError`` when the folder cannot be written.
    """
    try:
        create_time = procfs.create_time(pid)
    except (FileNotFoundError, ProcessLookupError):
        raise ProcessLookupError(f"process {pid} is not running") from None
    folder = _own_folder(create=True)
    entry = {
        "pid": pid,
        "create_time": create_time,
        "recording": str(Path(recording_path).resolve()),
        "registered_at": time.time(),
    }
    target = folder / f"{pid}.json"
    # Write then rename, so a reader never sees half an entry.
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{pid}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(entry, fh)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return target


def unregister(pid: int) -> None:
    """Remove the entry of ``pid``; removing one that is not there is not an error."""
    folder = _own_folder(create=False)
    if folder is not None:
        with contextlib.suppress(FileNotFoundError):
            (folder / f"{pid}.json").unlink()


def announce(pid: int, recording_path: str | os.PathLike[str]) -> bool:
    """:func:`register`, best effort: a job that cannot be announced is still recorded.

    A process another recorder announced keeps that entry (``watch()`` in a job under
    `torchdoctor run`): False, and the entry is not this caller's to withdraw."""
    try:
        folder = _own_folder(create=False)
        if folder is not None:
            entry = _load(folder / f"{pid}.json")
            if entry is not None and _alive(entry):
                return False
        register(pid, recording_path)
        return True
    except OSError:  # ProcessLookupError included: the job ended before it was announced
        return False


def withdraw(pid: int) -> None:
    """:func:`unregister`, best effort."""
    with contextlib.suppress(OSError):
        unregister(pid)


def active() -> list[RegistryEntry]:
    """Entries whose process is still the one that registered, oldest first; prunes the rest."""
    folder = _own_folder(create=False)
    if folder is None:
        return []
    entries: list[RegistryEntry] = []
    for path in folder.glob("*.json"):
        entry = _load(path)
        if entry is None or not _alive(entry):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            continue
        entries.append(entry)
    entries.sort(key=lambda e: e.registered_at)
    return entries


def every_users_active() -> list[tuple[int, RegistryEntry]]:
    """(uid, entry) of every user's recorded jobs running now, for the machine's exporter
    (root, or a service that may read the users' folders): each user's own registry folder
    under /run/user/UID/torchdoctor and in the temporary folder. A folder that is not its
    user's alone, and an entry whose recording belongs to someone else, are left out (no one
    passes their jobs off as another's). Nothing is pruned: the folders are not ours."""
    folders: list[tuple[int, Path]] = []
    with contextlib.suppress(OSError):
        for run in Path("/run/user").iterdir():
            if run.name.isdigit():
                folders.append((int(run.name), run / "torchdoctor"))
    with contextlib.suppress(OSError):
        for tmp in Path(tempfile.gettempdir()).glob("torchdoctor-*"):
            uid = tmp.name.removeprefix("torchdoctor-")
            if uid.isdigit():
                folders.append((int(uid), tmp))
    out: list[tuple[int, RegistryEntry]] = []
    for uid, folder in folders:
        try:
            st = os.lstat(folder)
            if (
                not stat.S_ISDIR(st.st_mode)
                or st.st_uid != uid
                or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
            ):
                continue
            paths = list(folder.glob("*.json"))
        except OSError:
            continue
        for path in paths:
            entry = _load(path)
            if entry is None or not _alive(entry):
                continue
            try:
                if os.stat(entry.recording_path).st_uid != uid:
                    continue
            except OSError:
                continue
            out.append((uid, entry))
    out.sort(key=lambda pair: pair[1].registered_at)
    return out


# Entries as last read, by file: the exporter lists the registry at every scrape, and an
# entry never changes once written (a new one replaces the file: another inode).
_read: dict[Path, tuple[tuple[int, int, int], RegistryEntry]] = {}
_READ_MAX = 4096  # entries of jobs long gone go with the next clear-out


def _load(path: Path) -> RegistryEntry | None:
    try:
        st = os.stat(path)
        known = _read.get(path)
        if known is not None and known[0] == (st.st_ino, st.st_mtime_ns, st.st_size):
            return known[1]
        data = json.loads(path.read_text())
        entry = RegistryEntry(
            pid=int(data["pid"]),
            create_time=float(data["create_time"]),
            recording_path=Path(data["recording"]),
            registered_at=float(data["registered_at"]),
        )
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return None  # unreadable or foreign file: pruned like a stale entry
    if len(_read) >= _READ_MAX:
        _read.clear()
    _read[path] = ((st.st_ino, st.st_mtime_ns, st.st_size), entry)
    return entry


def _alive(entry: RegistryEntry) -> bool:
    try:
        # Entries written by older versions hold psutil's create_time, rounded differently;
        # a reused PID differs by far more than this.
        return abs(procfs.create_time(entry.pid) - entry.create_time) < 1.0
    except (OSError, ValueError, IndexError):  # gone (or its stat file unreadable)
        return False


def _own_folder(create: bool) -> Path | None:
    """The registry folder, checked to be ours and private; ``None`` if absent and not created.

    In /tmp another user could create the folder first to feed us entries, so a folder that
    is a symlink, not ours or writable by others is refused.
    """
    folder = registry_dir()
    if create:
        with contextlib.suppress(FileExistsError):
            folder.mkdir(mode=0o700, parents=False)
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        return None
    if (
        not stat.S_ISDIR(st.st_mode)
        or st.st_uid != os.getuid()
        or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    ):
        raise PermissionError(
            f"{folder} is not a private folder owned by this user; remove it so torchdoctor "
            "can recreate it"
        )
    return folder
