"""The recording -> report data step: downsampling, charts, process tree, settings, summary."""

from __future__ import annotations

import math

import pytest
from report_recordings import CPUS, GIB, T0, TRAINER, Spec, write_recording

from torchdoctor.recording import open_recording
from torchdoctor.report.charts import MAX_HEATMAP_CELLS, MAX_POINTS
from torchdoctor.report.data import build_report_data
from torchdoctor.report.downsample import downsample_minmax
from torchdoctor.report.scales import fmt_clock, fmt_value, nice_ticks, time_ticks
from torchdoctor.report.tables import process_tree
from torchdoctor.thresholds import Thresholds

# -- downsampling -------------------------------------------------------------------------


def test_downsampling_keeps_the_one_sample_spike_and_dip_of_a_long_series():
    n = 200_000  # a day at 0.5 s
    points = [(i * 0.5, 50.0 + 10 * math.sin(i / 300)) for i in range(n)]
    points[123_457] = (points[123_457][0], 99.5)  # one-sample spike
    points[7_001] = (points[7_001][0], 0.25)  # one-sample dip
    out = downsample_minmax(points, 1000)
    assert len(out) <= 1000
    values = [v for _, v in out]
    assert 99.5 in values and 0.25 in values
    assert max(values) == 99.5 and min(values) == 0.25
    times = [t for t, _ in out]
    assert times == sorted(times)
    assert times[0] == 0.0 and times[-1] <= points[-1][0]


def test_downsampling_leaves_short_series_alone_and_keeps_gaps():
    short = [(0.0, 1.0), (0.5, None), (1.0, 3.0)]
    assert downsample_minmax(short, 10) == short
    # A long stretch with no readings (NVML lost the GPU) stays a break in the line.
    points = [(float(i), None if 400 <= i < 600 else float(i % 7)) for i in range(1000)]
    out = downsample_minmax(points, 100)
    gap = [t for t, v in out if v is None]
    assert gap and all(400 <= t < 600 for t in gap)
    assert any(v == 6.0 for _, v in out) and any(v == 0.0 for _, v in out)


def test_downsampling_rejects_a_budget_too_small_to_hold_min_and_max():
    with pytest.raises(ValueError):
        downsample_minmax([(0.0, 1.0)], 1)


# -- units --------------------------------------------------------------------------------


def test_figures_and_axes_read_like_a_person_writes_them():
    assert fmt_value(3 * GIB, "B") == "3.00 GiB"
    assert fmt_value(1_500_000, "B/s") == "1.5 MB/s"
    assert fmt_value(0.0893, "s") == "89.3 ms"
    assert fmt_value(41.37, "%") == "41.4 %"
    assert fmt_value(0.0318, "%") == "< 0.1 %" and fmt_value(0.0, "%") == "0 %"
    assert fmt_value(None, "%") == "n/a"
    assert fmt_clock(65) == "1:05" and fmt_clock(3725) == "1:02:05"
    assert nice_ticks(0, 100) == [0, 20, 40, 60, 80, 100]
    assert time_ticks(600) == [0, 120, 240, 360, 480, 600]


# -- charts from a recording ----------------------------------------------------------------


@pytest.fixture(scope="module")
def cpu_job(tmp_path_factory):
    path = write_recording(tmp_path_factory.mktemp("rec") / "cpu.sqlite")
    with open_recording(path) as rec:
        yield build_report_data(rec, Thresholds())


@pytest.fixture(scope="module")
def gpu_job(tmp_path_factory):
    path = write_recording(tmp_path_factory.mktemp("rec") / "gpu.sqlite", Spec(gpus=2))
    with open_recording(path) as rec:
        yield build_report_data(rec, Thresholds())


def charts(data):
    return {c.id: c for c in data.charts}


def test_every_timeline_is_there_with_the_threshold_bands(gpu_job):
    by_id = charts(gpu_job)
    assert list(by_id) == ["cpu", "iowait", "disk", "memory", "swap", "gpu-util", "vram", "steps"]
    for chart in gpu_job.charts:
        assert chart.unavailable is None, chart.id
        assert chart.series and all(s.points for s in chart.series), chart.id
    th = Thresholds()
    assert [(b.kind, b.low, b.high) for b in by_id["cpu"].bands] == [
        ("best", 0.0, th.cpu_load_best_pct),
        ("alert", th.cpu_load_alert_pct, None),
    ]
    assert [(b.kind, b.low, b.high) for b in by_id["vram"].bands] == [
        ("best", th.gpu_memory_best_low_pct, th.gpu_memory_best_high_pct),
        ("alert", th.gpu_memory_alert_pct, None),
    ]
    assert {b.kind for b in by_id["iowait"].bands} == {"best", "alert"}
    assert {b.kind for b in by_id["swap"].bands} == {"best", "alert"}


