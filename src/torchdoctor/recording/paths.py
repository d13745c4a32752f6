"""Where recordings go by default: ``./torchdoctor-runs/<UTC time>-<name>.sqlite``."""

from __future__ import annotations

import re
import time
from pathlib import Path

RUNS_FOLDER = Path("torchdoctor-runs")


def default_recording_path(name: str, now: float | None = None) -> Path:
    """A new file name in ./torchdoctor-runs/ that no earlier recording holds."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("._") or "job"
    path = RUNS_FOLDER / f"{stamp}-{safe}.sqlite"
    n = 2
    while path.exists():
        path = RUNS_FOLDER / f"{stamp}-{safe}-{n}.sqlite"
        n += 1
    return path
