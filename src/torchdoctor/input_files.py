"""The one way torchdoctor reads a small text file the user named (``--thresholds FILE``,
``$TORCHDOCTOR_THRESHOLDS``, config.toml, pyproject.toml): the counterpart of
:mod:`torchdoctor.output_files` for settings read whole.

The rules:

- Only a regular file is read: a folder, a device, a FIFO or a socket is refused in one line
  (``--thresholds /dev/zero`` read to its end took tens of GiB; opening a FIFO for reading
  waits for a writer forever). The file is opened without blocking and checked on the open
  descriptor, so a FIFO put in its place after a check cannot hang the read either.
- At most ``limit`` bytes: a settings file is a few KiB; a bigger one is refused, not read.
- Every failure of the system (no such file, no permission, a name too long) is a
  :class:`~torchdoctor.errors.UserError` of one line that says which file, not an OSError.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from torchdoctor.errors import UserError
from torchdoctor.output_files import file_kind
from torchdoctor.units import fmt_bytes

# A settings file of 1 MiB is already hundreds of times any real one.
SETTINGS_LIMIT = 1 << 20


def open_regular_file(path: str | os.PathLike[str], what: str) -> int:
    """A descriptor open for reading on the regular file ``path`` (``what`` it is, for the
    message), opened without blocking and checked on the descriptor; else a one-line
    UserError. The caller closes it."""
    shown = repr(str(path))
    try:
        fd = os.open(Path(path), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise UserError(f"no such {what}: {shown}") from None
    except OSError as exc:
        raise UserError(f"cannot read the {what} {shown}: {exc.strerror or exc}") from None
    try:
        mode = os.fstat(fd).st_mode
    except OSError as exc:
        os.close(fd)
        raise UserError(f"cannot read the {what} {shown}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = file_kind(mode) or "not a regular file"
        raise UserError(f"the {what} {shown} is {kind}, not a file: give the path of a file")
    return fd


def read_small_file(path: str | os.PathLike[str], what: str, limit: int = SETTINGS_LIMIT) -> bytes:
    """The bytes of the regular file ``path`` (``what`` it is, for the message: "thresholds
    file"), at most ``limit`` of them; else a one-line UserError."""
    shown = repr(str(path))
    fd = open_regular_file(path, what)
    try:
        # One byte past the limit tells a file at the limit from a bigger one (st_size may lie
        # for a file still growing or on /proc).
        data = bytearray()
        while len(data) <= limit:
            chunk = os.read(fd, limit + 1 - len(data))
            if not chunk:
                break
            data += chunk
    except OSError as exc:
        raise UserError(f"cannot read the {what} {shown}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise UserError(
            f"the {what} {shown} is larger than {fmt_bytes(limit)}: it cannot be a settings "
            "file; give the right path"
        )
    return bytes(data)
