"""torchdoctor's own stdout and stderr, which may break under it without changing its result.

`torchdoctor run -- job 2>&1 | head -1`, a log collector that dies, stderr on a full disk
(ENOSPC) or closed (`2>&-`): a failing write of one of our own lines must not turn the job's
exit status into 1, and `show ... | head -1` must not fail because the reader had enough. The
entry point (:func:`torchdoctor.cli.main`) replaces both streams once by a
:class:`DroppingStream` on a private copy of the descriptor: the first write or flush that
fails for good marks it broken, points that copy at /dev/null (so the interpreter's last flush
at exit cannot fail either: Python would exit 120, or print "Exception ignored") and drops
everything written after, never trying the broken stream again. The command then runs to its
end and exits with the status it would have had.

Only torchdoctor's own writes are concerned: a job started by `run`, `attach` or `launch` has
its own copy of the descriptors, which this never touches.
"""

from __future__ import annotations

import errno
import io
import os
import sys
from typing import IO, Any

# Errors that mean "this stream takes no more output": the reader went away (EPIPE), the disk
# under it is full or over quota (ENOSPC, EDQUOT, EFBIG), the descriptor is closed (EBADF),
# the terminal hung up (EIO).
BROKEN = frozenset({errno.EPIPE, errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EBADF, errno.EIO})


def is_broken_output(exc: BaseException) -> bool:
    """Whether ``exc`` says an output stream takes no more output (see :data:`BROKEN`)."""
    return isinstance(exc, OSError) and exc.errno in BROKEN


class DroppingStream:
    """A text stream that drops what is written once a write to it has failed for good.

    Everything else (``encoding``, ``isatty``, ``fileno``, ``buffer``...) is the wrapped
    stream's, so rich and click treat it as the real one."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self.broken: OSError | None = None

    def write(self, text: str) -> int:
        if self.broken is None:
            try:
                return self._stream.write(text)
            except UnicodeEncodeError:
                # A character the stream's encoding cannot take: a path of non-UTF-8 bytes
                # (a surrogate escape) on a UTF-8 terminal, or any non-ASCII one on an ASCII
                # one. Written as a backslash escape (\udcff), so a line that names such a
                # file is printed, whichever command prints it, instead of failing.
                encoding = getattr(self._stream, "encoding", None) or "utf-8"
                return self.write(text.encode(encoding, "backslashreplace").decode(encoding))
            except OSError as exc:
                self._break(exc)
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if self.broken is None:
            try:
                self._stream.flush()
            except OSError as exc:
                self._break(exc)

    def _break(self, exc: OSError) -> None:
        if not is_broken_output(exc):
            raise exc
        self.broken = exc
        # What is still buffered would fail again at every later flush, the interpreter's
        # last one included: our private descriptor now leads to /dev/null, so it goes there.
        try:
            fd = self._stream.fileno()
            null = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(null, fd, inheritable=False)
            finally:
                os.close(null)
            self._stream.flush()
        except (OSError, ValueError):  # no descriptor (a test's StringIO), or still failing
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def guard_standard_streams() -> None:
    """Replace sys.stdout and sys.stderr by :class:`DroppingStream` (once).

    Each writes to a private, non-inheritable copy of descriptor 1 or 2, so that pointing a
    broken one at /dev/null never changes the descriptors a job started later inherits (its
    output goes where the user sent it, broken or not). A stream Python found closed at start
    (``2>&-``: sys.stderr is None) becomes /dev/null, again not inherited: otherwise rich and
    ``print(file=None)`` fall back to stdout and our messages would land in the job's output.
    """
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if isinstance(stream, DroppingStream):
            continue
        setattr(sys, name, DroppingStream(_private_copy(stream)))


def _private_copy(stream: IO[str] | None) -> IO[str]:
    """A text stream like ``stream`` on a copy of its descriptor; ``stream`` itself when it has
    no descriptor (a test's capture); /dev/null when it is missing or its descriptor closed."""
    # The streams made here replace a standard stream for the rest of the process: never closed.
    if stream is None:
        return open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
        return stream
    try:
        stream.flush()
        fd = os.dup(fd)
    except OSError:  # a descriptor closed under Python
        return open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115
    return io.TextIOWrapper(
        open(fd, "wb"),  # noqa: SIM115
        encoding=stream.encoding,
        errors=stream.errors,
        line_buffering=getattr(stream, "line_buffering", False),
        write_through=getattr(stream, "write_through", False),
    )
