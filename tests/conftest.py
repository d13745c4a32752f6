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


# -- engines: a test that needs one skips without it, fails without it on CI (helpers/engines) --


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "engine(name, why_missing): the test drives this engine (tests/helpers/engines)"
    )


def pytest_runtest_setup(item):
    from tests.helpers.engines import require_engine

    for mark in item.iter_markers("engine"):
        require_engine(*mark.args)


def pytest_terminal_summary(terminalreporter):
    from tests.helpers.engines import summary

    terminalreporter.write_line(summary())
