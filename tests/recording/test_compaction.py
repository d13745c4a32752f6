"""Compaction (recording/compaction.py): a recording whose older samples the writer folded
gives the findings of the same recording kept full; a copy taken between passes opens; a
recording written before compaction reads and diagnoses as before."""

from __future__ import annotations

import math
import shutil
import sqlite3
from pathlib import Path

import pytest

from tests.conftest import run_td
from tests.diagnosis.builders import (
    T0,
    GiB,
    Gpu,
    Job,
    MiB,
    Proc,
    _json,
    const,
    loader,
    make_steps,
)
from tests.diagnosis.test_host_rules import io_job, swap_job, threads_job
from torchdoctor.diagnosis.engine import diagnose
from torchdoctor.diagnosis.findings import Finding
from torchdoctor.recording import RecordingWriter
from torchdoctor.recording.compaction import META_THROUGH, CompactionPolicy, compact_file
from torchdoctor.recording.reader import open_recording
from torchdoctor.recording.records import JobEvent, SettingRecord
from torchdoctor.recording.summary import summarize

DURATION = 600.0
# The default policy scaled down 12x, so a 10-minute job folds as a 2-hour one does.
POLICY = CompactionPolicy(
    bucket_s=5.0, summary_s=50.0, recent_s=75.0, startup_s=50.0, margin_s=10.0
)


def long_steps(wall: float = 0.1, wait: float = 0.005) -> list:
    """Steps through the whole job: its steady window is the run, folded part included."""
    return make_steps(n=int((DURATION - 4) / wall), wall=wall, wait=wait)


def leak_job() -> Job:
    def rss(t: float) -> float:
        return 1.5 * GiB + 2 * MiB * t + 10 * MiB * math.sin(t * 7.3)

    return Job(duration=DURATION, procs=[Proc(1000, cpu=const(100.0), rss=rss)], steps=long_steps())


def loader_job() -> Job:
    return Job(
        cpus=8,
        procs=[
            Proc(1000, cpu=const(100.0)),
            *[Proc(2000 + i, role="dataloader-worker", cpu=const(95.0)) for i in range(2)],
        ],
        steps=long_steps(wall=0.2, wait=0.12),
        dataloaders=[loader(num_workers=2, persistent_workers=True)],
    )


def scenarios() -> dict[str, Job]:
    jobs = {
        "threads": threads_job(32),
        "cpu_saturated": Job(cpus=2, procs=[Proc(1000, cpu=const(196.0))]),
        "io_wait": io_job(const(18.0)),
        "swap": swap_job(5e6),
        "leak": leak_job(),
        "loader": loader_job(),
        "healthy": Job(cpus=8, procs=[Proc(1000, cpu=const(100.0))]),
    }
    for job in jobs.values():
        job.duration = DURATION
        if job.steps:
            wall = job.steps[0].wall_s
            job.steps = long_steps(wall=wall, wait=job.steps[0].data_wait_s)
        else:
            job.steps = long_steps()
    return jobs


def write(job: Job, path: Path, policy: CompactionPolicy | None) -> Path:
    """``job`` through the real writer as the recorder drives it: a commit per second of run
    time (each may run a folding pass), events and steps handed over before the samples that
    follow them."""
    writer = RecordingWriter(path, job.meta(), flush_every_s=3600, compaction=policy)
    writer.add_events(job.events)
    writer.add_steps(job.steps)
    writer.add_dataloaders(job.dataloaders)
    writer.add_settings(
        SettingRecord(pid, None, T0 + 0.5, key, _json(value))
        for pid, values in job.settings.items()
        for key, value in values.items()
    )
    seen: set[int] = set()
    n = int(round(job.duration / job.interval))
    for i in range(1, n + 1):
        writer.write_snapshot(job._snapshot(i * job.interval, seen))
        if i % 2 == 0:
            writer.flush()
    writer.close({"ended_at": T0 + job.duration, "exit_status": 0, **job.end})
    return path