def test_per_cpu_heatmap_shows_which_cpus_the_job_keeps_busy(cpu_job):
    heat = cpu_job.cores
    assert heat.unavailable is None
    assert heat.rows == [f"CPU {i}" for i in range(CPUS)]
    assert len(heat.t_edges) == len(heat.cells[0]) + 1
    assert len(heat.rows) * len(heat.cells[0]) <= MAX_HEATMAP_CELLS

    def mean(row):
        return sum(v for v in row if v is not None) / len([v for v in row if v is not None])

    # The recording's first six CPUs carry the job; the other ten are mostly idle.
    assert min(mean(r) for r in heat.cells[:6]) > 2 * max(mean(r) for r in heat.cells[6:])


def test_job_cpu_is_summed_per_role_as_a_share_of_the_allowed_cpus(cpu_job):
    series = {s.label: s for s in charts(cpu_job)["cpu"].series}
    assert set(series) == {"machine busy", "job: trainer", "job: DataLoader workers"}
    # The trainer runs at 380-390 % of one core, four workers at 95-105 % each, on 16 CPUs.
    assert 380 / CPUS <= series["job: trainer"].mean <= 390 / CPUS
    assert 4 * 95 / CPUS <= series["job: DataLoader workers"].mean <= 4 * 105 / CPUS


def test_no_gpu_charts_say_why_instead_of_drawing_empty_axes(cpu_job):
    by_id = charts(cpu_job)
    for chart_id in ("gpu-util", "vram"):
        assert by_id[chart_id].series == []
        assert by_id[chart_id].unavailable == (
            "no GPU / NVML unavailable: NVML Shared Library Not Found"
        )


def test_a_long_recording_is_thinned_but_its_swap_spike_survives(tmp_path):
    spec = Spec(
        seconds=2 * 3600, interval=1.0, workers=1, steps=False, swap_spike_at=5001.0, per_core=False
    )
    path = write_recording(tmp_path / "long.sqlite", spec)
    with open_recording(path) as rec:
        data = build_report_data(rec, Thresholds())
    swap = {s.label: s for s in charts(data)["swap"].series}["swap out"]
    assert swap.samples == 2 * 3600 - 1  # every measured sample counted...
    assert len(swap.points) <= MAX_POINTS  # ...but no more points drawn than pixels
    assert swap.peak == spec.swap_spike
    assert any(v == spec.swap_spike and abs(t - 5001.0) < 1.0 for t, v in swap.points)
    for chart in data.charts:
        assert all(len(s.points) <= MAX_POINTS for s in chart.series), chart.id


def test_sustained_alerts_are_marked_and_a_single_spike_is_not(tmp_path):
    # One sample of 48 MB/s swap-out: above the alert limit, but not sustained.
    path = write_recording(tmp_path / "spike.sqlite")
    with open_recording(path) as rec:
        data = build_report_data(rec, Thresholds())
    assert charts(data)["swap"].alerts == []
    summary = {f.label: f for f in data.summary}
    assert summary["Swap traffic (mean)"].level == "ok"
    # The same job judged against a CPU alert limit below its load: a sustained alert.
    strict = Thresholds(cpu_load_alert_pct=40.0, cpu_load_best_pct=30.0)
    with open_recording(path) as rec:
        data = build_report_data(rec, strict)
    (alert,) = charts(data)["cpu"].alerts
    assert alert.t_end - alert.t_start > 50
    assert {f.label: f for f in data.summary}["CPU busy (mean)"].level == "alert"


def test_vram_is_a_share_of_each_device_with_the_jobs_part(gpu_job):
    series = {s.label: s for s in charts(gpu_job)["vram"].series}
    all0 = series["GPU 0 (NVIDIA A100-SXM4-80GB): all processes"]
    job0 = series["GPU 0 (NVIDIA A100-SXM4-80GB): this job"]
    assert all0.peak == pytest.approx(100 * 70 / 80)
    assert job0.peak == pytest.approx(100 * 68 / 80)


def test_summary_states_the_main_figures(cpu_job):
    summary = {f.label: f for f in cpu_job.summary}
    assert summary["Duration"].value == "1 min 00 s"
    assert "status 0" in summary["Duration"].detail
    assert summary["Steps"].value.replace(",", "").isdigit()
    data_wait = float(summary["Data wait"].value.split()[0])
    assert 35 < data_wait < 48  # 80-100 ms of every 200-230 ms step
    assert summary["GPU"].value == "none"
    assert cpu_job.verdict and cpu_job.verdict_level in ("ok", "warn", "alert")


def test_the_data_bound_job_gets_its_finding_from_the_diagnosis(cpu_job):
    assert cpu_job.diagnosis_note is None
    ids = [f.id for f in cpu_job.findings]
    assert "dataloader-bound" in ids
    assert cpu_job.verdict == cpu_job.findings[0].title


