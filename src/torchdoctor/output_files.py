"""The one way torchdoctor writes a file the user named (``report -o``, ``sbatch -o``,
``estimate --memory-snapshot``, the files of ``export --out-dir``).

The rules, the same for every such file:

- An existing file is replaced only with ``--force`` (``force=True``), or when it is a file
  torchdoctor wrote of the same kind (``ours``: an HTML report, an sbatch script), which the
  command would write again anyway.
- A torchdoctor recording is never replaced, even with ``--force``: it is someone's data, and
  it cannot be made again. Nor is a SQLite file with a ``-wal`` beside it (a database in use).
- Only a regular file is ever replaced: never a folder, a device, a FIFO or a socket (as root,
  ``report -o /dev/full`` replaced the machine's device node with an HTML file).
- Symlinks are followed: a link to a file is written through (the file it points to is
  replaced, the link stays), and every rule above applies to what the link points to.
- The text is written to a temporary file in the target's folder, flushed to disk (fsync) and
  renamed over the target, so a full disk or an interrupt never leaves half a file, and an
  existing file is either the old one whole or the new one whole. A new file is linked into
  place (``link`` fails where a file appeared meanwhile), so a file created between the check
  and the write is not replaced either.
- A new file gets ``mode`` less the umask. A replaced file keeps its own mode: the tool never
  changes the permissions of a file it did not create (an sbatch script is executable only
  when torchdoctor creates it).
- Text is encoded as UTF-8 with ``errors`` (``surrogateescape`` by default): a command line
  recorded with bytes that are not UTF-8 (``café.csv`` under Latin-1) is written back as those
  bytes instead of failing.

Every refusal is a :class:`~torchdoctor.errors.ParameterError` (a UserError) of one line that
names the option the user gave (``option``), so it says what to change; a library function
passes its parameter's name, which an interface rewords as its flag.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

from torchdoctor.errors import ParameterError, literal

# The first bytes of every SQLite file, and where the application id sits in its header: a
# torchdoctor recording's is "TDoc" (recording.schema.APPLICATION_ID; this leaf cannot import
# the recording floor, tests/test_output_files.py checks the two agree).
_SQLITE_MAGIC = b"SQLite format 3\x00"
_APPLICATION_ID_AT = slice(68, 72)
RECORDING_APPLICATION_ID = 0x54446F63
# How much of an existing file ``ours`` is shown to decide whether torchdoctor wrote it.
HEAD_BYTES = 4096

_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
)


def file_kind(mode: int) -> str | None:
    """What a file of ``mode`` is, in words ("a folder", "a character device"), or None for
    a regular file (and a kind not named here): the words of every refusal of such a file."""
    return next((kind for is_kind, kind in _KINDS if is_kind(mode)), None)


def _error(option: str, template: str, **values: str) -> ParameterError:
    """One line from ``template``, whose ``{option}`` fields name the option and whose other
    fields are ``values`` (user text, taken literally). A ParameterError, so that an interface
    rewords a library caller's parameter (``memory_snapshot`` -> ``--memory-snapshot``)."""
    words = {key: literal(value) for key, value in values.items()}
    return ParameterError(
        template.format(option="{}", **words), *([option] * template.count("{option}"))
    )


def _cannot(option: str, shown: str, exc: OSError) -> ParameterError:
    """A write that the system refused: a full disk, no permission, a name too long."""
    full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
    return _error(
        option,
        "{option} {path}: cannot write it: {why}; "
        + ("free some space or choose another {option}" if full else "choose another {option}"),
        path=repr(shown),
        why=exc.strerror or str(exc),
    )


def is_recording_head(head: bytes) -> bool:
    """Whether ``head`` (a file's first 100 bytes or more) is a torchdoctor recording's."""
    return (
        head.startswith(_SQLITE_MAGIC)
        and int.from_bytes(head[_APPLICATION_ID_AT], "big") == RECORDING_APPLICATION_ID
    )


def check_output_file(
    path: str | os.PathLike[str],
    option: str,
    *,
    force: bool = False,
    ours: Callable[[bytes], bool] | None = None,
) -> Path:
    """Check now that ``path`` may be written (before any long work); the file to write.

    Symlinks are resolved: the path returned is the file a link points to. Raises UserError
    for a place that is refused (see the module's rules) or unusable (a missing folder, a
    parent that is a file, no permission)."""
    shown = os.fspath(path)
    if not shown:
        raise _error(option, "{option} is empty: give it a file name")
    target = Path(os.path.realpath(shown))
    try:
        st = os.stat(target)
    except FileNotFoundError:
        st = None
    except NotADirectoryError:
        blocker = _first_non_folder(target.parent)
        raise _error(
            option,
            "{option} {path}: {blocker} is a file, not a folder; "
            "give {option} a path in an existing folder",
            path=repr(shown),
            blocker=repr(str(blocker)),
        ) from None
    except OSError as exc:
        raise _cannot(option, shown, exc) from None
    if st is None:
        folder = target.parent
        if not folder.is_dir():
            raise _error(
                option,
                "{option} {path}: the folder {folder} does not exist; "
                "create it or choose another {option}",
                path=repr(shown),
                folder=repr(str(folder)),
            )
        if not os.access(folder, os.W_OK | os.X_OK):
            raise _error(
                option,
                "{option} {path}: the folder {folder} is not writable; choose another {option}",
                path=repr(shown),
                folder=repr(str(folder)),
            )
        return target
    kind = file_kind(st.st_mode)
    if kind is not None:
        raise _error(
            option,
            "{option} {path} is {kind}, not a file; choose another {option}",
            path=repr(shown),
            kind=kind,
        )
    head = _head(target)
    # A SQLite file with its write-ahead log beside it is open in some program (a recording
    # from before the schema went into the main file holds all of it in the WAL): not ours to
    # replace either.
    in_use = head.startswith(_SQLITE_MAGIC) and os.path.exists(f"{target}-wal")
    if is_recording_head(head) or in_use:
        raise _error(
            option,
            "{option} {path} is {what}, which is never replaced (not even with --force); "
            "choose another {option}",
            path=repr(shown),
            what="a torchdoctor recording"
            if is_recording_head(head)
            else "a SQLite database in use (its -wal file is beside it)",
        )
    if not force and not (ours is not None and ours(head)):
        raise _error(
            option,
            "{option} {path} already exists; add --force to replace it, or choose another {option}",
            path=repr(shown),
        )
    return target


