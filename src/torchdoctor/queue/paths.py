"""Where a user's queue lives: ``$XDG_STATE_HOME/torchdoctor/`` (state, logs, recordings) and
``$XDG_RUNTIME_DIR/torchdoctor/`` (the scheduler's socket), both private to the user."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from torchdoctor.errors import UserError


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
        """Create the folders, readable by this user only. A folder that cannot be made (a
        variable naming a file, a read-only disk) is the user's to fix: a UserError naming the
        variable that chose it."""
        for folder in (
            self.state_dir,
            self.runtime_dir,
            self.jobs_dir / "logs",
            self.jobs_dir / "recordings",
        ):
            self._make(folder, lambda f: f.mkdir(parents=True, exist_ok=True, mode=0o700))
        for folder in (self.state_dir, self.runtime_dir, self.jobs_dir):
            self._make(folder, lambda f: os.chmod(f, 0o700))

    def _make(self, folder: Path, action: Callable[[Path], None]) -> None:
        try:
            action(folder)
        except OSError as exc:
            if folder == self.runtime_dir and self.runtime_dir != self.state_dir:
                where = "XDG_RUNTIME_DIR"
            else:
                where = "XDG_STATE_HOME"
            raise UserError(
                f"the queue's folder {folder} cannot be made ({exc.strerror or exc}): "
                f"set {where} to a folder you can write"
            ) from None


def queue_paths(env: Mapping[str, str] | None = None) -> QueuePaths:
    """This user's queue, from the XDG base directory variables (as the spec defines them: a
    relative value is invalid and ignored, else the queue would change with the cwd)."""
    env = os.environ if env is None else env
    home = Path(env.get("HOME") or os.path.expanduser("~"))
    state_home = _absolute(env.get("XDG_STATE_HOME")) or home / ".local" / "state"
    state = state_home / "torchdoctor"
    runtime = _absolute(env.get("XDG_RUNTIME_DIR"))
    return QueuePaths(state, runtime / "torchdoctor" if runtime else state)


def _absolute(value: str | None) -> Path | None:
    return Path(value) if value and os.path.isabs(value) else None
