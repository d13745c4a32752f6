"""Real process trees for the sampling tests (see tests/helpers/jobtree.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HELPERS = Path(__file__).resolve().parent.parent / "helpers"


class JobTree:
    """A running ``jobtree.py`` root process and its command channel."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HELPERS / "jobtree.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.pid = self.proc.pid

    def ask(self, *words: object) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(" ".join(str(w) for w in words) + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise RuntimeError(f"jobtree exited with {self.proc.wait()} on {words!r}")
        return answer.strip()

    def fork(self, kind: str = "idle") -> int:
        return int(self.ask("fork", kind))

    def close(self) -> None:
        # End of input ends the root, which tells its children to exit and reaps them.
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@pytest.fixture
def jobtree():
    trees: list[JobTree] = []

    def start(env: dict[str, str] | None = None) -> JobTree:
        tree = JobTree(env)
        trees.append(tree)
        return tree

    yield start
    for tree in trees:
        tree.close()


@pytest.fixture(autouse=True)
def _readers_closed(monkeypatch):
    """Close every reader a test made: each keeps descriptors open, and a pytest process that
    accumulates hundreds of them makes the descriptor-budget tests meaningless."""
    from torchdoctor.sampling.host import HostReader
    from torchdoctor.sampling.job import JobReader

    made = []
    for cls in (HostReader, JobReader):
        init = cls.__init__

        def tracked(self, *args, _init=init, **kwargs):
            _init(self, *args, **kwargs)
            made.append(self)

        monkeypatch.setattr(cls, "__init__", tracked)
    yield
    for reader in made:
        reader.close()
