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


@pytest.fixture
def memory_cgroup():
    """A fresh memory cgroup limited to 400 MiB (swap too), removed after the test; skipped
    where cgroups cannot be made (not root, read-only cgroupfs), but required when CI=true."""
    import os
    import uuid

    from torchdoctor.run.cgroup import MemoryCgroup

    try:
        group = MemoryCgroup.create(f"test-{uuid.uuid4().hex[:8]}", 400 * 2**20)
    except OSError as exc:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip(f"cannot make a memory cgroup here (root and a writable cgroupfs): {exc}")
    yield group
    group.remove(timeout_s=10.0)


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


@pytest.fixture
def runtime_dir(tmp_path, monkeypatch):
    """A private registry of recorded jobs for this test (``XDG_RUNTIME_DIR``), seen by the
    test, the jobs it starts and the `torchdoctor top` it runs."""
    folder = tmp_path / "xdg-runtime"
    folder.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(folder))
    return folder
