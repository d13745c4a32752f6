"""What the recordings of jobs under ``torchdoctor run`` say right now: step rate, data wait,
findings.

Each recorded job announces itself in :mod:`torchdoctor.recording.registry`. Step figures come
from the recent rows of the ``steps`` table, read through
:class:`~torchdoctor.recording.tail.RecordingTail` (read-only, the recorder keeps writing); findings from the diagnosis, re-run within a CPU budget because it reads the whole
recording (:mod:`torchdoctor.diagnosis.rediagnosis`). A recording without steps (no instrumentation) or a diagnosis that fails still
shows what it can, with the reason for the rest: the live view never stops over them.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchdoctor.diagnosis.rediagnosis import BudgetedDiagnosis
from torchdoctor.recording.steps import step_stats
from torchdoctor.recording.tail import RecordingTail
from torchdoctor.recording.totals import TOTALS_KEY
from torchdoctor.thresholds import Thresholds
from torchdoctor.top.model import FindingBrief, RecordingStatus

WINDOW_S = 10.0  # step rate and data wait are over the steps that ended in this window
MIN_STEPS = 4  # fewer steps than this in the window: use the last ones, however old
# No step for this many times the longest recent step (and the window): stalled. Generous,
# because steps of a job starved of CPU vary a lot, and records reach the file in batches.
STALLED_STEPS = 5.0
# No sample for this many intervals (and at least STALE_MIN_S): the recorder is stuck.
STALE_INTERVALS = 20
STALE_MIN_S = 10.0
_STEP_COLUMNS = [
    "pid",
    "rank",
    "step",
    "t_start",
    "t_end",
    "wall_s",
    "data_wait_s",
    "batch_size",
    "samples",
    "profiled",  # a profiler window's steps: step_stats leaves them out, as show does
]


@dataclass(slots=True)
class _Watched:
    path: Path
    tail: RecordingTail | None
    error: str | None
    # The steps that ended in the window at the last read, in order of their end. Each read
    # adds the rows appended since (the tail's position) instead of reading the window again:
    # compaction never touches the recent past, so rows in the window stay as they were read.
    window: list[dict[str, Any]] = field(default_factory=list)
    window_since: float | None = None  # the start of the window last read; None: never read


class RecordingWatcher:
    """Keeps the recordings of active jobs open and summarizes their recent steps."""

    def __init__(self, thresholds: Thresholds, *, window_s: float = WINDOW_S) -> None:
        self.thresholds = thresholds
        self.window_s = window_s
        self._watched: dict[Path, _Watched] = {}
        self._diagnosis = BudgetedDiagnosis(thresholds)

    def status(
        self, path: Path, now: float | None = None, followed: int | None = None
    ) -> RecordingStatus:
        """What ``path`` says now; ``followed``: the recordings followed in all, which share
        the diagnosis' CPU budget (default: those watched so far)."""
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
        if w.tail is None:
            status.unavailable["steps"] = w.error or "recording not readable"
            return status
        with contextlib.suppress(sqlite3.Error):  # the steps below say what cannot be read
            status.recording_note = _recording_note(w.tail, path, now)
        try:
            self._steps(w, now, status)
        except sqlite3.Error as exc:
            status.unavailable["steps"] = f"cannot read the steps of {path}: {exc}"
        latest = self._diagnosis.latest(path, followed or len(self._watched))
        status.findings = [
            FindingBrief(
                id=f.id, severity=f.severity, title=f.title, recommendation=f.recommendation
            )
            for f in latest.findings or []
        ]
        if latest.error:
            status.unavailable["findings"] = latest.error
        return status

    def forget_except(self, keep: set[Path]) -> None:
        """Close the recordings of jobs that are no longer running."""
        for path in list(self._watched):
            if path not in keep:
                w = self._watched.pop(path)
                if w.tail is not None:
                    w.tail.close()
        self._diagnosis.forget_except(keep)

    def close(self) -> None:
        self.forget_except(set())

    # -- internals ------------------------------------------------------------------------

    def _open(self, path: Path) -> _Watched:
        from torchdoctor.errors import UserError
        from torchdoctor.recording.reader import open_recording

        try:
            # Validates that this is a recording this torchdoctor can read.
            open_recording(path).close()
            # The running totals are the exporter's, rewritten at every flush: not decoded.
            tail = RecordingTail(path, meta_skip=(TOTALS_KEY,))
        except (UserError, sqlite3.Error, OSError) as exc:
            return _Watched(path, None, getattr(exc, "message", None) or str(exc))
        return _Watched(path, tail, None)

    def _steps(self, w: _Watched, now: float, status: RecordingStatus) -> None:
        tail = w.tail
        assert tail is not None
        status.steps = tail.count("steps")
        if status.steps == 0:
            status.unavailable["steps"] = _no_steps_reason(tail.refresh_meta())
            return
        rows = w.window = self._window(w, tail, status.steps, now - self.window_s)
        if len(rows) < MIN_STEPS:
            # Slow steps (seconds each): the last few steps, however long ago they ended.
            rows = tail.recent_rows("steps", _STEP_COLUMNS, by="t_end", last=MIN_STEPS * 2)
        # The same figures as `torchdoctor show` and the diagnosis, over these steps.
        stats = step_stats(rows, [], [])
        since_last = now - max(r["t_end"] for r in rows)
        longest = max(r["wall_s"] for r in rows)
        if since_last > max(self.window_s, STALLED_STEPS * longest):
            # Far longer than a step takes: the job is stalled (or between phases).
            status.stalled_s = since_last
            status.step_rate_per_s = 0.0
            status.samples_per_s = 0.0
            return
        status.step_rate_per_s = stats.steps_per_s
        status.samples_per_s = stats.samples_per_s
        status.rate_lower_bound = bool(tail.refresh_meta().get("steps_source_limit"))
        # The most starved process is the one that holds the others back.
        shares = [r.data_wait_fraction for r in stats.per_rank if r.data_wait_fraction is not None]
        status.data_wait_share = max(shares) if shares else None

    @staticmethod
    def _window(w: _Watched, tail: RecordingTail, count: int, since: float) -> list[dict[str, Any]]:
        """The steps that ended at ``since`` or later, in order of their end."""
        last_since, w.window_since = w.window_since, since
        if last_since is None or since < last_since:  # the first read (or a window back in time)
            select = tail.selection("steps", _STEP_COLUMNS)
            found = tail.query(
                f"SELECT rowid, {select} FROM steps WHERE t_end >= ? ORDER BY t_end", (since,)
            )
            # On from the last row read, or the last row counted if later: a row appended
            # between the count and the query is in ``found`` or ended before the window.
            tail.seek("steps", max([count, *(r[0] for r in found)]))
            return [dict(zip(_STEP_COLUMNS, r[1:], strict=True)) for r in found]
        rows = w.window
        added = tail.new_tuples("steps", _STEP_COLUMNS)
        if added:
            rows = rows + [dict(zip(_STEP_COLUMNS, r, strict=True)) for r in added]
            rows.sort(key=_t_end)  # a process's batch may end before another's last step
        start = 0
        while start < len(rows) and _t_end(rows[start]) < since:
            start += 1
        return rows[start:] if start else rows


