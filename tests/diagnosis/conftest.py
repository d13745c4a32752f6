from __future__ import annotations

import pytest

from torchdoctor.diagnosis.engine import diagnose
from torchdoctor.diagnosis.findings import Finding
from torchdoctor.recording.reader import open_recording
from torchdoctor.thresholds import Thresholds


@pytest.fixture
def run_rules(tmp_path):
    """Write a builders.Job with the real writer, read it back, return the findings."""
    counter = iter(range(1000))

    def _run(job, thresholds: Thresholds | None = None) -> list[Finding]:
        path = job.write(tmp_path / f"job{next(counter)}.sqlite")
        with open_recording(path) as rec:
            return diagnose(rec, thresholds)

    return _run


def by_id(findings: list[Finding], rule_id: str) -> Finding:
    matches = [f for f in findings if f.id == rule_id]
    assert len(matches) == 1, f"expected one {rule_id}, got {[f.id for f in findings]}"
    return matches[0]


def serious(findings: list[Finding]) -> list[str]:
    return [f.id for f in findings if f.severity in ("warning", "critical")]


def evidence(finding: Finding, label_start: str):
    for ev in finding.evidence:
        if ev.label.startswith(label_start):
            return ev.value
    raise AssertionError(f"no evidence {label_start!r} in {[e.label for e in finding.evidence]}")