@contextlib.contextmanager
def open_output_file(
    path: str | os.PathLike[str],
    option: str,
    *,
    force: bool = False,
    ours: Callable[[bytes], bool] | None = None,
    mode: int = 0o644,
    binary: bool = False,
    errors: str = "surrogateescape",
    newline: str | None = None,
) -> Iterator[IO]:
    """A file to write ``path`` through: a temporary file in its folder, put in place (fsync,
    then link or rename) when the block ends without an exception, removed when it raises.

    ``path`` is checked first with :func:`check_output_file` (``force`` and ``ours`` as
    there). ``binary`` gives a bytes file; otherwise UTF-8 text with ``errors`` and
    ``newline`` as :func:`open` takes them. A write that fails (a full disk) is one UserError
    naming ``option``, and leaves nothing behind."""
    target = check_output_file(path, option, force=force, ours=ours)
    shown = os.fspath(path)
    try:
        existing: os.stat_result | None = os.stat(target)
    except FileNotFoundError:
        existing = None
    except OSError as exc:  # checked just now; something changed under us
        raise _cannot(option, shown, exc) from None
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")
    try:
        # O_EXCL: never write into something already there; the kernel applies the umask.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    except OSError as exc:
        raise _cannot(option, shown, exc) from None
    try:
        if existing is not None:
            # The replacement keeps the replaced file's permissions (and owner, as root).
            os.fchmod(fd, stat.S_IMODE(existing.st_mode))
            with contextlib.suppress(OSError):
                os.fchown(fd, existing.st_uid, existing.st_gid)
        if binary:
            handle: IO = os.fdopen(fd, "wb")
        else:
            handle = os.fdopen(fd, "w", encoding="utf-8", errors=errors, newline=newline)
        with handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        _put_in_place(tmp, target, replace=existing is not None, shown=shown, option=option)
    except OSError as exc:
        _remove(tmp)
        raise _cannot(option, shown, exc) from None
    except BaseException:
        _remove(tmp)
        raise


def write_output_file(
    path: str | os.PathLike[str],
    content: str | bytes,
    option: str,
    *,
    force: bool = False,
    ours: Callable[[bytes], bool] | None = None,
    mode: int = 0o644,
    errors: str = "surrogateescape",
) -> Path:
    """Write ``content`` (text or bytes) to ``path`` by the module's rules; the file written
    (a symlink's target)."""
    binary = isinstance(content, bytes)
    with open_output_file(
        path, option, force=force, ours=ours, mode=mode, binary=binary, errors=errors
    ) as handle:
        handle.write(content)
    return Path(os.path.realpath(path))


def _put_in_place(tmp: Path, target: Path, *, replace: bool, shown: str, option: str) -> None:
    if replace:
        os.replace(tmp, target)
    else:
        try:
            os.link(tmp, target)  # fails where a file appeared since the check: not replaced
        except FileExistsError:
            raise _error(
                option,
                "{option} {path} was created by someone else while this was written; "
                "choose another {option}",
                path=repr(shown),
            ) from None
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                raise
            # A file system without hard links (some FUSE and FAT mounts): rename instead.
            os.replace(tmp, target)
        else:
            os.unlink(tmp)
    # The rename itself is on disk only once the folder is (ext4 and XFS order it anyway).
    with contextlib.suppress(OSError):
        dir_fd = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _head(target: Path) -> bytes:
    try:
        # O_NONBLOCK: the checks above exclude FIFOs, but a file swapped for one must not hang.
        fd = os.open(target, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return b""  # unreadable (write-only): it is not known to be a recording or ours
    try:
        return os.read(fd, HEAD_BYTES)
    except OSError:
        return b""
    finally:
        os.close(fd)


def _first_non_folder(folder: Path) -> Path:
    """The nearest ancestor of ``folder`` (itself included) that exists and is no folder."""
    for candidate in reversed((folder, *folder.parents)):
        if candidate.exists() and not candidate.is_dir():
            return candidate
    return folder


def _remove(tmp: Path) -> None:
    with contextlib.suppress(OSError):
        tmp.unlink()
