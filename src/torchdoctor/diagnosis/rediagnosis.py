"""The findings of recordings still being written, re-run within a CPU budget.

The diagnosis reads the whole recording, which grows while the job runs, so whoever follows a
running job (``top``, the Prometheus endpoints) does not pay for it on every refresh: it re-runs
at most every :data:`EVERY_S`, sooner (:data:`EARLY_EVERY_S`) while it says it has too little
evidence (a job's first seconds), and less often when it gets slow, so that all followed
recordings together use at most :data:`CPU_SHARE` of one core on it. Between runs the last
findings stand; a run that fails keeps them and says why.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
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

    def next_due(self, path: Path) -> float:
        """When ``path`` is next due (monotonic time; 0 when never run)."""
        return self._due.get(path, 0.0)

    def forget_except(self, keep: set[Path]) -> None:
        """Drop what is kept for recordings no longer followed."""
        for cache in (self._latest, self._due):
            for path in [p for p in cache if p not in keep]:
                del cache[path]

    def peek(self, path: Path) -> Rediagnosis | None:
        """The findings of ``path`` as they stand, never running the diagnosis."""
        return self._latest.get(path)

    def is_due(self, path: Path, mono: float) -> bool:
        return mono >= self._due.get(path, 0.0)

    def _run(self, path: Path, mono: float, followed: int) -> None:
        self.record(path, mono, followed, self.run_once(path))

    def run_once(self, path: Path) -> tuple[list[Finding] | None, str | None, float]:
        """Diagnose ``path`` now: (findings or None, the error or first complaint, CPU s)."""
        # A rule that fails would say so on stderr, which would scribble over a live screen
        # (and redirecting stderr would take the whole process's, whatever thread runs this).
        complaints: list[str] = []
        found: list[Finding] | None = None
        error = None
        cpu0 = time.thread_time()
        try:
            with open_recording(path) as rec:
                found = diagnose(rec, self.thresholds, complain=complaints.append)
        except Exception as exc:  # noqa: BLE001 - a failing diagnosis must not stop the follower
            error = f"diagnosis failed: {type(exc).__name__}: {exc}"
        spent = time.thread_time() - cpu0
        if found is not None:
            error = complaints[0] if complaints else None
        return found, error, spent

    def record(
        self,
        path: Path,
        mono: float,
        followed: int,
        result: tuple[list[Finding] | None, str | None, float],
    ) -> None:
        """Keep what :meth:`run_once` gave and set when ``path`` is next due."""
        found, error, spent = result
        latest = self._latest.setdefault(path, Rediagnosis())
        latest.error = error
        every = EVERY_S
        if found is not None:
            latest.findings = found
            if any(f.id == TOO_EARLY for f in found):
                every = EARLY_EVERY_S
        elif latest.findings is None:
            every = EARLY_EVERY_S  # no findings yet (a recording still being created)
        self._due[path] = mono + max(every, spent / (CPU_SHARE / followed))


class BackgroundDiagnosis:
    """A :class:`BudgetedDiagnosis` run beside its readers, in a daemon thread of its own.

    Readers (a Prometheus scrape) get the findings as they stand at once, never waiting for
    a diagnosis: None until the first run of a recording ended. The thread re-runs what is
    due, on the same budget, and sleeps until the next run is due or :meth:`follow` changes
    the set of recordings."""

    def __init__(self, thresholds: Thresholds | None = None) -> None:
        self._budget = BudgetedDiagnosis(thresholds)
        self._lock = threading.Lock()
        self._followed: tuple[Path, ...] = ()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None

    def follow(self, paths: Iterable[Path]) -> None:
        """Diagnose these recordings from now on (and forget the others)."""
        paths = tuple(paths)
        with self._lock:
            if paths == self._followed and self._thread is not None:
                return
            self._followed = paths
            self._budget.forget_except(set(paths))
            if self._thread is None and not self._stopping:
                self._thread = threading.Thread(
                    target=self._loop, name="torchdoctor-diagnosis", daemon=True
                )
                self._thread.start()
        self._wake.set()

    def latest(self, path: Path) -> Rediagnosis | None:
        with self._lock:
            return self._budget.peek(path)

    def close(self, timeout: float = 5.0) -> None:
        with self._lock:
            self._stopping = True
            thread, self._thread = self._thread, None
        self._wake.set()
        if thread is not None:
            thread.join(timeout)

    def _loop(self) -> None:
        while True:
            self._wake.clear()
            with self._lock:
                if self._stopping:
                    return
                paths = self._followed
                mono = time.monotonic()
                due = [p for p in paths if self._budget.is_due(p, mono)]
            for path in due:
                result = self._budget.run_once(path)  # outside the lock: readers go on
                with self._lock:
                    if self._stopping:
                        return
                    if path in self._followed:
                        self._budget.record(path, time.monotonic(), len(self._followed), result)
            with self._lock:
                mono = time.monotonic()
                waits = [self._budget.next_due(p) - mono for p in self._followed]
            self._wake.wait(max(0.05, min(waits, default=EVERY_S)))
