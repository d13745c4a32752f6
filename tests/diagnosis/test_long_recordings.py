"""The diagnosis of a long recording: the same findings as when every row is read as a dict
(the way the context read recordings before it read them column by column), in a fraction of
the memory."""

from __future__ import annotations

import dataclasses
import tracemalloc
from collections import defaultdict
from functools import cached_property

import pytest

from tests.diagnosis.builders import GiB, Gpu, Job, Proc, const, make_steps
from torchdoctor.diagnosis import context, engine
from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.diagnosis.series import nearest
from torchdoctor.recording.reader import open_recording
from torchdoctor.recording.steps import step_stats
from torchdoctor.thresholds import Thresholds

HOURS = 2.0
MiB = 2**20


class DictRowsContext(DiagnosisContext):
    """The reference: every sample and step row read with Recording.rows(), one dict per row."""

    @cached_property
    def steps(self):
        return self.recording.steps()

    @cached_property
    def step_summary(self):
        rec = self.recording
        steps = rec.steps()
        stats = step_stats(steps, rec.rows("dataloaders"), rec.rows("settings")) if steps else None
        return self.verdict_ready(stats)

    @cached_property
    def host_samples(self):
        return [
            s
            for s in self.recording.rows("host_samples")
            if self.t_start - 1e-6 <= s["t"] <= self.t_end + 1e-6
        ]

    def host_series(self, column):
        return [(s["t"], float(s[column])) for s in self.host_samples if s.get(column) is not None]

    @cached_property
    def process_samples(self):
        return self.recording.rows("process_samples")

    @cached_property
    def samples_by_pid(self):
        out = defaultdict(list)
        for s in self.process_samples:
            out[s["pid"]].append(s)
        return dict(out)

    @cached_property
    def job_cores_series(self):
        by_t = {}
        for s in self.process_samples:
            if s["cpu_percent"] is not None:
                by_t[s["t"]] = by_t.get(s["t"], 0.0) + s["cpu_percent"] / 100
        return sorted(by_t.items())

    def available_cores(self, t0, t1):
        job = self.job_cores_series
        values = []
        for s in self.host_samples:
            if not (t0 <= s["t"] <= t1) or s["cpu_busy"] is None:
                continue
            cores = nearest(job, s["t"], tolerance=0.05)
            if cores is not None:
                idle = max(100.0 - s["cpu_busy"], 0.0) / 100 * self.allowed_cpus
                values.append(min(cores + idle, self.usable_cpus))
        return sum(values) / len(values) if values else None

    @cached_property
    def gpu_samples(self):
        out = defaultdict(list)
        for s in self.recording.rows("gpu_samples"):
            if self.t_start - 1e-6 <= s["t"] <= self.t_end + 1e-6:
                out[s["index"]].append(s)
        return dict(out)

    @cached_property
    def gpu_memory_holders(self):
        found = {
            (r["gpu_index"], r["pid"], bool(r["in_job"]))
            for r in self.recording.rows("gpu_process_samples")
            if (r["used_memory"] or 0) > 0
        }
        return sorted(found)

    def gpu_series(self, index, column):
        return [
            (s["t"], float(s[column]))
            for s in self.gpu_samples.get(index, [])
            if s.get(column) is not None
        ]


