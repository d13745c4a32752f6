"""Where a user's queue lives: ``$XDG_STATE_HOME/torchdoctor/`` (state, logs, recordings) and
``$XDG_RUNTIME_DIR/torchdoctor/`` (the scheduler's socket), both private to the user."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class QueuePaths:
    state_dir: Path
    runtime_dir: Path

    @property
    def db(self) -> Path:
        return self.state_dir / "queue.sqlite"

    @property
    def lock(self) -> Path:
        """Held by the one scheduler of this user for as long as it runs."""
        return self.state_dir / "queue-scheduler.lock"

    @property
    def socket(self) -> Path:
        return self.runtime_dir / "queue.sock"

    @property
    def jobs_dir(self) -> Path:
        return self.state_dir / "queue"

    @property
    def scheduler_log(self) -> Path:
        return self.jobs_dir / "scheduler.log"

    def log(self, job_id: int) -> Path:
        return self.jobs_dir / "logs" / f"{job_id}.log"

    def recording(self, job_id: int, name: str) -> Path:
        return self.jobs_dir / "recordings" / f"{job_id}-{name}.sqlite"

    def make(self) -> None:
        """Create the folders, readable by this user only."""
        for folder in (
            self.state_dir,
            self.runtime_dir,
            self.jobs_dir / "logs",
            self.jobs_dir / "recordings",
        ):
            folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        for folder in (self.state_dir, self.runtime_dir, self.jobs_dir):
            os.chmod(folder, 0o700)


def queue_paths(env: Mapping[str, str] | None = None) -> QueuePaths:
    """This user's queue, from the XDG base directory variables (as the spec defines them)."""
    env = os.environ if env is None else env
    home = Path(env.get("HOME") or os.path.expanduser("~"))
    state_home = Path(env.get("XDG_STATE_HOME") or home / ".local" / "state")
    state = state_home / "torchdoctor"
    runtime = env.get("XDG_RUNTIME_DIR")
    return QueuePaths(state, Path(runtime) / "torchdoctor" if runtime else state)
