"""A long recording's report is read in SQL and streamed: its memory is the charts' resolution,
not the recording's length, and its figures are those of reading every row as a dict."""

from __future__ import annotations

import random
import tracemalloc

import pytest
from long_recording import TRAINER, write_long_recording
from report_recordings import CPUS, Spec, write_recording

from torchdoctor.diagnosis.series import sustained_span
from torchdoctor.recording import open_recording
from torchdoctor.report import readings
from torchdoctor.report.charts import MAX_POINTS
from torchdoctor.report.data import build_report_data
from torchdoctor.report.downsample import downsample_minmax
from torchdoctor.report.sustained import SustainedStream
from torchdoctor.thresholds import Thresholds

MiB = 2**20
SAMPLES = 10_000  # 1 h 23 min at 0.5 s: 200,000 process samples of 20 processes


def no_diagnosis(rec, thresholds):
    return []  # the diagnosis reads its own way (tests/diagnosis/test_long_recordings.py)


@pytest.fixture(scope="module")
def long_path(tmp_path_factory):
    return write_long_recording(tmp_path_factory.mktemp("long") / "long.sqlite", SAMPLES)


def by_label(chart):
    return {s.label: s for s in chart.series}


def test_a_long_recording_reports_in_a_fraction_of_the_memory_of_dict_rows(long_path):
    with open_recording(long_path) as rec:
        rows = rec.count("process_samples")
        assert rows == SAMPLES * 20
        # What a dict per row costs: one process's rows, read the way the report read them.
        tracemalloc.start()
        one = rec.rows("process_samples", where={"pid": TRAINER})
        dict_rows = tracemalloc.get_traced_memory()[0] * rows / len(one)
        tracemalloc.stop()
        del one
        tracemalloc.start()
        try:
            data = build_report_data(rec, Thresholds(), diagnose=no_diagnosis)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert all(chart.series for chart in data.charts), [c.id for c in data.charts]
    assert dict_rows > 100 * MiB, dict_rows  # the process samples alone, as the report read them
    assert peak < dict_rows / 10, (peak, dict_rows)
    assert peak < 16 * MiB, peak


def test_a_long_recordings_charts_are_thinned_and_keep_the_true_peaks(long_path):
    with open_recording(long_path) as rec:
        data = build_report_data(rec, Thresholds(), diagnose=no_diagnosis)

        def sql(query):
            return rec.query(query)[0]["v"]

        job_rss = sql(
            "SELECT MAX(v) AS v FROM (SELECT SUM(rss) AS v FROM process_samples GROUP BY t)"
        )
        trainer_cpu = sql("SELECT MAX(cpu_percent) AS v FROM process_samples WHERE pid = 5000")
        swap_out = sql("SELECT MAX(swap_out_per_s) AS v FROM host_samples")
        trainer_rss = sql("SELECT MAX(rss) AS v FROM process_samples WHERE pid = 5000")
        job_cpu_mean = sql(
            "SELECT AVG(v) AS v FROM (SELECT SUM(cpu_percent) AS v FROM process_samples GROUP BY t)"
        )
    charts = {c.id: c for c in data.charts}
    for chart in data.charts:
        for series in chart.series:
            assert len(series.points) <= MAX_POINTS + 1, (chart.id, series.label)
    memory = by_label(charts["memory"])
    rss = memory["job RSS (shared pages counted per process)"]
    assert rss.samples == SAMPLES and rss.peak == job_rss
    assert any(v == job_rss for _, v in rss.points)  # the one-sample peak is drawn
    assert memory["trainer RSS"].peak == trainer_rss
    assert by_label(charts["cpu"])["job: trainer"].peak == trainer_cpu / CPUS
    swap = by_label(charts["swap"])["swap out"]
    assert swap.peak == swap_out and any(v == swap_out for _, v in swap.points)
    assert len(by_label(charts["steps"])["step time"].points) <= MAX_POINTS
    summary = {f.label: f for f in data.summary}
    assert summary["Job CPU (mean)"].value == f"{job_cpu_mean / 100:.3g} cores"
    assert summary["Steps"].value == f"{SAMPLES * 0.5 / 1.5 - 2:,.0f}"
    trainer = next(p for p in data.processes if p.pid == TRAINER)
    assert trainer.peak_rss == trainer_rss and trainer.peak_cpu == trainer_cpu


def _exact_series(points, t0):
    """What the report drew before it streamed: every point in a list, then thinned."""
    shifted = sorted(((t - t0, v) for t, v in points), key=lambda p: p[0])
    values = [v for _, v in shifted if v is not None]
    return downsample_minmax(shifted, MAX_POINTS), len(values), sum(values) / len(values)


def _exact_sum(rows, key, keep=lambda r: True):
    totals = {}
    for r in rows:
        if keep(r):
            if r["t"] not in totals:
                totals[r["t"]] = r[key]
            elif totals[r["t"]] is None or r[key] is None:
                totals[r["t"]] = None
            else:
                totals[r["t"]] += r[key]
    return sorted(totals.items())


