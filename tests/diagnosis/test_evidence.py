"""No verdict from too little evidence, on recordings made with the real writer: start-up
growth is not a leak, a short run is not judged for saturation or contention, and what could
not be judged is said; durations read as people write them."""

from __future__ import annotations

from tests.diagnosis.builders import GiB, Job, MiB, Proc, const, make_steps
from tests.diagnosis.conftest import by_id, serious


def test_growth_over_time_reads_in_seconds(run_rules):
    job = Job(procs=[Proc(1000, rss=lambda t: 1 * GiB + t * 10 * MiB)], steps=[])
    f = by_id(run_rules(job), "host-memory-leak")
    assert "more after 31.5 s " in f.recommendation  # samples 0.5-40 s less the first fifth
    assert " ss" not in f.recommendation


def test_start_up_growth_of_a_short_run_is_not_a_leak(run_rules):
    # An 8 s run without steps grows 80 MiB/s while it imports: not judged, and said so.
    job = Job(duration=8.0, procs=[Proc(1000, rss=lambda t: 1 * GiB + t * 80 * MiB)], steps=[])
    findings = run_rules(job)
    assert "host-memory-leak" not in [f.id for f in findings]
    note = by_id(findings, "short-recording")
    assert note.severity == "info"
    assert "memory growth of pid 1000" in note.title


def test_two_seconds_of_steps_give_no_cpu_verdict(run_rules):
    # The machine is busy throughout, but the job stepped for 2 s only.
    job = Job(
        cpus=2,
        duration=5.0,
        procs=[Proc(1000, cpu=const(100.0))],
        host=lambda t: {"cpu_busy": 100.0},
        steps=make_steps(n=20, wall=0.1, start=2.5),
    )
    findings = run_rules(job)
    assert serious(findings) == []
    note = by_id(findings, "short-recording")
    assert "CPU contention" in note.title and "CPU saturation" in note.title
    # The same machine for 30 s of steps: the contention is judged and reported.
    long = Job(
        cpus=2,
        duration=35.0,
        procs=[Proc(1000, cpu=const(100.0))],
        host=lambda t: {"cpu_busy": 100.0},
        steps=make_steps(n=300, wall=0.1, start=2.5),
    )
    assert "cpu-contention" in serious(run_rules(long))
