"""Nothing slow on the scrape path: the diagnosis runs beside the scrapes, in a thread of its
own, and a scrape takes its findings as they stand (none until the first run ended)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from torchdoctor.diagnosis.rediagnosis import BudgetedDiagnosis
from torchdoctor.exporters.prometheus import HostCollector, JobCollector, registry_for
from torchdoctor.recording import RecordingWriter
from torchdoctor.sampling.job import JobReader
from torchdoctor.sampling.sampler import Sampler


def _names(collector) -> set[str]:
    text = generate_latest(registry_for(collector)).decode()
    return {f.name for f in text_string_to_metric_families(text)}


def _recording(path: Path) -> Path:
    writer = RecordingWriter(path, {"started_at": 0.0, "mode": "run"})
    sampler = Sampler(None, JobReader(os.getpid()), None)
    try:
        writer.write_snapshot(sampler.snapshot())
        writer.flush()
    finally:
        sampler.close()
        writer.close()
    return path


class HeldDiagnosis:
    """BudgetedDiagnosis.run_once held until the test lets it go; says when its findings
    were kept."""

    def __init__(self, monkeypatch) -> None:
        self.release = threading.Event()
        self.done = threading.Event()
        self.threads: set[str] = set()
        run_once = BudgetedDiagnosis.run_once
        record = BudgetedDiagnosis.record

        def held(budget, path):
            self.threads.add(threading.current_thread().name)
            self.release.wait(30)
            return run_once(budget, path)

        def recorded(budget, *args):
            record(budget, *args)
            self.done.set()

        monkeypatch.setattr(BudgetedDiagnosis, "run_once", held)
        monkeypatch.setattr(BudgetedDiagnosis, "record", recorded)


def test_a_scrape_never_waits_for_the_diagnosis(tmp_path: Path, monkeypatch) -> None:
    held = HeldDiagnosis(monkeypatch)
    path = _recording(tmp_path / "job.sqlite")
    for collector in (JobCollector(path), HostCollector(None, None, lambda: [path])):
        held.release.clear()
        held.done.clear()
        try:
            # The diagnosis is held: the scrape answers all the same, findings left out.
            names = _names(collector)
            assert "torchdoctor_job_recording_up" in names
            assert "torchdoctor_finding_active" not in names
            held.release.set()
            assert held.done.wait(30)
            # The run ended beside the scrapes: the next scrape serves its findings.
            assert "torchdoctor_finding_active" in _names(collector)
        finally:
            held.release.set()
            collector.close()
    assert held.threads == {"torchdoctor-diagnosis"}
