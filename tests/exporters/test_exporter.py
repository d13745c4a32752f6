"""`torchdoctor exporter`: the machine plus every recorded job it finds; the shipped dashboard;
and what `run --prometheus` does when its address cannot be served."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import TORCHDOCTOR, run_td
from tests.exporters.jobs import TRAIN
from tests.exporters.prom import free_port, wait_for


def _me() -> str:
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name  # the exporter labels each job with its owner


def _families(url: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as resp:
        return {f.name: f for f in text_string_to_metric_families(resp.read().decode())}


def test_an_address_in_use_gives_one_line_and_the_job_still_runs(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = run_td(
            "run", "--quiet", "--prometheus", str(port), "--out", str(tmp_path / "r.sqlite"),
            "--", sys.executable, "-c", "print('job ran'); raise SystemExit(4)",
        )  # fmt: skip
    assert res.returncode == 4  # the job's own status
    assert res.stdout == "job ran\n"
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert f"127.0.0.1:{port}" in lines[0] and "already in use" in lines[0]
    assert lines[0].startswith("torchdoctor: ")
    assert (tmp_path / "r.sqlite").exists()


def test_bad_prometheus_option_is_refused_before_the_job_starts(tmp_path: Path) -> None:
    marker = tmp_path / "started"
    res = run_td(
        "run", "--prometheus", "localhost:http", "--out", str(tmp_path / "r.sqlite"),
        "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')",
    )  # fmt: skip
    assert res.returncode != 0
    assert res.stderr.startswith("torchdoctor: error: --prometheus 'localhost:http'")
    assert not marker.exists()


def test_exporter_serves_the_host_and_each_recorded_job(tmp_path: Path) -> None:
    # A registry of our own, shared by the exporter and the job it must find.
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime), "OMP_NUM_THREADS": "1"}
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    exporter = subprocess.Popen(
        [*TORCHDOCTOR, "exporter", "--listen", str(port)],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    stop = tmp_path / "stop"
    rec = tmp_path / "fleetjob.sqlite"
    job = None
    try:
        line = exporter.stderr.readline()
        assert f"http://127.0.0.1:{port}/metrics" in line, line
        host = _families(url)
        assert host["torchdoctor_host_cpu_seconds"].type == "counter"
        assert host["torchdoctor_host_memory_total_bytes"].samples[0].value > 0
        assert host["torchdoctor_exporter_jobs"].samples[0].value == 0
        assert host["torchdoctor_gpu_up"].samples[0].value in (0, 1)

        job = subprocess.Popen(
            [*TORCHDOCTOR, "run", "--quiet", "--out", str(rec), "--",
             sys.executable, str(script), str(stop)],
            env=env, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip

        def job_steps():
            fams = _families(url)
            steps = fams.get("torchdoctor_steps")
            ours = [s for s in steps.samples if s.labels["run_id"] == "fleetjob"] if steps else []
            return ours and ours[0].value > 0 and fams

        fams = wait_for("the exporter to serve the job's steps", job_steps)
        assert fams["torchdoctor_exporter_jobs"].samples[0].value == 1
        pss = [
            s
            for s in fams["torchdoctor_job_memory_pss_bytes"].samples
            if s.labels == {"run_id": "fleetjob", "role": "trainer", "user": _me()}
        ]
        assert pss  # PSS may still be on its slower tier at the first samples
        # The run endpoint's series and the exporter's carry the same run_id.
        assert {s.labels["run_id"] for s in fams["torchdoctor_job_info"].samples} == {"fleetjob"}
        stop.touch()
        job.communicate(timeout=120)
        assert job.returncode == 0
        # The job ended and unregistered: its series are gone, the host's stay.
        after = _families(url)
        assert after["torchdoctor_exporter_jobs"].samples[0].value == 0
        assert "torchdoctor_steps" not in after
        assert "torchdoctor_host_cpu_seconds" in after
    finally:
        if job is not None and job.poll() is None:
            stop.touch()
            job.communicate(timeout=120)
        exporter.send_signal(signal.SIGTERM)
        exporter.communicate(timeout=30)
    assert exporter.returncode == 0


def test_exporter_listen_address_in_use_is_an_error(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = run_td("exporter", "--listen", f"127.0.0.1:{port}", timeout=60)
    assert res.returncode != 0
    assert res.stderr.strip().splitlines() == [
        f"torchdoctor: error: cannot serve Prometheus metrics on 127.0.0.1:{port}: the address "
        "is already in use; choose another with --listen"
    ]


def test_print_dashboard_gives_an_importable_dashboard() -> None:
    res = run_td("exporter", "--print-dashboard")
    assert res.returncode == 0, res.stderr
    dash = json.loads(res.stdout)
    assert "${DS_" not in res.stdout and "__inputs" not in dash
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert {"instance", "run", "rank"} <= variables.keys()
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    panels = {p["title"]: p for p in dash["panels"] if p["type"] != "row"}
    for title in (
        "Steps per second", "Data-wait ratio", "Step time", "Job CPU by role",
        "Job PSS by role", "VRAM per GPU", "GPU utilization", "GPU power", "Host I/O wait",
        "Host swap", "Host pressure (PSI)", "Active findings",
    ):  # fmt: skip
        panel = panels[title]
        assert panel["targets"] and panel["gridPos"]
        assert panel["datasource"]["uid"] == "${datasource}"
    assert panels["Active findings"]["type"] == "state-timeline"


@pytest.mark.parametrize("text", ["9100", "127.0.0.1:9100", "[::1]:9100", "0.0.0.0:9100"])
def test_listen_addresses(text: str) -> None:
    from torchdoctor.exporters.prometheus import parse_listen

    addr, port = parse_listen(text, "--listen")
    assert port == 9100
    assert addr == {"9100": "127.0.0.1", "[::1]:9100": "::1"}.get(text, text.split(":")[0])


def test_a_tensorboard_folder_that_cannot_be_made_gives_one_line(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("")
    res = run_td(
        "run", "--quiet", "--tensorboard", str(tmp_path / "afile" / "tb"),
        "--out", str(tmp_path / "r.sqlite"), "--", sys.executable, "-c", "print('job ran')",
    )  # fmt: skip
    assert res.returncode == 0 and res.stdout == "job ran\n"
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("torchdoctor: cannot create ") and "without TensorBoard" in line