def long_job() -> Job:
    """Two hours of a GPU job that leaks host memory, waits on its disk for a quarter of an
    hour, and leaves its GPU mostly idle: several rules speak, over long series."""
    duration = HOURS * 3600
    trainer = Proc(
        1000,
        cpu=lambda t: 60.0 + 30.0 * ((t // 7) % 2),
        rss=lambda t: 2 * GiB + t * 40_000,  # ~0.3 GiB over the run, steadily
        uss=lambda t: 1.5 * GiB + t * 40_000,
        read=lambda t: 80e6 if 1800 <= t <= 2700 else 1e6,
        gpu_memory=const(6 * GiB),
    )
    worker = Proc(1001, role="dataloader-worker", cpu=const(45.0), rss=const(0.4 * GiB))

    def host(t: float) -> dict:
        if 1800 <= t <= 2700:
            return {"iowait": 35.0, "procs_blocked": 3, "psi_io_some": 40.0}
        return {}

    return Job(
        cpus=4,
        duration=duration,
        procs=[trainer, worker],
        gpus=[Gpu(util=lambda t: 20.0 + 5.0 * ((t // 11) % 2), used=const(7 * GiB))],
        host=host,
        steps=make_steps(n=int(duration / 1.5) - 10, wall=1.5, wait=0.9, start=5.0),
    )


@pytest.fixture(scope="module")
def long_recording(tmp_path_factory):
    return long_job().write(tmp_path_factory.mktemp("long") / "long.sqlite")


def _diagnose(path, context_class, monkeypatch):
    monkeypatch.setattr(engine, "DiagnosisContext", context_class)
    with open_recording(path) as rec:
        tracemalloc.start()
        try:
            findings = engine.diagnose(rec)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    return [dataclasses.asdict(f) for f in findings], peak


def test_a_long_recording_gets_the_findings_of_dict_rows_in_a_fraction_of_the_memory(
    long_recording, monkeypatch
):
    with open_recording(long_recording) as rec:
        assert rec.count("host_samples") == HOURS * 3600 / 0.5
    findings, peak = _diagnose(long_recording, DiagnosisContext, monkeypatch)
    reference, reference_peak = _diagnose(long_recording, DictRowsContext, monkeypatch)
    ids = [f["id"] for f in findings]
    # The recording is made to speak: a check that compares two silences proves nothing.
    assert {"host-memory-leak", "io-wait", "gpu-underused"} <= set(ids), ids
    assert findings == reference
    # 14,400 host and 28,800 process samples: read as dicts they cost tens of MiB.
    assert reference_peak > 40 * MiB, reference_peak
    assert peak < reference_peak / 3, (peak, reference_peak)
    assert peak < 24 * MiB, peak


def test_a_frame_reads_like_the_rows_it_holds(long_recording):
    with open_recording(long_recording) as rec:
        rows = rec.rows("process_samples", where={"pid": 1001})
        frame = rec.frame("process_samples", where={"pid": 1001})
        assert len(frame) == len(rows)
        for i in (0, 1, len(rows) // 2, -1):
            for column in ("t", "cpu_percent", "rss", "uss", "pss", "role", "gpu_memory"):
                assert frame[i][column] == rows[i][column], (i, column)
                assert frame[i].get(column) == rows[i].get(column)
        assert [r["t"] for r in frame[-3:]] == [r["t"] for r in rows[-3:]]
        steps, step_rows = rec.frame("steps"), rec.steps()
        assert len(steps) == len(step_rows)
        assert [(s["step"], s["t_end"], s["batch_size"], s["forward_s"]) for s in steps] == [
            (s["step"], s["t_end"], s["batch_size"], s["forward_s"]) for s in step_rows
        ]
        grouped = rec.frame("process_samples").group_by("pid")
        assert sorted(grouped) == [1000, 1001]
        assert list(grouped[1001].values("t")) == [r["t"] for r in rows]
        t0, t1 = rows[10]["t"], rows[20]["t"]
        window = rec.frame("host_samples", t_from=t0, t_to=t1)
        assert [t for t, _ in window.series("cpu_busy")] == [
            r["t"] for r in rec.rows("host_samples") if t0 <= r["t"] <= t1
        ]


def test_past_max_instants_the_diagnosis_reads_a_bounded_resolution_and_finds_the_same(
    long_recording, monkeypatch
):
    findings, _ = _diagnose(long_recording, DiagnosisContext, monkeypatch)
    # 2,000 instants of the 14,400 (one per 3.6 s), as a week is read at 43,200 of 1.2 million.
    monkeypatch.setattr(context, "MAX_INSTANTS", 2_000)
    thinned, _ = _diagnose(long_recording, DiagnosisContext, monkeypatch)
    with open_recording(long_recording) as rec:
        ctx = DiagnosisContext(rec, Thresholds())
        assert ctx.process_samples.every_s == pytest.approx(HOURS * 3600 / 2_000, rel=1e-3)
        assert ctx.host_samples.every_s == pytest.approx(HOURS * 3600 / 2_000, rel=1e-3)
        assert 2 * 2_000 <= len(ctx.process_samples) <= 2 * 2_001
        assert (
            ctx.samples_by_pid[1000][-1]["t"]
            == rec.query("SELECT MAX(t) AS t FROM process_samples")[0]["t"]
        )  # the last instant is always read
    # The verdicts stand: the same findings at the same severities, with the same fixes.
    assert [(f["id"], f["severity"], f["settings"]) for f in thinned] == [
        (f["id"], f["severity"], f["settings"]) for f in findings
    ]
