"""`torchdoctor run --prometheus --tensorboard` on a real CPU training job, scraped by a real
Prometheus server (1 s interval, 127.0.0.1): step rate, PSS, counters that never go back,
promtool, every panel of the shipped dashboard, and TensorBoard events against the recording.

One job serves the whole module (it runs until the last test stops it), to keep CI short.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from dataclasses import dataclass

import psutil
import pytest

from tests.conftest import TORCHDOCTOR
from tests.exporters.jobs import TRAIN, StoppableJob
from tests.exporters.prom import PROMETHEUS, PROMTOOL, Prometheus, free_port, prometheus, wait_for
from tests.helpers.engines import engine
from tests.sampling.gpu_fixtures import fake_nvml

pytestmark = engine(
    "prometheus",
    None if os.path.exists(PROMETHEUS) else "Prometheus is not installed (make system)",
)


@dataclass
class LiveJob(StoppableJob):
    """The job and the Prometheus server scraping its endpoint on ``port``."""

    prom: Prometheus | None = None
    port: int = 0


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> LiveJob:
    tmp = tmp_path_factory.mktemp("live")
    script = tmp / "train.py"
    script.write_text(TRAIN)
    # Two fake GPUs (tests/nvml/fake_nvml.c under the real pynvml): the GPU panels have data.
    gpus = [fake_nvml.FakeGpu(utilization_gpu=[20, 60, 90], power_mw=[150_000, 210_000]),
            fake_nvml.FakeGpu(uuid="GPU-3b1f6c52-0d7e-4b8e-9a51-8f6a3a1c0001")]  # fmt: skip
    scenario = fake_nvml.write_scenario(tmp / "gpus.nvml", gpus)
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
            env={**fake_nvml.subprocess_env(scenario), "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        job = LiveJob(proc, tmp / "job.sqlite", tmp / "tb", tmp / "stop", prom=prom, port=port)
        try:
            yield job
        finally:
            job.ensure_stopped()


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
    """All 22 queries of the board's panels return data from the real Prometheus: the host and
    job series a CPU-only machine has, and the GPU series of the two fake GPUs."""
    from torchdoctor.exporters.dashboard import dashboard_text

    dash = json.loads(dashboard_text())
    wait_for("Prometheus to scrape the job", lambda: _scraped(live))
    targets = [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]
    assert len(targets) == 22
    psi = os.path.exists("/proc/pressure/cpu")  # kernels without PSI serve no pressure series
    for title, expr in targets:
        # What Grafana substitutes: the rate window and the variables set to "All".
        query = expr.replace("$__rate_interval", "10s")
        query = re.sub(r"\$(instance|run|rank)\b", ".*", query)
        assert "$" not in query, (title, query)
        if "pressure" in query and not psi:
            assert live.prom.query(query) == [], title  # valid PromQL, nothing to show
            continue
        result = wait_for(f"panel {title!r} to show data", lambda q=query: live.prom.query(q))
        assert result, (title, query)
    gpus = {r["metric"]["gpu"] for r in live.prom.query("torchdoctor_gpu_utilization_ratio")}
    assert gpus == {"0", "1"}
