"""The diagnosis' findings of a running job, as 0/1 per rule, re-run within a CPU budget.

The diagnosis reads the whole recording, which grows while the job runs, so a scrape does not
pay for it every time: it re-runs at most every :data:`EVERY_S`, and less often when it gets
slow, so that all followed jobs together use at most :data:`CPU_SHARE` of one core on it.
Between runs a scrape serves the last result.
"""

from __future__ import annotations

import contextlib
import io
import time
from pathlib import Path

from torchdoctor.thresholds import Thresholds

EVERY_S = 30.0
CPU_SHARE = 0.005

_RULE_IDS: list[str] | None = None


def rule_ids() -> list[str]:
    """Every finding id the diagnosis can report: each gets a 0/1 series."""
    global _RULE_IDS
    if _RULE_IDS is None:
        from torchdoctor.diagnosis.engine import rules

        _RULE_IDS = sorted({m.ID for m in rules()})
    return _RULE_IDS


class FindingsCache:
    """The latest findings of each followed recording; ``None`` while none could be made."""

    def __init__(self, thresholds: Thresholds | None = None) -> None:
        self.thresholds = thresholds or Thresholds()
        self._active: dict[Path, set[str] | None] = {}
        self._due: dict[Path, float] = {}

    def active(self, path: Path, jobs: int = 1) -> dict[str, bool] | None:
        """{rule id: reported now} for ``path``; ``jobs`` followed in all (for the budget)."""
        mono = time.monotonic()
        if mono >= self._due.get(path, 0.0):
            self._refresh(path, mono, max(jobs, 1))
        found = self._active.get(path)
        if found is None:
            return None
        return {rule: rule in found for rule in rule_ids()}

    def forget_except(self, keep: set[Path]) -> None:
        for cache in (self._active, self._due):
            for path in [p for p in cache if p not in keep]:
                del cache[path]

    def _refresh(self, path: Path, mono: float, jobs: int) -> None:
        from torchdoctor.diagnosis.engine import diagnose
        from torchdoctor.recording.reader import open_recording

        cpu0 = time.thread_time()
        try:
            # A rule that fails says so on stderr; the endpoint's output is the series only.
            with open_recording(path) as rec, contextlib.redirect_stderr(io.StringIO()):
                self._active[path] = {f.id for f in diagnose(rec, self.thresholds)}
        except Exception:  # noqa: BLE001 - a failing diagnosis must not fail the scrape
            self._active.setdefault(path, None)
        finally:
            spent = time.thread_time() - cpu0
            self._due[path] = mono + max(EVERY_S, spent / (CPU_SHARE / jobs))
