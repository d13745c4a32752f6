"""Shared fixtures: running the real `torchdoctor` command in a child process."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
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


@dataclass(frozen=True)
class PrivateFolders:
    """The folders outside its own arguments that torchdoctor reads or writes, each private to
    one test (or, for fixtures broader than a test, to the session)."""

    config_home: Path  # XDG_CONFIG_HOME: the user's config.toml
    state_home: Path  # XDG_STATE_HOME: the user's queue (state, logs, recordings)
    runtime_dir: Path  # XDG_RUNTIME_DIR: the user's queue socket, the registry of jobs
    system_dir: Path  # TORCHDOCTOR_SYSTEM_DIR: the machine-wide queue (/var/lib/torchdoctor)
    queue_config: Path  # TORCHDOCTOR_QUEUE_CONFIG: its limits (/etc/torchdoctor/queue.toml)


# Settings of the tester's that would steer a test's torchdoctor. TORCHDOCTOR_RUNS_DIR is
# removed rather than set: the tests rely on the default, ./torchdoctor-runs of their cwd.
USER_SETTINGS = ("RUNS_DIR", "INTERVAL", "THRESHOLDS", "EXPORTER_LISTEN")


@contextlib.contextmanager
def private_folders(make_folder: Callable[[str], Path]) -> Iterator[PrivateFolders]:
    """Point every variable that steers a machine or user folder of torchdoctor at fresh
    folders, and remove the tester's own settings, for as long as the block runs. A machine
    with a machine-wide queue installed (live, or dead with its socket left in
    /var/lib/torchdoctor) or a user with a queue of their own must not change a test's result.

    The runtime and system folders hold Unix sockets, whose paths must stay under 108 bytes:
    they live in a short folder of the temporary directory, not in pytest's deep tmp_path."""
    short = Path(tempfile.mkdtemp(prefix="tdh-"))
    folders = PrivateFolders(
        config_home=make_folder("config"),
        state_home=make_folder("state"),
        runtime_dir=short / "run",
        system_dir=short / "sys",
        queue_config=short / "sys" / "queue.toml",  # absent: no limits, as on a fresh machine
    )
    # The runtime folder exists and is the user's alone, as the XDG spec promises (the registry
    # falls back to /tmp/torchdoctor-UID without it); the system folder does not exist, as on a
    # machine without a machine-wide queue.
    folders.runtime_dir.mkdir(mode=0o700)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CONFIG_HOME", str(folders.config_home))
        mp.setenv("XDG_STATE_HOME", str(folders.state_home))
        mp.setenv("XDG_RUNTIME_DIR", str(folders.runtime_dir))
        mp.setenv("TORCHDOCTOR_SYSTEM_DIR", str(folders.system_dir))
        mp.setenv("TORCHDOCTOR_QUEUE_CONFIG", str(folders.queue_config))
        for name in USER_SETTINGS:
            mp.delenv(f"TORCHDOCTOR_{name}", raising=False)
        try:
            yield folders
        finally:
            shutil.rmtree(short, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def _private_session_folders(tmp_path_factory) -> Iterator[PrivateFolders]:
    """For session and module fixtures (a job started once for a whole module), which set up
    before any test's own folders exist."""
    with private_folders(tmp_path_factory.mktemp) as folders:
        yield folders


@pytest.fixture(autouse=True)
def hermetic(_private_session_folders, tmp_path_factory) -> Iterator[PrivateFolders]:
    """Each test's own folders (see :func:`private_folders`); a test that needs to know where
    they are asks for this fixture by name."""
    with private_folders(tmp_path_factory.mktemp) as folders:
        yield folders


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
