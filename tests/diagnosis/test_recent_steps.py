"""The step rules that read rows (CUDA memory per step, autocast, batch sizes) read the job's
last steps, not every row: a long GPU job's diagnosis must not grow with its length. The rows
they get are the steady ones (past each process's warm-up, outside profiler windows), as the
whole table's would be, where the recent rows do not reach back to the start."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.diagnosis.builders import Job, Proc, make_steps
from torchdoctor.diagnosis import context
from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.recording.reader import open_recording
from torchdoctor.recording.steps import measured_steps
from torchdoctor.thresholds import Thresholds


def two_processes(path: Path) -> Path:
    job = Job(duration=60.0, procs=[Proc(1000), Proc(1001)])
    job.steps = make_steps(1000, n=300, wall=0.1, profiled=lambda i: 1 if 200 <= i < 205 else None)
    job.steps += make_steps(1001, n=120, wall=0.25)
    return job.write(path)


def whole_table_steady(rec) -> list[dict]:
    """The steady steps as reading every row gives them (recording.steps.measured_steps)."""
    out = []
    for pid in (1000, 1001):
        rows = sorted(rec.rows("steps", where={"pid": pid}), key=lambda r: r["step"])
        out.extend(measured_steps(rows))
    return sorted(out, key=lambda r: r["t_end"])


@pytest.mark.parametrize("recent", [50, 10_000])
def test_recent_steady_steps_are_the_tail_of_the_whole_tables(tmp_path, monkeypatch, recent):
    monkeypatch.setattr(context, "RECENT_STEPS", recent)
    path = two_processes(tmp_path / "job.sqlite")
    with open_recording(path) as rec:
        ctx = DiagnosisContext(rec, Thresholds())
        got = ctx.steady_steps
        whole = whole_table_steady(rec)
        assert len(ctx.recent_steps) == min(recent, 420)
    cut = min(r["t_end"] for r in ctx.recent_steps)
    expected = [r for r in whole if r["t_end"] >= cut]
    assert [(r["pid"], r["step"]) for r in got] == [(r["pid"], r["step"]) for r in expected]
    assert not any(r["profiled"] for r in got)
    if recent < 420:
        assert len(got) < len(whole)
