"""BudgetedDiagnosis, the re-diagnosis top and the Prometheus endpoints share: when it re-runs,
what a failed run keeps, and what it says."""

from __future__ import annotations

import pytest

from tests.diagnosis.builders import Job, Proc, const, loader, make_steps
from torchdoctor.diagnosis import rediagnosis
from torchdoctor.diagnosis.rediagnosis import BudgetedDiagnosis


@pytest.fixture
def recording(tmp_path):
    job = Job(
        procs=[Proc(1000, cpu=const(60.0))],
        steps=make_steps(n=300, wall=0.12, wait=0.08),
        dataloaders=[loader(num_workers=0)],
    )
    return job.write(tmp_path / "job.sqlite")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_findings_stand_between_runs_and_after_a_failed_one(recording, monkeypatch):
    clock = Clock()
    monkeypatch.setattr(rediagnosis.time, "monotonic", clock)
    runs = []
    real = rediagnosis.diagnose

    def counted(rec, thresholds, **kwargs):
        runs.append(clock.now)
        return real(rec, thresholds, **kwargs)

    monkeypatch.setattr(rediagnosis, "diagnose", counted)
    diag = BudgetedDiagnosis()
    first = diag.latest(recording)
    assert first.error is None and "dataloader-bound" in {f.id for f in first.findings}
    clock.now += rediagnosis.EVERY_S / 2
    assert diag.latest(recording).findings == first.findings and len(runs) == 1  # not due

    def broken(rec, thresholds, **kwargs):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(rediagnosis, "diagnose", broken)
    clock.now += rediagnosis.EVERY_S
    failed = diag.latest(recording)
    assert failed.findings == first.findings  # the last findings stand
    assert failed.error == "diagnosis failed: RuntimeError: disk on fire"

    diag.forget_except(set())
    assert diag.latest(recording).findings is None  # forgotten, then failed again


def test_a_rule_that_complains_is_reported_and_the_others_kept(recording, monkeypatch):
    from torchdoctor.diagnosis.rules import io_wait

    def broken(ctx):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(io_wait, "check", broken)
    latest = BudgetedDiagnosis().latest(recording)
    assert "dataloader-bound" in {f.id for f in latest.findings}
    assert latest.error.startswith("torchdoctor: rule io-wait failed")
