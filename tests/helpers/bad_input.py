"""What the bad-input tests share: the one-line error they expect, a short real recording to
act on, and a small disk that fills up."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.conftest import run_td
from tests.helpers.engines import not_root, require_engine


def one_error_line(result: subprocess.CompletedProcess) -> str:
    """The single ``torchdoctor: error:`` line of a refused command (exit 2, nothing else)."""
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("torchdoctor: error: "), result.stderr
    return lines[0]


def record_short_job(path: Path) -> Path:
    """``torchdoctor run --out PATH -- python -c pass``, for real: a recording to point at."""
    res = run_td("run", "--quiet", "--out", str(path), "--", sys.executable, "-c", "pass")
    assert res.returncode == 0, res.stderr
    return path


@contextmanager
def small_tmpfs(folder: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (mount's ``size=``) mounted on the new folder ``folder``: a disk
    that fills up. Needs root and mount; skips (fails on CI) without them."""
    require_engine("root", not_root())
    folder.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        require_engine("tmpfs", f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    require_engine("tmpfs", None)
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)
