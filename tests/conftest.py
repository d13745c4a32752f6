"""Shared fixtures: running the real `torchdoctor` command in a child process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TORCHDOCTOR = [sys.executable, "-m", "torchdoctor"]


def run_td(
    *args: str, cwd: Path | None = None, input: str | None = None, timeout: float = 120, env=None
):
    """Run `torchdoctor ARGS...` to completion; a CompletedProcess with text output."""
    return subprocess.run(
        [*TORCHDOCTOR, *args],
        cwd=cwd,
        input=input,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.fixture
def td():
    return run_td


@pytest.fixture
def runtime_dir(tmp_path, monkeypatch):
    """A private registry of recorded jobs for this test (``XDG_RUNTIME_DIR``), seen by the
    test, the jobs it starts and the `torchdoctor top` it runs."""
    folder = tmp_path / "xdg-runtime"
    folder.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(folder))
    return folder