def findings_of(path: Path) -> list[Finding]:
    with open_recording(path) as rec:
        return diagnose(rec)


def same_findings(full: list[Finding], folded: list[Finding]) -> None:
    assert [(f.id, f.severity) for f in folded] == [(f.id, f.severity) for f in full]
    for a, b in zip(full, folded, strict=True):
        assert a.settings == b.settings, a.id
        assert [e.label for e in a.evidence] == [e.label for e in b.evidence], a.id
        for x, y in zip(a.evidence, b.evidence, strict=True):
            if isinstance(x.value, int | float) and isinstance(y.value, int | float):
                # within 2 %, or a hair of the figure's scale where it is near zero
                assert y.value == pytest.approx(x.value, rel=0.02, abs=1e-6), (a.id, x.label)
            else:
                assert x.value == y.value, (a.id, x.label)


@pytest.mark.parametrize("name", list(scenarios()))
def test_folded_recording_gives_the_findings_of_the_full_one(tmp_path: Path, name: str) -> None:
    job = scenarios()[name]
    full = write(job, tmp_path / "full.sqlite", None)
    folded = write(job, tmp_path / "folded.sqlite", POLICY)
    with open_recording(folded) as rec:
        assert rec.meta[META_THROUGH] > T0 + DURATION - POLICY.recent_s - 2 * POLICY.bucket_s
        rows = rec.count("process_samples")
        assert rec.summarised_spans()
    with open_recording(full) as rec:
        assert rows < rec.count("process_samples") / 3  # it did fold
    expected = findings_of(full)
    if name != "healthy":
        assert expected, name  # the condition is found at full resolution
    same_findings(expected, findings_of(folded))


def test_folded_rows_keep_means_counters_and_peaks(tmp_path: Path) -> None:
    spike = Proc(1000, cpu=const(100.0), rss=lambda t: 3 * GiB if 200 <= t < 200.5 else 1 * GiB)
    job = Job(duration=DURATION, procs=[spike])
    path = write(job, tmp_path / "folded.sqlite", POLICY)
    with open_recording(path) as rec:
        rows = rec.rows("process_samples", columns=["t", "cpu_percent", "rss", "cpu_user_s"])
        folded = [r for r in rows if T0 + 100 <= r["t"] < T0 + 400]
        gaps = {round(b["t"] - a["t"], 3) for a, b in zip(folded, folded[1:], strict=False)}
        assert gaps == {POLICY.bucket_s}  # one row per bucket
        # the kept row is the bucket's last: its cumulative CPU seconds are that sample's
        last = folded[0]
        assert last["cpu_user_s"] == pytest.approx(1.0 * (last["t"] - T0) * 0.9)
        assert all(r["cpu_percent"] == pytest.approx(100.0) for r in folded)
        # the 0.5 s spike: a tenth of a bucket in the mean, whole in the summary's max
        assert max(r["rss"] for r in folded) == pytest.approx(1.2 * GiB, rel=0.01)
        peaks = rec.summaries("process_samples")
        assert max(s["rss_max"] for s in peaks) == 3 * GiB
        assert sum(s["n"] for s in peaks) > 500


def test_events_and_the_start_keep_every_sample(tmp_path: Path) -> None:
    kill = JobEvent(pid=1000, rank=None, t=T0 + 300.0, kind="cuda-oom", detail="{}")
    job = Job(duration=DURATION, events=[kill])
    path = write(job, tmp_path / "folded.sqlite", POLICY)
    with open_recording(path) as rec:
        times = [r["t"] - T0 for r in rec.rows("host_samples", columns=["t"])]
    near = [t for t in times if 300 - POLICY.margin_s <= t < 300 + POLICY.margin_s]
    assert len(near) == 2 * POLICY.margin_s / job.interval  # every sample around the event
    start = [t for t in times if t < POLICY.startup_s]
    assert len(start) == POLICY.startup_s / job.interval - 1  # t = 0.5 .. 49.5
    recent = [t for t in times if t > DURATION - POLICY.recent_s]
    assert len(recent) >= POLICY.recent_s / job.interval - 1


