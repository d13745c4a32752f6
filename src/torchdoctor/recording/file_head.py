"""The first bytes of a recording, read without costing this process's writer its locks.

SQLite locks a database with POSIX advisory locks, which belong to the process and are all
released when the process closes *any* descriptor of the file. A reader in the process that
writes a recording (the exporter's diagnosis under `run --prometheus`, the automatic profiler
window's watch) that opened and closed the file to read its header released the writer's
locks; the next connection of another process to close (`torchdoctor show` of the live file)
then took itself for the last one and deleted the live -wal and -shm files under the writer.
SQLite shares one descriptor among its own connections for this reason; this module does the
same for the bytes torchdoctor reads itself: while a writer of this process holds a recording
(:func:`hold`), reads of its header go through one descriptor kept open until the writer has
closed its connection (:func:`release`), and no descriptor of the file is ever closed early.
"""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

FileKey = tuple[int, int]  # (st_dev, st_ino): the file, whatever path names it

_held: dict[FileKey, tuple[int, int]] = {}  # file -> (descriptor, writers holding it)
_lock = threading.Lock()


class NotRegularFile(OSError):
    """The path names a FIFO, a device or a folder now (it may have been swapped since a check)."""


def hold(path: str | os.PathLike[str]) -> FileKey:
    """Keep a descriptor of the recording ``path`` open for this process's header reads, until
    :func:`release` (called once the writer's SQLite connection is closed)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    st = os.fstat(fd)
    key = (st.st_dev, st.st_ino)
    with _lock:
        if key in _held:
            os.close(fd)  # a second writer of the same file: its locks are the same process's
            held, count = _held[key]
            _held[key] = (held, count + 1)
        else:
            _held[key] = (fd, 1)
    return key


def release(key: FileKey) -> None:
    """The writer that held ``key`` has closed its connection: its descriptor may go."""
    with _lock:
        fd, count = _held.pop(key, (-1, 0))
        if count > 1:
            _held[key] = (fd, count - 1)
        elif fd >= 0:
            os.close(fd)


def read_head(path: str | os.PathLike[str], size: int, offset: int = 0) -> bytes:
    """``size`` bytes of ``path`` from ``offset``. Raises OSError, NotRegularFile when the path
    is not a regular file; never blocks (a FIFO put in the file's place is not read)."""
    st = os.stat(path)
    with _lock:
        held = _held.get((st.st_dev, st.st_ino))
        if held is not None:
            return os.pread(held[0], size, offset)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegularFile(f"{Path(path)} is not a regular file")
        return os.pread(fd, size, offset)
    finally:
        os.close(fd)