@pytest.mark.parametrize("seconds", [60.0, 1200.0])  # under and over MAX_POINTS samples
def test_the_streamed_reading_draws_what_the_rows_read_as_dicts_draw(tmp_path, seconds):
    spec = Spec(seconds=seconds, gpus=1, per_core=False)
    strict = Thresholds(cpu_load_alert_pct=55.0, cpu_load_best_pct=40.0)
    path = write_recording(tmp_path / "r.sqlite", spec)
    with open_recording(path) as rec:
        data = build_report_data(rec, strict, diagnose=no_diagnosis)
        host = rec.rows("host_samples")
        procs = rec.rows("process_samples")
        t0 = rec.meta["started_at"]
    charts = {c.id: c for c in data.charts}
    expected = {
        ("cpu", "machine busy"): [(r["t"], r["cpu_busy"]) for r in host],
        ("cpu", "job: trainer"): [
            (t, None if v is None else v / CPUS)
            for t, v in _exact_sum(procs, "cpu_percent", lambda r: r["role"] == "trainer")
        ],
        ("memory", "job PSS (shared pages split)"): _exact_sum(procs, "pss"),
        ("disk", "job reads"): _exact_sum(procs, "read_bytes_per_s"),
        ("swap", "swap out"): [(r["t"], r["swap_out_per_s"]) for r in host],
    }
    for (chart, label), points in expected.items():
        series = by_label(charts[chart])[label]
        assert (series.points, series.samples, series.mean) == _exact_series(points, t0), label
    busy = [(r["t"], r["cpu_busy"]) for r in host if r["cpu_busy"] is not None]
    span = sustained_span(busy, strict.cpu_load_alert_pct, strict)
    assert span is not None
    (alert,) = charts["cpu"].alerts
    assert (alert.t_start, alert.t_end) == (span.t_start - t0, span.t_end - t0)


def test_the_streamed_sustained_span_is_the_diagnosis_span():
    rng = random.Random(3)
    th = Thresholds()
    for trial in range(200):
        n = rng.randrange(3, 400)
        t, series = 0.0, []
        for _ in range(n):
            t += rng.choice([0.5, 0.5, 0.5, 0.49, 0.51, 3.0]) if trial % 2 else 0.5
            high = rng.random() < (0.8 if (t // 20) % 2 else 0.2)
            series.append((t, rng.uniform(60, 100) if high else rng.uniform(0, 60)))
        gaps = sorted(b[0] - a[0] for a, b in zip(series, series[1:], strict=False))
        stream = SustainedStream(50.0, th, series[0][0], series[-1][0], gaps[len(gaps) // 2])
        for point in series:
            stream.add(*point)
        assert stream.span() == sustained_span(series, 50.0, th), trial


def _vm_steps(rec, work):
    """SQLite virtual-machine instructions ``work(rec)`` runs: a cost that does not depend on
    how busy the machine is."""
    steps = [0]

    def count():
        steps[0] += 1000
        return 0

    rec._db.set_progress_handler(count, 1000)
    try:
        result = work(rec)
    finally:
        rec._db.set_progress_handler(None, 0)
    return steps[0], result


def test_past_max_instants_a_recording_is_read_at_bounded_resolution(tmp_path, monkeypatch):
    # 2,000 instants at most (not 120,000), so that a recording written in seconds is long.
    monkeypatch.setattr(readings, "MAX_INSTANTS", 2_000)
    costs = {}
    for samples in (SAMPLES, 4 * SAMPLES):
        path = write_long_recording(tmp_path / f"{samples}.sqlite", samples, steps=False)
        with open_recording(path) as rec:
            instants = rec.instants("process_samples", 2_000)
            assert instants.every_s == pytest.approx(samples * 0.5 / 2_000, rel=1e-3)
            times = [t for (t,) in rec.iter_query(
                f"SELECT DISTINCT t FROM process_samples{instants.where()} ORDER BY t",
                instants.params,
            )]  # fmt: skip
            # Evenly spread, the first and the last instant among them.
            assert 2_000 <= len(times) <= 2_001
            gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
            assert max(gaps) <= instants.every_s + 0.5 + 1e-6, max(gaps)
            t_last = rec.query("SELECT MAX(t) AS t FROM process_samples")[0]["t"]
            assert times[-1] == t_last
            costs[samples], data = _vm_steps(
                rec, lambda r: build_report_data(r, Thresholds(), diagnose=no_diagnosis)
            )
        cpu = by_label({c.id: c for c in data.charts}["cpu"])["job: trainer"]
        assert 2_000 <= cpu.samples <= 2_001  # the chart read the instants chosen
        assert data.resolution_note and "one sampling instant every" in data.resolution_note
    # Four times the recording, about the same work: index seeks, never a scan.
    assert costs[4 * SAMPLES] < 1.5 * costs[SAMPLES], costs


def test_up_to_max_instants_every_instant_is_read(long_path):
    with open_recording(long_path) as rec:
        assert rec.instants("process_samples", SAMPLES).every_s is None
        assert rec.frame("process_samples", max_instants=SAMPLES).every_s is None
        data = build_report_data(rec, Thresholds(), diagnose=no_diagnosis)
    assert data.resolution_note is None
