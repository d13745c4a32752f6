"""What the recordings of jobs under ``torchdoctor run`` say right now: step rate, data wait,
findings.

The recorder announces each recording in :mod:`torchdoctor.live.registry`. Step figures come
from the recent rows of the ``steps`` table (read-only SQLite queries, the recorder keeps
writing); findings from the diagnosis, re-run on a slower tier because it reads the whole
recording. Both are optional: a recording without steps (no instrumentation) or a
torchdoctor without the diagnosis still shows what it can, with the reason for the rest.
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path

from torchdoctor.live.model import FindingBrief, RecordingStatus
from torchdoctor.thresholds import Thresholds

WINDOW_S = 10.0  # step rate and data wait are over the steps that ended in this window
FINDINGS_EVERY_S = 10.0


@dataclass(slots=True)
class _Watched:
    path: Path
    db: sqlite3.Connection | None
    error: str | None
    findings: list[FindingBrief] = field(default_factory=list)
    findings_error: str | None = None
    findings_due: float = 0.0


class RecordingWatcher:
    """Keeps the recordings of active jobs open and summarizes their recent steps."""

    def __init__(self, thresholds: Thresholds, *, window_s: float = WINDOW_S) -> None:
        self.thresholds = thresholds
        self.window_s = window_s
        self._watched: dict[Path, _Watched] = {}

    def status(self, path: Path, now: float | None = None) -> RecordingStatus:
        now = time.time() if now is None else now
        w = self._watched.get(path)
        if w is None:
            w = self._open(path)
            self._watched[path] = w
        status = RecordingStatus(
            path=str(path),
            steps=0,
            step_rate_per_s=None,
            samples_per_s=None,
            data_wait_share=None,
            window_s=self.window_s,
        )
        if w.db is None:
            status.unavailable["steps"] = w.error or "recording not readable"
            return status
        try:
            self._steps(w.db, now, status)
        except sqlite3.Error as exc:
            status.unavailable["steps"] = f"cannot read the steps of {path}: {exc}"
        self._refresh_findings(w, now)
        status.findings = list(w.findings)
        if w.findings_error:
            status.unavailable["findings"] = w.findings_error
        return status

    def forget_except(self, keep: set[Path]) -> None:
        """Close the recordings of jobs that are no longer running."""
        for path in list(self._watched):
            if path not in keep:
                w = self._watched.pop(path)
                if w.db is not None:
                    w.db.close()

    def close(self) -> None:
        self.forget_except(set())

    # -- internals ------------------------------------------------------------------------

    def _open(self, path: Path) -> _Watched:
        from torchdoctor.errors import UserError
        from torchdoctor.recording.reader import open_recording

        try:
            # Validates that this is a recording this torchdoctor can read.
            open_recording(path).close()
            db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
        except (UserError, sqlite3.Error, OSError) as exc:
            return _Watched(path, None, getattr(exc, "message", None) or str(exc))
        return _Watched(path, db, None)

    def _steps(self, db: sqlite3.Connection, now: float, status: RecordingStatus) -> None:
        status.steps = db.execute("SELECT COUNT(*) FROM steps").fetchone()[0]
        if status.steps == 0:
            status.unavailable["steps"] = (
                "no step recorded yet (is the training loop instrumented?)"
            )
            return
        rows = db.execute(
            "SELECT pid, t_end, wall_s, data_wait_s, samples FROM steps WHERE t_end >= ? "
            "ORDER BY t_end",
            (now - self.window_s,),
        ).fetchall()
        if not rows:
            # Steps were recorded but none lately: the job is stalled (or between phases).
            status.step_rate_per_s = 0.0
            status.samples_per_s = 0.0
            return
        by_pid: dict[int, list[tuple]] = {}
        for row in rows:
            by_pid.setdefault(row[0], []).append(row)
        rates, sample_rates, shares = [], [], []
        for steps in by_pid.values():
            wall = sum(r[2] for r in steps)
            if wall > 0:
                # Steps per second of this process's own time: sum of step walls covers the window
                # without the gap before the first step in it.
                rates.append(len(steps) / wall)
                shares.append(sum(r[3] for r in steps) / wall)
                samples = [r[4] for r in steps]
                if all(s is not None for s in samples):
                    sample_rates.append(sum(samples) / wall)
        if rates:
            # Ranks step in lock-step: the rate of one process is the job's step rate.
            status.step_rate_per_s = sum(rates) / len(rates)
            # The most starved process is the one that matters.
            status.data_wait_share = max(shares)
        if sample_rates and len(sample_rates) == len(rates):
            status.samples_per_s = sum(sample_rates)

    def _refresh_findings(self, w: _Watched, now: float) -> None:
        if now < w.findings_due:
            return
        w.findings_due = now + FINDINGS_EVERY_S
        try:
            from torchdoctor.diagnosis.engine import diagnose
        except ImportError:
            w.findings_error = "the diagnosis is not part of this torchdoctor installation"
            return
        from torchdoctor.recording.reader import open_recording

        try:
            with open_recording(w.path) as rec:
                found = diagnose(rec, self.thresholds)
        except Exception as exc:  # a diagnosis failure must never take the live view down
            w.findings_error = f"diagnosis failed: {type(exc).__name__}: {exc}"
            return
        w.findings_error = None
        w.findings = [
            FindingBrief(
                id=f.id, severity=f.severity, title=f.title, recommendation=f.recommendation
            )
            for f in found
        ]
