"""`torchdoctor run --prometheus --tensorboard` on a real CPU training job, scraped by a real
Prometheus server (1 s interval, 127.0.0.1): step rate, PSS, counters that never go back,
promtool, every panel of the shipped dashboard, and TensorBoard events against the recording.

One job serves the whole module (it runs until the last test stops it), to keep CI short.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from tests.conftest import TORCHDOCTOR
from tests.exporters.jobs import TRAIN
from tests.exporters.prom import PROMETHEUS, PROMTOOL, Prometheus, free_port, prometheus, wait_for
from tests.helpers.engines import engine

pytestmark = engine(
    "prometheus",
    None if os.path.exists(PROMETHEUS) else "Prometheus is not installed (make system)",
)


@dataclass
class LiveJob:
    prom: Prometheus
    proc: subprocess.Popen
    port: int
    recording: Path
    tensorboard: Path
    stop_file: Path
    returncode: int | None = None
    stdout: str = ""
    stderr: str = ""

    def finish(self) -> None:
        if self.returncode is None:
            self.stop_file.touch()
            self.stdout, self.stderr = self.proc.communicate(timeout=180)
            self.returncode = self.proc.returncode


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> LiveJob:
    tmp = tmp_path_factory.mktemp("live")
    script = tmp / "train.py"
    script.write_text(TRAIN)
    port = free_port()
    with prometheus(tmp, [f"127.0.0.1:{port}"]) as prom:
        proc = subprocess.Popen(
            [
                *TORCHDOCTOR, "run", "--prometheus", str(port),
                "--tensorboard", str(tmp / "tb"), "--out", str(tmp / "job.sqlite"),
                "--", sys.executable, str(script), str(tmp / "stop"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        job = LiveJob(prom, proc, port, tmp / "job.sqlite", tmp / "tb", tmp / "stop")
        try:
            yield job
        finally:
            if job.returncode is None and proc.poll() is None:
                job.stop_file.touch()
                try:
                    proc.communicate(timeout=120)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.communicate()


def _scraped(live: LiveJob) -> bool:
    targets = live.prom.api("/api/v1/targets")["activeTargets"]
    return any(t["health"] == "up" for t in targets)


def test_endpoint_listens_on_loopback_only_by_default(live: LiveJob) -> None:
    def listening():
        assert live.proc.poll() is None, live.proc.communicate()
        conns = psutil.Process(live.proc.pid).net_connections(kind="tcp")
        return [c.laddr for c in conns if c.status == psutil.CONN_LISTEN]

    addrs = wait_for("the endpoint to listen", listening)
    assert [(a.ip, a.port) for a in addrs] == [("127.0.0.1", live.port)]
    # It is the recorder that serves: the training process has no listening socket.
    for child in psutil.Process(live.proc.pid).children(recursive=True):
        assert not [c for c in child.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]


def test_prometheus_sees_a_positive_step_rate_and_the_job_pss(live: LiveJob) -> None:
    wait_for("Prometheus to scrape the job", lambda: _scraped(live))
    rate = wait_for(
        "a positive step rate",
        lambda: [r for r in live.prom.query("rate(torchdoctor_steps_total[10s])")
                 if float(r["value"][1]) > 0],
    )  # fmt: skip
    assert rate[0]["metric"].get("rank", "") == ""  # not distributed (empty labels are dropped)
    pss = wait_for(
        "the trainer's PSS",
        lambda: live.prom.query('torchdoctor_job_memory_pss_bytes{role="trainer"} > 0'),
    )
    # A trainer that imported torch holds tens of MiB at least.
    assert float(pss[0]["value"][1]) > 20 * 2**20
    run_id = pss[0]["metric"]["run_id"]
    assert run_id == live.recording.stem


def test_counters_never_decrease(live: LiveJob) -> None:
    wait_for("Prometheus to scrape the job", lambda: _scraped(live))
    series = '{__name__=~"torchdoctor_.+_total"}'
    readings = []
    last_t = 0.0
    for _ in range(3):
        # Each reading after a new scrape of a new sample.
        def newer(after=last_t):
            r = live.prom.query("torchdoctor_sample_timestamp_seconds")
            return r and float(r[0]["value"][1]) > after and r

        last_t = float(wait_for("a newer sample", newer)[0]["value"][1])
        readings.append(
            {json.dumps(r["metric"], sort_keys=True): float(r["value"][1])
             for r in live.prom.query(series)}
        )  # fmt: skip
    names = {json.loads(k)["__name__"] for k in readings[0]}
    assert {"torchdoctor_steps_total", "torchdoctor_job_cpu_seconds_total",
            "torchdoctor_host_cpu_seconds_total"} <= names  # fmt: skip
    for key, first in readings[0].items():
        values = [first] + [r[key] for r in readings[1:] if key in r]
        assert values == sorted(values), f"{key} went back: {values}"
    # Over the whole scrape history too (DataLoader workers exit every epoch meanwhile).
    for name in names:
        assert live.prom.query(f"resets({name}[5m]) > 0") == [], name


def test_metrics_pass_promtool_and_labels_stay_bounded(live: LiveJob) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    wait_for("Prometheus to scrape the job", lambda: _scraped(live))
    with urllib.request.urlopen(f"http://127.0.0.1:{live.port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    check = subprocess.run(
        [PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, check.stdout + check.stderr
    families = list(text_string_to_metric_families(text))
    assert families
    for family in families:
        assert family.name.startswith("torchdoctor_")
        for sample in family.samples:
            # Prometheus adds job and instance; PIDs and command lines would be unbounded.
            assert not {"job", "instance", "pid", "cmdline", "command"} & set(sample.labels)
            if family.type == "counter":
                assert sample.name.endswith("_total")
    types = {f.name: f.type for f in families}
    assert types["torchdoctor_steps"] == "counter"
    assert types["torchdoctor_job_memory_pss_bytes"] == "gauge"
    assert types["torchdoctor_finding_active"] == "gauge"


def test_every_dashboard_panel_query_returns_a_result(live: LiveJob) -> None:
    from torchdoctor.exporters.dashboard import dashboard_text

    dash = json.loads(dashboard_text())
    wait_for("Prometheus to scrape the job", lambda: _scraped(live))
    targets = [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]
    assert len(targets) >= 15
    for title, expr in targets:
        # What Grafana substitutes: the rate window and the variables set to "All".
        query = expr.replace("$__rate_interval", "10s")
        query = re.sub(r"\$(instance|run|rank)\b", ".*", query)
        assert "$" not in query, (title, query)
        job_panel = 'run_id=~".*"' in query and "gpu" not in query
        if job_panel:
            result = wait_for(f"panel {title!r} to show data", lambda q=query: live.prom.query(q))
            assert result, title
        else:
            live.prom.query(query)  # valid PromQL over the names we serve (GPUs: none here)


def test_tensorboard_scalars_match_the_recording(live: LiveJob) -> None:
    import numpy as np
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logdir = live.tensorboard / live.recording.stem

    def scalars_while_running():
        assert live.proc.poll() is None
        acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
        acc.Reload()
        return "step/time_seconds" in acc.Tags()["scalars"]

    # Written during the run, not only at the end.
    wait_for("TensorBoard scalars during the run", scalars_while_running, every_s=1.0)
    live.finish()
    assert live.returncode == 0, live.stderr
    assert "epochs" in live.stdout

    (event_file,) = logdir.glob("*tfevents*")
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"step/time_seconds", "step/data_wait_ratio", "step/samples_per_second",
            "job/cpu_cores", "job/pss_bytes", "host/iowait_ratio",
            "host/swap_used_bytes"} <= tags  # fmt: skip
    for tag in tags:
        steps = [e.step for e in acc.Scalars(tag)]
        assert steps == sorted(steps), f"{tag}: steps go backwards"

    db = sqlite3.connect(live.recording)
    walls = [r[0] for r in db.execute("SELECT wall_s FROM steps ORDER BY rowid")]
    points = acc.Scalars("step/time_seconds")
    assert [p.step for p in points] == list(range(len(walls)))
    assert np.array_equal(
        np.array([p.value for p in points], np.float32), np.array(walls, np.float32)
    )
    waits = [
        r[0] / r[1] for r in db.execute("SELECT data_wait_s, wall_s FROM steps ORDER BY rowid")
    ]
    assert np.allclose([p.value for p in acc.Scalars("step/data_wait_ratio")], waits, rtol=1e-6)

    # PSS: per sample, every live process counted with its latest PSS reading.
    latest: dict[tuple, int] = {}
    expected: dict[float, int] = {}
    for t, pid, ct, pss in db.execute(
        "SELECT t, pid, create_time, pss FROM process_samples ORDER BY rowid"
    ):
        if pss is not None:
            latest[(pid, ct)] = pss
        expected.setdefault(t, 0)
        expected[t] += latest.get((pid, ct), 0)
    got = {round(e.wall_time, 3): e.value for e in acc.Scalars("job/pss_bytes")}
    assert got
    for t, value in got.items():
        match = [v for tt, v in expected.items() if abs(tt - t) < 2e-3]
        assert match and np.float32(match[0]) == np.float32(value)
    swap = [r[0] for r in db.execute("SELECT swap_used FROM host_samples ORDER BY rowid")]
    assert np.array_equal(
        np.array([e.value for e in acc.Scalars("host/swap_used_bytes")], np.float32),
        np.array(swap, np.float32),
    )
    db.close()

    # The same recording exported afterwards gives the same series.
    out = live.tensorboard.parent / "exported"
    res = subprocess.run(
        [*TORCHDOCTOR, "export", str(live.recording), "--format", "tensorboard", "--to", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    again = EventAccumulator(str(out / live.recording.stem), size_guidance={"scalars": 0})
    again.Reload()
    assert set(again.Tags()["scalars"]) == tags
    for tag in ("step/time_seconds", "job/pss_bytes", "host/iowait_ratio"):
        assert [(e.step, e.value) for e in again.Scalars(tag)] == [
            (e.step, e.value) for e in acc.Scalars(tag)
        ]
    assert event_file.name.startswith("events.out.tfevents.")
