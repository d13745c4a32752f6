"""Steps in a bounded recording (recording/compaction.py, issue 46): a recording whose older
step rows the writer thinned gives the step figures, findings, live totals and comparisons of
the same recording kept full; a copy taken at any moment opens with every step counted."""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path

import pytest

from tests.conftest import run_td
from tests.diagnosis.builders import T0, Job, Proc, const, make_steps
from tests.recording.test_compaction import DURATION, POLICY, findings_of, same_findings, write
from torchdoctor.compare.runs import run_figures
from torchdoctor.compare.verdict import compare
from torchdoctor.exporters.jobstate import JobState
from torchdoctor.recording import RecordingWriter, step_histogram
from torchdoctor.recording.compaction import STEP_SUMMARIES, CompactionPolicy
from torchdoctor.recording.reader import Recording, open_recording
from torchdoctor.recording.records import StepRecord
from torchdoctor.recording.salvage import salvage
from torchdoctor.recording.steps import StepStats
from torchdoctor.recording.tail import RecordingTail
from torchdoctor.report.tables import precision_rows


def rank_steps(pid: int, rank: int, n: int, *, wall: float = 0.1, seed: int = 0) -> list:
    """``n`` steps of a DDP rank from 2 s in: walls spread +-20 % with a slow step every 50th,
    every third step waiting for data, the last batch of each 7 short, DDP's figures on its
    sampled iterations (1-10, then every 100th)."""
    rng = random.Random(seed)
    steps, t = [], T0 + 2.0
    for i in range(n):
        w = wall * (0.8 + 0.4 * rng.random()) + (3 * wall if i % 50 == 49 else 0.0)
        wait = 0.4 * w if i % 3 == 0 else 0.0
        ddp = {"comm_s": 0.01, "comm_overlap_s": 0.008, "backward_compute_s": 0.03}
        sampled = i <= 10 or i % 100 == 0
        steps.append(
            StepRecord(
                pid, rank, i, t, t + w, w, wait, 32, 31 if i % 7 == 6 else 32,
                **(ddp if sampled else {}),
            )
        )  # fmt: skip
        t += w
    return steps


def ranks_job(wall: float = 0.1, short: int = 0) -> Job:
    """Two ranks stepping through the whole job; rank 1 ``short`` steps fewer (its data ran
    out at the end)."""
    n = int((DURATION - 4) / (wall * 1.2))
    return Job(
        procs=[Proc(1000, cpu=const(100.0)), Proc(1001, cpu=const(100.0))],
        steps=rank_steps(1000, 0, n, wall=wall, seed=1)
        + rank_steps(1001, 1, n - short, wall=wall, seed=2),
        duration=DURATION,
    )


def stats_of(path: Path) -> StepStats:
    with open_recording(path) as rec:
        stats = rec.step_stats()
    assert stats is not None
    return stats


def same_stats(full: StepStats, folded: StepStats) -> None:
    assert folded.step_count == full.step_count
    assert folded.measured_steps == full.measured_steps
    for name in ("steps_per_s", "samples_per_s", "data_wait_fraction", "mean_step_s",
                 "mean_data_wait_s"):  # fmt: skip
        assert getattr(folded, name) == pytest.approx(getattr(full, name), rel=1e-9), name
    for name in ("median_step_s", "p90_step_s", "median_data_wait_s", "p90_data_wait_s"):
        assert getattr(folded, name) == pytest.approx(getattr(full, name), rel=0.02), name
    assert (folded.t_start, folded.t_end, folded.batch_size) == (
        full.t_start,
        full.t_end,
        full.batch_size,
    )
    for a, b in zip(full.per_rank, folded.per_rank, strict=True):
        assert (b.pid, b.rank, b.step_count, b.measured_steps) == (
            a.pid,
            a.rank,
            a.step_count,
            a.measured_steps,
        )
        assert b.steps_per_s == pytest.approx(a.steps_per_s, rel=1e-9)
        assert b.samples_per_s == pytest.approx(a.samples_per_s, rel=1e-9)
        assert b.median_step_s == pytest.approx(a.median_step_s, rel=0.02)
        assert b.p90_step_s == pytest.approx(a.p90_step_s, rel=0.02)