def test_a_copy_taken_between_passes_is_a_recording(tmp_path: Path) -> None:
    """Each pass is one transaction: a copy of the file (with its WAL, or after a checkpoint)
    taken while the writer folds holds the rows before a pass or after it."""
    job = leak_job()
    job.duration = DURATION
    path = tmp_path / "live.sqlite"
    writer = RecordingWriter(path, job.meta(), flush_every_s=3600, compaction=POLICY)
    seen: set[int] = set()
    copies = []
    for i in range(1, int(DURATION / job.interval) + 1):
        writer.write_snapshot(job._snapshot(i * job.interval, seen))
        if i % 2 == 0:
            writer.flush()
        if i % 301 == 0:  # odd: copies fall between passes at different points
            copy = tmp_path / f"copy{i}.sqlite"
            with sqlite3.connect(path) as src, sqlite3.connect(copy) as dst:
                src.backup(dst)  # what a reader sees at that moment, WAL included
            copies.append(copy)
    writer.close({"ended_at": T0 + DURATION, "exit_status": 0})
    assert len(copies) == 3
    for copy in copies:
        with open_recording(copy) as rec:
            assert not rec.damage
            assert rec.count("host_samples") > 0
            # every folded bucket has its summary: rows and summaries moved together
            through = rec.meta.get(META_THROUGH)
            spans = rec.summarised_spans()
            assert (through is None) == (not spans)
            assert isinstance(diagnose(rec), list)


def test_a_recording_without_summary_tables_reads_and_diagnoses_as_before(tmp_path: Path):
    path = leak_job().write(tmp_path / "old.sqlite")  # no policy: the layout of before
    with sqlite3.connect(path) as db:
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert not {t for t in tables if t.endswith("_summaries")}
    with open_recording(path) as rec:
        assert rec.compaction is None
        assert rec.summarised_spans() == []
        assert rec.summaries("process_samples") == []
        assert "host-memory-leak" in [f.id for f in diagnose(rec)]


def test_folding_a_finished_recording_and_show_says_where(tmp_path: Path) -> None:
    path = leak_job().write(tmp_path / "old.sqlite")
    folded = tmp_path / "folded.sqlite"
    shutil.copyfile(path, folded)
    assert compact_file(str(folded), CompactionPolicy(5.0, 50.0, 10.0, 10.0, 2.0)) > 0
    shown = run_td("show", str(folded))
    assert shown.returncode == 0, shown.stderr
    assert "samples folded (--keep compact): one row per process per" in shown.stdout
    assert "after the start" in shown.stdout
    assert "samples folded" not in run_td("show", str(path)).stdout


def test_bad_policy_values_are_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="bucket_s must be a finite number"):
        CompactionPolicy(bucket_s=float("nan"))
    assert CompactionPolicy.from_meta({"bucket_s": "x"}) is None
    assert CompactionPolicy.from_meta(None) is None


def test_show_counts_folded_samples_and_their_peak(tmp_path: Path) -> None:
    """The summary (show, the hand-off's sizing) counts every sample taken and takes the RSS
    peak a folded minute hid from its summary."""
    spike = Proc(1000, cpu=const(100.0), rss=lambda t: 3 * GiB if 200 <= t < 200.5 else 1 * GiB)
    job = Job(duration=DURATION, procs=[spike])
    full = write(job, tmp_path / "full.sqlite", None)
    folded = write(job, tmp_path / "folded.sqlite", POLICY)
    with open_recording(full) as a, open_recording(folded) as b:
        whole, small = summarize(a), summarize(b)
    assert small.samples == whole.samples
    assert small.job_rss.peak == whole.job_rss.peak == 3 * GiB
    assert small.job_rss.mean == pytest.approx(whole.job_rss.mean, rel=0.05)


