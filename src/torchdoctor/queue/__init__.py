"""The local queue: several jobs on one machine, each with its own GPUs, cores and memory.

- :mod:`.store` the durable state (SQLite, WAL) and :mod:`.model` a job in it;
- :mod:`.machine` what the machine has now, :mod:`.placement` where waiting jobs go;
- :mod:`.scheduler` the per-user daemon, :mod:`.supervisor` the keeper of one job;
- :mod:`.client` what the commands do; :func:`last_run_of` a command's last recorded run.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Job", "Queue", "Request", "last_run_of"]


def __getattr__(name: str) -> Any:
    # Lazy, so that `python -m torchdoctor.queue.scheduler` (or .supervisor)
    # does not import its own module twice through the package.
    if name == "Job":
        from torchdoctor.queue.model import Job

        return Job
    if name in ("Queue", "Request", "last_run_of"):
        from torchdoctor.queue import client

        return getattr(client, name)
    raise AttributeError(name)
