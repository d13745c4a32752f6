"""Reading a recording that a test's `torchdoctor run` is still writing."""

from __future__ import annotations

import sqlite3
from pathlib import Path


def recorded_span(path: Path) -> float:
    """Seconds from the first to the last host sample recorded so far (0 before any)."""
    if not path.exists():
        return 0.0
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        row = db.execute("SELECT MIN(t), MAX(t) FROM host_samples").fetchone()
    except sqlite3.Error:  # the writer has not created its tables yet
        return 0.0
    finally:
        db.close()
    return (row[1] - row[0]) if row and row[0] is not None else 0.0