def test_a_shared_memory_peak_in_a_folded_minute_is_kept(tmp_path: Path) -> None:
    """The hand-off sizes /dev/shm from the job's shared-memory peak (sizing): a burst of
    batches in flight that a folded minute's mean would hide is still the peak."""
    burst = Proc(1000, shm=lambda t: 2 * GiB if 200 <= t < 200.5 else 64 * MiB)
    job = Job(duration=DURATION, procs=[burst])
    full = write(job, tmp_path / "full.sqlite", None)
    folded = write(job, tmp_path / "folded.sqlite", POLICY)
    with open_recording(full) as a, open_recording(folded) as b:
        whole, small = summarize(a), summarize(b)
    assert whole.job_dev_shm.peak == small.job_dev_shm.peak == 2 * GiB
    assert whole.job_rss_shmem.peak == small.job_rss_shmem.peak == 2 * GiB


def test_gpu_processes_are_folded_and_their_peaks_kept(tmp_path: Path) -> None:
    """The per-process GPU rows (every process on every GPU, every sample) are folded like the
    others, and the job's VRAM peak, the device's memory and busy peaks a folded minute hid
    are still the peaks `show`, the report and the hand-off read."""
    spike = Gpu(
        used=lambda t: 70 * GiB if 200 <= t < 200.5 else 40 * GiB,
        util=lambda t: 100.0 if 200 <= t < 200.5 else 60.0,
    )
    job = Job(duration=DURATION, procs=[Proc(1000)], gpus=[spike])
    full = write(job, tmp_path / "full.sqlite", None)
    folded = write(job, tmp_path / "folded.sqlite", POLICY)
    with open_recording(full) as a, open_recording(folded) as b:
        whole, small = summarize(a).gpus[0], summarize(b).gpus[0]
        rows = [
            rec.query(f"SELECT COUNT(*) AS n FROM {table}")[0]["n"]
            for rec in (a, b)
            for table in ("gpu_process_samples", "process_samples")
        ]
    assert small.job_memory_peak == whole.job_memory_peak == 70 * GiB - 500 * MiB
    assert small.memory_used.peak == whole.memory_used.peak == 70 * GiB
    assert small.utilization_gpu.peak == whole.utilization_gpu.peak == 100.0
    # one process on one GPU: folded as its process rows are (a row a bucket)
    assert rows[2] == rows[3] < rows[0] / 2, rows


def test_show_means_of_a_folded_recording_are_the_full_ones(tmp_path: Path) -> None:
    """Means over rows would weigh the minutes kept whole (start-up, recent past) far above
    the folded ones; the summary takes one instant a bucket throughout."""
    ramp = Proc(1000, cpu=lambda t: 50.0 if t < 300 else 150.0)
    job = Job(duration=DURATION, procs=[ramp])
    full = write(job, tmp_path / "full.sqlite", None)
    folded = write(job, tmp_path / "folded.sqlite", POLICY)
    with open_recording(full) as a, open_recording(folded) as b:
        whole, small = summarize(a), summarize(b)
    assert small.job_cpu_pct.mean == pytest.approx(whole.job_cpu_pct.mean, rel=0.02)
    assert small.host_cpu_busy_pct.mean == pytest.approx(whole.host_cpu_busy_pct.mean, rel=0.02)
    assert small.job_cpu_pct.peak == whole.job_cpu_pct.peak


def test_a_folded_recording_cut_in_half_shows_and_diagnoses(tmp_path: Path) -> None:
    """A copy cut short is read through salvage, which keeps the sample tables and not the
    summaries: it reads as kept full, one clear line about the damage, no SQL error."""
    folded = write(leak_job(), tmp_path / "folded.sqlite", POLICY)
    half = tmp_path / "half.sqlite"
    data = folded.read_bytes()
    half.write_bytes(data[: len(data) // 2 + 100])
    with open_recording(half) as rec:
        assert rec.damage
        assert rec.compaction is None
        assert isinstance(diagnose(rec), list)
    shown = run_td("show", str(half))
    assert shown.returncode == 0, shown.stderr
    assert "recording damaged" in shown.stdout