def _t_end(row: dict[str, Any]) -> float:
    t = row["t_end"]
    return t if t is not None else float("-inf")  # never in a window (SQL: NULL >= t is not)


def _recording_note(tail: RecordingTail, path: Path, now: float) -> str | None:
    """A line when the recording is cut short (its recorder died while the job runs on) or has
    had no sample for many intervals; None while it is written as it should be."""
    from torchdoctor.recording.state import IN_PROGRESS, describe_state, recording_state
    from torchdoctor.units import fmt_duration

    meta = tail.refresh_meta()
    last = tail.newest("host_samples", "t")
    # The tail reads the -wal beside the file, so whether the file is in WAL mode tells
    # nothing here (it names a copy left without its -wal): its header is not read, which
    # opened and closed every recording at every refresh.
    state = recording_state(meta, last, journal_is_wal=False, wal_beside=True)
    interval = float(meta.get("interval_s") or 0.5)
    if state.kind == IN_PROGRESS:
        if last is None or now - last < max(STALE_INTERVALS * interval, STALE_MIN_S):
            return None
        return (
            f"recording stalled: no sample for {fmt_duration(now - last)}"
            f" (recorder pid {state.writer_pid})"
        )
    return describe_state(state, path, now)


def _no_steps_reason(meta: dict) -> str:
    """Why a recording has no step yet: an attach that may not look inside says why."""
    reason = meta.get("steps_source_reason")
    if reason:
        return f"steps not seen: {reason}"
    return "no step recorded yet (is the training loop instrumented?)"