def test_a_failing_diagnosis_costs_the_findings_not_the_report(tmp_path):
    path = write_recording(tmp_path / "r.sqlite")

    def broken(rec, thresholds):
        raise RuntimeError("rule exploded")

    with open_recording(path) as rec:
        data = build_report_data(rec, Thresholds(), diagnose=broken)
    assert data.findings == []
    assert "RuntimeError: rule exploded" in data.diagnosis_note
    assert all(c.series for c in data.charts if c.id not in ("gpu-util", "vram"))


def test_step_chart_marks_epochs_and_says_why_when_there_are_no_steps(cpu_job, tmp_path):
    steps = charts(cpu_job)["steps"]
    assert [s.label for s in steps.series] == ["step time", "data wait"]
    assert [m.label for m in steps.markers] == ["epoch 0", "epoch 1", "epoch 2"]
    path = write_recording(tmp_path / "plain.sqlite", Spec(steps=False))
    with open_recording(path) as rec:
        data = build_report_data(rec, Thresholds())
    assert "no training steps were recorded" in charts(data)["steps"].unavailable


# -- process tree, settings, metadata --------------------------------------------------------


def test_process_tree_nests_workers_under_the_trainer_with_their_peaks(cpu_job):
    rows = cpu_job.processes
    assert [(r.depth, r.role) for r in rows] == [(0, "trainer")] + [(1, "dataloader-worker")] * 4
    trainer = rows[0]
    assert trainer.pid == TRAINER
    assert trainer.peak_rss == int((3.0 + 0.01 * 119) * GIB)
    assert trainer.peak_threads == 24
    assert 380 <= trainer.peak_cpu <= 390
    assert trainer.cmdline[:2] == ["python", "train.py"]


def test_workers_recreated_every_epoch_are_folded_into_one_row():
    infos = [
        dict(
            pid=1,
            ppid=0,
            create_time=0.0,
            name="python",
            cmdline=["python"],
            role="trainer",
            rank=None,
        )
    ]
    samples = []
    for i in range(40):  # 40 short-lived workers (10 epochs x 4, not persistent)
        pid = 100 + i
        infos.append(
            dict(
                pid=pid,
                ppid=1,
                create_time=1.0 + i,
                name="python",
                cmdline=[],
                role="dataloader-worker",
                rank=None,
            )
        )
        samples.append(
            dict(
                t=1.5 + i,
                pid=pid,
                create_time=1.0 + i,
                cpu_percent=90.0 + i,
                rss=10 + i,
                pss=5,
                swap=0,
                threads=3,
            )
        )
    rows, count = process_tree(infos, samples, 0.0)
    assert count == 41
    assert [r.folded for r in rows] == [0, 0, 0, 0, 37]
    folded = rows[-1]
    assert folded.peak_cpu == 90.0 + 39 and folded.peak_rss == 10 + 39
    assert folded.first_seen == 1.5 + 3 and folded.last_seen == 1.5 + 39


def test_settings_are_grouped_and_shown_once_per_value(cpu_job):
    rows = {(s.key, s.value): s for s in cpu_job.settings}
    assert ("torch.num_threads", "16") in rows
    assert rows[("optimizer.class", "AdamW")].group == "Optimizer"
    assert rows[("env.OMP_NUM_THREADS", "16")].group == "Environment of the job"
    (loader,) = cpu_job.dataloaders
    assert loader["num_workers"] == "4" and loader["pin_memory"] == "no"
    assert loader["dataset"] == "ImageFolder (120,000 items)"
    assert loader["first_batch"] == "1.40 s"


def test_run_metadata_names_the_machine_gpus_and_environment(cpu_job):
    sections = {s.title: dict(s.rows) for s in cpu_job.meta}
    assert sections["Run"]["command"] == "python train.py --epochs 3 --data '/data/imagenet subset'"
    assert sections["Machine"]["allowed CPUs (affinity)"] == "0-15 (16 CPUs)"
    assert sections["Machine"]["RAM"] == "64.0 GiB"
    assert sections["GPUs"]["NVML"] == "unavailable: NVML Shared Library Not Found"
    assert sections["Environment"]["OMP_NUM_THREADS"] == "16"


def test_a_recording_cut_short_says_so(tmp_path):
    path = write_recording(tmp_path / "cut.sqlite", Spec(complete=False))
    with open_recording(path) as rec:
        data = build_report_data(rec, Thresholds())
    assert data.complete is False
    assert data.span_s == pytest.approx(59.5)
    assert "cut short" in dict(next(s for s in data.meta if s.title == "Run").rows)["ended"]


def test_times_are_relative_to_the_start_of_the_run(cpu_job):
    assert cpu_job.started_at == T0
    cpu = charts(cpu_job)["cpu"].series[0]
    assert cpu.points[0] == (0.0, None)  # the first busy figure needs two readings
    assert cpu.points[1][0] == pytest.approx(0.5)
