"""One bad registered job never blinds or wedges the machine's exporter: a job whose
recording is a FIFO, or whose recording's meta was edited (not JSON, or text for a time),
shows as ``job_recording_up 0`` alone, said once on stderr; the host and the other jobs are
served at every scrape, and Ctrl-C still stops the exporter."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import TORCHDOCTOR
from tests.exporters.prom import free_port
from tests.exporters.test_scrape_path import _recording  # a real recording of this process
from torchdoctor.recording import registry


@pytest.fixture
def live_jobs() -> Iterator[list[subprocess.Popen]]:
    """Processes that stand for running jobs (a registry entry needs a live PID); each waits
    for its stdin to close."""
    procs: list[subprocess.Popen] = []
    yield procs
    for proc in procs:
        proc.stdin.close()
        proc.wait(timeout=30)


def _announce(procs: list[subprocess.Popen], recording: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    procs.append(proc)
    registry.register(proc.pid, recording)


def _scrape(url: str) -> dict:
    # A timeout: before the fix a FIFO's scrape never answered.
    with urllib.request.urlopen(url, timeout=20) as resp:
        assert resp.status == 200
        return {f.name: f for f in text_string_to_metric_families(resp.read().decode())}


def test_a_fifo_and_a_damaged_recording_are_left_out_and_the_rest_is_served(
    runtime_dir: Path, tmp_path: Path, live_jobs: list[subprocess.Popen]
) -> None:
    fifo = tmp_path / "fifojob.sqlite"
    os.mkfifo(fifo)
    damaged = _recording(tmp_path / "damagedjob.sqlite")
    with sqlite3.connect(damaged) as db:
        db.execute("UPDATE meta SET value = '{not json' WHERE key = 'mode'")
    db.close()
    # Valid JSON of the wrong type: read fine, failing only as the job's series are built.
    typed = _recording(tmp_path / "typedjob.sqlite")
    with sqlite3.connect(typed) as db:
        db.execute("""UPDATE meta SET value = '"abc"' WHERE key = 'started_at'""")
    db.close()
    good = _recording(tmp_path / "goodjob.sqlite")
    for path in (fifo, damaged, typed, good):
        _announce(live_jobs, path)

    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    exporter = subprocess.Popen(
        [*TORCHDOCTOR, "exporter", "--listen", str(port)],
        env={**os.environ, "XDG_RUNTIME_DIR": str(runtime_dir)},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert url in exporter.stderr.readline()
        for _ in range(3):  # every scrape, not only the first
            fams = _scrape(url)
            assert fams["torchdoctor_host_memory_total_bytes"].samples[0].value > 0
            assert fams["torchdoctor_exporter_jobs"].samples[0].value == 4
            up = {s.labels["run_id"]: s.value for s in fams["torchdoctor_job_recording_up"].samples}
            assert up == {"fifojob": 0, "damagedjob": 0, "typedjob": 0, "goodjob": 1}
            # The bad jobs have no other series; the good one has all of its own.
            info = fams["torchdoctor_job_info"].samples
            assert {s.labels["run_id"] for s in info} == {"goodjob"}
        # Ctrl-C stops it (before the fix a FIFO's scrape held the lock its close waits for).
        exporter.send_signal(signal.SIGINT)
        _, err = exporter.communicate(timeout=30)
    finally:
        if exporter.poll() is None:  # ours, started above: stopped by its PID
            exporter.kill()
            exporter.communicate()
    assert exporter.returncode == 0, err
    left_out = [line for line in err.splitlines() if "left out" in line]
    # Once a job, not once a scrape; one line each, saying what is wrong.
    assert len(left_out) == 3, err
    assert any("fifojob.sqlite" in line and "not a regular file" in line for line in left_out)
    assert any("damagedjob.sqlite" in line and "'mode' is not JSON" in line for line in left_out)
    assert any("typedjob.sqlite" in line and "'abc' is not a number" in line for line in left_out)
    assert "Traceback" not in err
