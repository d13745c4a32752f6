"""The one usable-CPU rule, and every consumer of a recording giving the same figure."""

from __future__ import annotations

import pytest

from torchdoctor.sampling.hostinfo import read_host_info
from torchdoctor.sampling.types import cpu_slots, usable_cpus, usable_cpus_of


@pytest.mark.parametrize(
    ("allowed", "quota", "logical", "usable", "slots"),
    [
        (8, None, 8, 8.0, 8),  # affinity alone
        (8, 2.5, 8, 2.5, 3),  # a quota below the affinity caps it; a partial CPU runs a thread
        (2, 4.0, 8, 2.0, 2),  # a quota above the affinity changes nothing
        (4, 0.2, 4, 0.2, 1),  # a fraction of one CPU stays a fraction
        (0, None, 6, 6.0, 6),  # affinity unreadable: the machine's logical CPUs
        (0, None, None, 1.0, 1),  # nothing known: one CPU
    ],
)
def test_rule(allowed, quota, logical, usable, slots):
    assert usable_cpus(allowed, quota, logical) == pytest.approx(usable)
    assert cpu_slots(usable_cpus(allowed, quota, logical)) == slots


def test_the_live_machine_and_its_recorded_metadata_agree():
    info = read_host_info()
    host = {
        "allowed_cpus": info.allowed_cpus,
        "cgroup_cpu_quota": info.cgroup_cpu_quota,
        "logical_cpus": info.logical_cpus,
    }
    assert usable_cpus_of(host) == info.usable_cpus
    assert usable_cpus_of({}) is None


def test_diagnosis_and_summary_use_the_same_figure(tmp_path):
    """One recording of a 4-CPU affinity under a 1.5-CPU quota: show and diagnose say 1.5."""
    from tests.diagnosis.builders import Job

    from torchdoctor.diagnosis.context import DiagnosisContext
    from torchdoctor.recording import open_recording
    from torchdoctor.recording.summary import summarize
    from torchdoctor.thresholds import Thresholds

    path = Job(cpus=4, quota=1.5, duration=5).write(tmp_path / "r.sqlite")
    with open_recording(path) as rec:
        assert summarize(rec).usable_cpus == 1.5
        assert DiagnosisContext(rec, Thresholds()).usable_cpus == 1.5
