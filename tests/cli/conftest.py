"""A user with nothing set up yet: private config, state and recordings folders per test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import TORCHDOCTOR

PY = sys.executable


@dataclass
class User:
    home: Path
    env: dict[str, str]

    @property
    def runs(self) -> Path:
        return Path(self.env["TORCHDOCTOR_RUNS_DIR"])

    def td(self, *args: str, cwd: Path | None = None, timeout: float = 180, **kw):
        return subprocess.run(
            [*TORCHDOCTOR, *args],
            cwd=cwd or self.home,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=kw.pop("env", self.env),
            **kw,
        )

    def json(self, *args: str, **kw) -> dict:
        done = self.td(*args, **kw)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    def record(self, code: str, *extra: str) -> subprocess.CompletedProcess:
        """`torchdoctor run` of a tiny Python job; it must succeed as torchdoctor."""
        done = self.td("run", "--quiet", "--interval", "0.1", *extra, "--", PY, "-c", code)
        assert done.returncode in (0, 3), done.stderr
        return done


@pytest.fixture
def user(tmp_path: Path) -> User:
    home = tmp_path / "home"
    home.mkdir()
    env = {
        **os.environ,
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_STATE_HOME": str(home / ".local" / "state"),
        "XDG_RUNTIME_DIR": str(tmp_path / "runtime"),
        "TORCHDOCTOR_RUNS_DIR": str(tmp_path / "runs"),
        "TORCHDOCTOR_QUEUE_IDLE_EXIT_S": "30",  # a scheduler a test leaves goes away
    }
    return User(home, env)
