"""Where recordings go, and how a recording file is created so that no two runs share one.

By default ``<recordings folder>/<UTC time>-<name>.sqlite``, the folder being the one
:func:`torchdoctor.config.runs_dir` names (``$TORCHDOCTOR_RUNS_DIR``, the config files, else
``./torchdoctor-runs``). Names are decided by the create
itself (``O_CREAT | O_EXCL``): of several runs started in the same second with the same
command, each gets its own file (``-2``, ``-3``... on collisions), on local disks and NFS
alike. Everything that starts a recording (run, attach, watch, tune trials, the queue) calls
:func:`create_recording_file` or :func:`claim_recording_file`.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

from torchdoctor.config import DEFAULT_RUNS_DIR, runs_dir_setting
from torchdoctor.config import runs_dir as runs_dir  # re-exported: callers import it from here
from torchdoctor.errors import UserError

RUNS_FOLDER = DEFAULT_RUNS_DIR  # the built-in default; runs_dir() is the folder in use
SUFFIX = ".sqlite"
_MAX_TRIES = 10_000


def safe_name(name: str) -> str:
    """``name`` cut down to characters every file system and shell take without quoting."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("._") or "job"


def profile_folder(path: str | os.PathLike[str]) -> Path:
    """Where a recording's profiler traces go (and `torchdoctor profile`'s requests): its
    path without ``.sqlite``, plus ``.profile``; the folder is made by the first trace."""
    text = os.fspath(path)
    if text.endswith(SUFFIX):
        text = text[: -len(SUFFIX)]
    return Path(f"{text}.profile")


def create_recording_file(
    name: str,
    *,
    folder: str | os.PathLike[str] | None = None,
    now: float | None = None,
    stamp: bool = True,
    option: str = "--out",
) -> Path:
    """Create a new, empty recording file in ``folder`` and return its path.

    The name is ``<UTC time>-<name>.sqlite`` (``<name>.sqlite`` with ``stamp=False``), with
    ``-2``, ``-3``... added when that name is taken: taken means created by anyone, this
    instant included, because the file is created exclusively. ``option`` names the setting
    that moves the recording elsewhere, for the error message when ``folder`` is unusable.
    """
    chosen, setter = runs_dir_setting(folder)
    if setter is not None:
        option = f"{option} or change {setter}"
    where = prepare_folder(chosen, option)
    base = safe_name(name)
    if stamp:
        base = f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime(now))}-{base}"
    for n in range(1, _MAX_TRIES):
        path = where / (f"{base}{SUFFIX}" if n == 1 else f"{base}-{n}{SUFFIX}")
        if _create_exclusively(path, option):
            return path
    raise UserError(
        f"{_MAX_TRIES} recordings named {base!r} already exist in {str(where)!r}; "
        f"choose another place with {option}"
    )


def claim_recording_file(path: str | os.PathLike[str], option: str = "--out") -> Path:
    """Create the empty recording file ``path`` exactly (a name the user gave); it must be new.

    ``option`` is how the user named the path (the CLI's --out, an API argument), for the
    message that says what to change."""
    target = Path(path)
    prepare_folder(target.parent if str(target.parent) else Path("."), option)
    try:
        is_dir = target.is_dir()
    except OSError as exc:  # e.g. a name longer than the file system takes (ENAMETOOLONG)
        raise UserError(
            f"cannot create the recording {str(target)!r}: {exc.strerror}; "
            f"choose another name with {option}"
        ) from None
    if is_dir:
        raise UserError(f"{str(target)!r} is a folder; give {option} a file name ending in .sqlite")
    if not _create_exclusively(target, option):
        raise UserError(f"{str(target)!r} already exists; choose a new name with {option}")
    return target


@contextlib.contextmanager
def removed_if_unused(path: Path) -> Iterator[Path]:
    """Around the steps between creating a recording file and writing it: a failure there
    (bad options, a preflight error) leaves no empty file behind."""
    try:
        yield path
    except BaseException:
        with contextlib.suppress(OSError):
            if path.stat().st_size == 0:
                path.unlink()
        raise


def prepare_folder(folder: Path, option: str = "--out") -> Path:
    """Make ``folder`` (and its parents) exist and check that recordings can be created in it."""
    blocker = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise UserError(
            f"cannot create the output folder {str(folder)!r}: {str(blocker)!r} is a file, "
            f"not a folder; choose another place with {option}"
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(
            f"cannot create the output folder {str(folder)!r}: {exc.strerror}; "
            f"choose another place with {option}"
        ) from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(
            f"the output folder {str(folder)!r} is not writable; choose another place with {option}"
        )
    return folder


def create_unique_folder(base: str | os.PathLike[str], option: str = "--out") -> Path:
    """Create a new folder ``base``, or ``base-2``, ``base-3``...: the one this call made."""
    root = Path(base)
    prepare_folder(root.parent, option)
    for n in range(1, _MAX_TRIES):
        folder = root if n == 1 else root.with_name(f"{root.name}-{n}")
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            continue
        except OSError as exc:
            raise UserError(
                f"cannot create the folder {str(folder)!r}: {exc.strerror}; "
                f"choose another place with {option}"
            ) from None
    raise UserError(f"too many folders named {root.name!r} in {str(root.parent)!r}")


def _create_exclusively(path: Path, option: str) -> bool:
    """True when this call created ``path``; False when it already existed."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    except FileExistsError:
        return False
    except OSError as exc:
        raise UserError(
            f"cannot create the recording {str(path)!r}: {exc.strerror}; "
            f"choose another place with {option}"
        ) from None
    os.close(fd)
    return True
