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


@pytest.fixture(autouse=True)
def _no_user_settings(tmp_path_factory, monkeypatch):
    """The tester's own torchdoctor settings (~/.config/torchdoctor/config.toml,
    TORCHDOCTOR_* variables) must not steer the tests: an empty config folder for each."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.mktemp("config")))
    for name in ("RUNS_DIR", "INTERVAL", "THRESHOLDS", "EXPORTER_LISTEN"):
        monkeypatch.delenv(f"TORCHDOCTOR_{name}", raising=False)
