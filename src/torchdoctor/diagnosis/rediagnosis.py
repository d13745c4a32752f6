"""The findings of recordings still being written, re-run within a CPU budget.

The diagnosis reads the whole recording, which grows while the job runs, so whoever follows a
running job (``top``, the Prometheus endpoints) does not pay for it on every refresh: it re-runs
at most every :data:`EVERY_S`, sooner (:data:`EARLY_EVERY_S`) while it says it has too little
evidence (a job's first seconds), and less often when it gets slow, so that all followed
recordings together use at most :data:`CPU_SHARE` of one core on it. Between runs the last
findings stand; a run that fails keeps them and says why.
"""

from __future__ import annotations

import contextlib
import io
import time
from dataclasses import dataclass
from pathlib import Path

from torchdoctor.diagnosis.engine import diagnose
from torchdoctor.diagnosis.findings import Finding
from torchdoctor.recording.reader import open_recording
from torchdoctor.thresholds import Thresholds, load_thresholds

EVERY_S = 30.0
EARLY_EVERY_S = 5.0
CPU_SHARE = 0.005
TOO_EARLY = "short-recording"  # the finding that says the evidence is still too thin


@dataclass(slots=True)
class Rediagnosis:
    """The latest findings of one recording."""

    findings: list[Finding] | None = None  # None until a run succeeded
    # Why the latest run failed, or the first complaint of a rule it skipped; None when clean.
    error: str | None = None


class BudgetedDiagnosis:
    """Re-runs the diagnosis of followed recordings when due (see the module doc)."""

    def __init__(self, thresholds: Thresholds | None = None) -> None:
        self.thresholds = thresholds or load_thresholds()
        self._latest: dict[Path, Rediagnosis] = {}
        self._due: dict[Path, float] = {}  # monotonic time

    def latest(self, path: Path, followed: int = 1) -> Rediagnosis:
        """The findings of ``path``, re-run first when due; ``followed`` recordings in all
        share the budget."""
        mono = time.monotonic()
        if mono >= self._due.get(path, 0.0):
            self._run(path, mono, max(followed, 1))
        return self._latest[path]

    def forget_except(self, keep: set[Path]) -> None:
        """Drop what is kept for recordings no longer followed."""
        for cache in (self._latest, self._due):
            for path in [p for p in cache if p not in keep]:
                del cache[path]

    def _run(self, path: Path, mono: float, followed: int) -> None:
        latest = self._latest.setdefault(path, Rediagnosis())
        # A rule that fails says so on stderr, which would scribble over a live screen.
        complaints = io.StringIO()
        found: list[Finding] | None = None
        cpu0 = time.thread_time()
        try:
            with open_recording(path) as rec, contextlib.redirect_stderr(complaints):
                found = diagnose(rec, self.thresholds)
        except Exception as exc:  # noqa: BLE001 - a failing diagnosis must not stop the follower
            latest.error = f"diagnosis failed: {type(exc).__name__}: {exc}"
        spent = time.thread_time() - cpu0
        every = EVERY_S
        if found is not None:
            reported = complaints.getvalue().strip().splitlines()
            latest.findings = found
            latest.error = reported[0] if reported else None
            if any(f.id == TOO_EARLY for f in found):
                every = EARLY_EVERY_S
        self._due[path] = mono + max(every, spent / (CPU_SHARE / followed))