def test_thinned_steps_give_the_step_figures_and_findings_of_the_full_recording(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = ranks_job(short=40)
    full = write(job, tmp_path / "full.sqlite", None)
    folded = write(job, tmp_path / "folded.sqlite", POLICY)
    with open_recording(full) as a, open_recording(folded) as b:
        rows = a.count("steps")
        assert b.count("steps") < rows / 4  # it did thin
        assert sum(f.count for f in b.folded_steps.values()) + b.count("steps") == rows
        kept = b.rows("steps", columns=["step", "comm_s"])
    # DDP's sampled iterations and the warm-up are all kept
    assert {s["step"] for s in kept if s["comm_s"] is not None} == {
        s.step for s in job.steps if s.comm_s is not None
    }
    assert {s["step"] for s in kept} >= set(range(5))
    same_stats(stats_of(full), stats_of(folded))
    expected = findings_of(full)
    assert "uneven-inputs" in [f.id for f in expected]  # its evidence is each rank's count
    same_findings(expected, findings_of(folded))
    assert "failed on this recording" not in capsys.readouterr().err  # every rule judged


def test_ranks_keep_the_same_step_numbers(tmp_path: Path) -> None:
    """Rank rules compare ranks step by step: the rows kept are the same steps on each."""
    folded = write(ranks_job(), tmp_path / "folded.sqlite", POLICY)
    with open_recording(folded) as rec:
        by_rank: dict[int, set[int]] = {0: set(), 1: set()}
        for s in rec.rows("steps", columns=["rank", "step"]):
            by_rank[s["rank"]].add(s["step"])
    shared = by_rank[0] & by_rank[1]
    assert len(shared) >= 0.8 * max(len(v) for v in by_rank.values())


def test_live_totals_count_every_step(tmp_path: Path) -> None:
    """The exporter's counters come from the totals the writer kept as it wrote: a folded
    recording counts the steps of the full one."""
    job = ranks_job()
    full = write(job, tmp_path / "full.sqlite", None)
    folded = write(job, tmp_path / "folded.sqlite", POLICY)
    states = []
    for path in (full, folded):
        state = JobState(RecordingTail(path))
        state.update()
        states.append(
            {rank: (s.steps, s.samples, round(s.wall_s, 6)) for rank, s in state.steps.items()}
        )
    assert states[1] == states[0]
    assert states[0]["0"][0] == len([s for s in job.steps if s.rank == 0])


def test_a_copy_taken_mid_pass_counts_every_step_committed(tmp_path: Path) -> None:
    """Steps handed over second by second as the recorder does; copies taken between and
    after folding passes: each opens, and its step count is that of the rows committed
    (rows deleted and their summary inserted in one transaction)."""
    job = ranks_job()
    path = tmp_path / "live.sqlite"
    writer = RecordingWriter(path, job.meta(), flush_every_s=3600, compaction=POLICY)
    pending = sorted(job.steps, key=lambda s: s.t_end)
    seen: set[int] = set()
    copies = []
    for i in range(1, int(DURATION / job.interval) + 1):
        now = T0 + i * job.interval
        while pending and pending[0].t_end <= now:
            writer.add_steps([pending.pop(0)])
        writer.write_snapshot(job._snapshot(i * job.interval, seen))
        if i % 2 == 0:
            writer.flush()
        if i % 301 == 0:
            copy = tmp_path / f"copy{i}.sqlite"
            with sqlite3.connect(path) as src, sqlite3.connect(copy) as dst:
                src.backup(dst)
            copies.append(copy)
    writer.close({"ended_at": T0 + DURATION, "exit_status": 0})
    folded_any = False
    for copy in copies:
        with open_recording(copy) as rec:
            assert not rec.damage
            committed = sum(s["steps"] for s in rec.meta["totals"]["steps"].values())
            stats = rec.step_stats()
            assert stats is not None and stats.step_count == committed
            folded_any = folded_any or bool(rec.folded_steps)
    assert folded_any


def test_compare_of_folded_recordings_gives_the_verdict_of_the_full_ones(tmp_path: Path):
    a, b = ranks_job(wall=0.1), ranks_job(wall=0.13)
    verdicts = []
    for name, policy in (("full", None), ("folded", POLICY)):
        paths = [
            write(job, tmp_path / f"{name}-{x}.sqlite", policy)
            for x, job in zip("ab", (a, b), strict=True)
        ]
        with open_recording(paths[0]) as ra, open_recording(paths[1]) as rb:
            c = compare(run_figures(ra), run_figures(rb))
        verdicts.append(c)
    full, folded = verdicts
    assert folded.verdict == full.verdict == "slower"
    assert folded.ratio.estimate == pytest.approx(full.ratio.estimate, rel=0.02)
    assert (folded.a_step_count, folded.a_steps) == (full.a_step_count, full.a_steps)


def test_show_says_steps_are_folded(tmp_path: Path) -> None:
    folded = write(ranks_job(), tmp_path / "folded.sqlite", POLICY)
    shown = run_td("show", str(folded))
    assert shown.returncode == 0, shown.stderr
    assert "steps folded there too:" in shown.stdout
    full = write(ranks_job(), tmp_path / "full.sqlite", None)
    assert "steps folded" not in run_td("show", str(full)).stdout


def test_a_recording_folded_before_steps_were_reads_its_step_rows(tmp_path: Path) -> None:
    """Written by a writer that folded samples but not steps: no step_summaries table, a
    policy without step_rows; every step row is read as before."""
    job = ranks_job()
    path = write(job, tmp_path / "older.sqlite", POLICY)
    with sqlite3.connect(path) as db:
        db.execute(f"DELETE FROM {STEP_SUMMARIES}")  # as if none were written ...
        db.execute(f"DROP TABLE {STEP_SUMMARIES}")  # ... nor the table made
    with open_recording(path) as rec:
        assert rec.folded_steps == {}
        stats = rec.step_stats()
        assert stats is not None and stats.step_count == rec.count("steps")
        assert rec.compaction is not None
    older = {k: v for k, v in POLICY.to_meta().items() if k != "step_rows"}
    assert CompactionPolicy.from_meta(older) == POLICY


def test_histogram_quantiles_are_within_one_bin() -> None:
    rng = random.Random(5)
    values = [rng.lognormvariate(-2.0, 0.6) for _ in range(5000)] + [0.0] * 50
    counts = step_histogram.decode(step_histogram.encode(step_histogram.histogram(values)))
    assert sum(counts.values()) == len(values)
    ordered = sorted(values)
    for q in (0.1, 0.5, 0.9, 0.99):
        exact = ordered[round(q * (len(ordered) - 1))]
        assert step_histogram.quantile(counts, q) == pytest.approx(
            exact, rel=step_histogram.RELATIVE_ERROR
        )
    assert step_histogram.quantile(counts, 0.0) == 0.0  # below the floor: read as 0
    with pytest.raises(ValueError, match="ends inside a number"):
        step_histogram.decode(b"\x81")


def test_a_damaged_folded_recording_read_through_salvage_counts_the_folded_steps(tmp_path):
    """Salvage copies step_summaries with the step rows: a cut copy's step figures add the
    folded steps it could read (here every page can be read: the figures are the file's)."""
    folded = write(ranks_job(), tmp_path / "folded.sqlite", POLICY)
    with open_recording(folded) as rec:
        whole = rec.step_stats()
    db, notes = salvage(folded, "a test")
    rec = Recording(folded, db, 1, damage=notes)
    try:
        assert rec.folded_steps
        salvaged = rec.step_stats()
    finally:
        rec.close()
    assert whole is not None and salvaged is not None
    same_stats(whole, salvaged)


def test_float16_steps_are_counted_with_the_folded_ones(tmp_path: Path) -> None:
    """fp16-without-scaler's evidence counts the steps under float16 autocast: the folded
    ones too."""
    steps = make_steps(n=int((DURATION - 4) / 0.1), wall=0.1, autocast_dtype="float16")
    job = Job(procs=[Proc(1000, cpu=const(100.0))], steps=steps, duration=DURATION)
    full = write(job, tmp_path / "full.sqlite", None)
    folded = write(job, tmp_path / "folded.sqlite", POLICY)
    expected = findings_of(full)
    assert "fp16-without-scaler" in [f.id for f in expected]
    same_findings(expected, findings_of(folded))


def test_a_cuda_peak_in_a_folded_step_is_the_reports_peak(tmp_path: Path) -> None:
    """One step's CUDA peak, folded away with its row, is still the peak the report shows."""
    n = int((DURATION - 4) / 0.1)
    spike = n // 2  # in the folded part of the run, off the kept stride
    steps = make_steps(
        n=n,
        wall=0.1,
        cuda_allocated=1 << 30,
        cuda_reserved=lambda i: (6 << 30) if i == spike else (3 << 30),
        cuda_max_allocated=lambda i: (5 << 30) if i == spike else (2 << 30),
    )
    job = Job(procs=[Proc(1000, cpu=const(100.0))], steps=steps, duration=DURATION)
    folded = write(job, tmp_path / "folded.sqlite", POLICY)
    with open_recording(folded) as rec:
        rows = rec.rows("steps")
        assert spike not in {r["step"] for r in rows}
        table = dict(precision_rows(rows, rec.folded_steps.values()))
    assert table["CUDA peak allocated in a step"] == "5.00 GiB"
    assert table["CUDA reserved (peak)"] == "6.00 GiB"
