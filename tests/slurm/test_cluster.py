"""On a real one-node Slurm: the sized script runs, `slurm status` reports it, recordings read.

The cluster (slurmctld, slurmd, munged) is started by the module fixture as root and stopped
by PID afterwards; where it cannot start (not root, Slurm missing) the tests skip and say why.
"""

from __future__ import annotations

import json
import os
import re
import socket
from pathlib import Path

import pytest

from tests.conftest import run_td
from tests.helpers.engines import engine
from tests.helpers.schemas import assert_valid
from tests.slurm.conftest import DDP_CMD, TRAIN_CMD
from tests.slurm.slurm_cluster import start_cluster, stop_cluster, why_not_startable
from torchdoctor.recording import open_recording
from torchdoctor.slurm.notation import parse_memory

_WHY = why_not_startable()
# The module's fixtures record a job, start a cluster and run a job on it before the first test
# body: on a loaded 2-CPU machine that can pass the suite's 300 s per-test limit.
pytestmark = [engine("slurm", _WHY), pytest.mark.timeout(900)]
HOST = socket.gethostname().split(".")[0]
# Generous: under the load of a shared CI machine a 20-step job can take minutes; the limit
# sized from a recording is tested in test_script.py.
TIME = "00:30:00"


@pytest.fixture(scope="module")
def cluster():
    c = start_cluster()
    try:
        yield c
    finally:
        stop_cluster(c)


@pytest.fixture(scope="module")
def train_job(cluster, train_recording: Path, tmp_path_factory) -> tuple[str, Path]:
    """`torchdoctor sbatch --from REC --submit -- python examples/train.py` on the cluster."""
    runs = tmp_path_factory.mktemp("runs")
    res = run_td(
        "sbatch", "--from", str(train_recording), "--time", TIME, "--submit", "--job-name", "td-train",
        "--recordings", str(runs), "--", *TRAIN_CMD, env=cluster.env,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    job_id = res.stdout.strip()
    assert job_id.isdigit(), res.stdout  # sbatch --parsable's job id, alone on stdout
    fields = cluster.wait_for_job(job_id)
    out = (runs / f"slurm-{job_id}.out").read_text(errors="replace")
    assert fields["JobState"] == "COMPLETED", out + cluster.logs()
    return job_id, runs


def test_sized_job_runs_and_status_reports_asked_vs_used(cluster, train_job) -> None:
    job_id, runs = train_job
    res = run_td("slurm", "status", job_id, env=cluster.env)
    assert res.returncode == 0, res.stderr
    text = res.stdout
    assert re.search(
        rf"^job {job_id} \(td-train\): COMPLETED, exit 0:0 - from scontrol", text, re.M
    )
    assert f"nodes: 1 node: {HOST}" in text
    mem = re.search(r"memory per node +asked (\S+ \S+), used (\S+ \S+) \(\d+ %, peak PSS", text)
    assert mem, text
    assert re.search(r"CPUs per node +asked \d+, used [\d.]+", text)
    assert re.search(r"time +asked 30 min 00 s, used ", text)
    # the summary and findings of the node's recording follow
    assert f"node {HOST}" in text and "steps: 20" in text and "torchdoctor diagnosis" in text

    data = assert_valid(
        "slurm-status", run_td("slurm", "status", job_id, "--json", env=cluster.env).stdout
    )
    rows = {row["figure"]: row for row in data["asked_used"]}
    script = (runs / "td-train.sbatch").read_text()
    asked_mem = parse_memory(re.search(r"^#SBATCH --mem=(\S+)$", script, re.M).group(1))
    assert rows["memory per node"]["asked"] == asked_mem  # what the script asked, Slurm got
    assert 0 < rows["memory per node"]["used"] < asked_mem  # and the job fit in it
    assert rows["time"]["asked"] == 1800 and 0 < rows["time"]["used"] < 1800


def test_job_recording_is_readable_by_show_and_diagnose(train_job) -> None:
    job_id, runs = train_job
    (path,) = (runs / f"slurm-{job_id}").glob("*.sqlite")  # one node, one recording
    with open_recording(path) as rec:
        assert rec.meta["exit_status"] == 0
        assert rec.meta["env"]["SLURM_JOB_ID"] == job_id
        roles = {p["role"] for p in rec.processes()}
    assert {"launcher", "trainer"} <= roles  # torchrun and its rank, both recorded
    show = run_td("show", str(path))
    assert show.returncode == 0 and "steps: 20" in show.stdout, show.stderr
    diagnose = run_td("diagnose", "--json", str(path.parent))  # the job's folder, as one job
    assert diagnose.returncode == 0, diagnose.stderr
    assert "findings" in json.loads(diagnose.stdout)


def test_status_once_slurm_forgot_the_job_comes_from_its_folder(train_job, tmp_path) -> None:
    """Without scontrol (or after MinJobAge) the job's folder still tells what it asked/used."""
    job_id, runs = train_job
    env = dict(os.environ, PATH=str(tmp_path))  # no Slurm client on PATH
    res = run_td("slurm", "status", job_id, "--recordings", str(runs), env=env)
    assert res.returncode == 0, res.stderr
    assert f"job {job_id}: COMPLETED, exit 0:0 - from recordings" in res.stdout
    assert re.search(r"memory per node +asked \S+ \S+, used", res.stdout)
    assert "asked: the job's script" in res.stdout


def test_two_rank_gloo_job_via_generated_script(cluster, ddp_recording, tmp_path) -> None:
    res = run_td(
        "sbatch", "--from", str(ddp_recording), "--time", TIME, "--submit", "--job-name", "td-ddp",
        "--recordings", str(tmp_path), "--", *DDP_CMD, env=cluster.env,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    job_id = res.stdout.strip()
    fields = cluster.wait_for_job(job_id)
    out = (tmp_path / f"slurm-{job_id}.out").read_text(errors="replace")
    assert fields["JobState"] == "COMPLETED", out + cluster.logs()
    # Both ranks write to one output file: their lines may run together ("...0.2336rank 1 of
    # 2..."), so the weight is matched by its own format, not up to the next space.
    ranks = re.findall(r"rank (\d) of 2 on [^:\s]+: weights (-?\d+\.\d{6})", out)
    assert sorted(r for r, _ in ranks) == ["0", "1"], out
    assert len({w for _, w in ranks}) == 1  # gradients were all-reduced: same weights
    (path,) = (tmp_path / f"slurm-{job_id}").glob("*.sqlite")
    with open_recording(path) as rec:
        stepping = {row["pid"] for row in rec.steps()}
    assert len(stepping) == 2  # both ranks under the recorder


def test_sbatch_refusal_is_one_line_and_keeps_the_script(cluster, train_recording, tmp_path):
    res = run_td(
        "sbatch", "--from", str(train_recording), "--partition", "nosuch", "--submit", "--job-name", "td-3",
        "--recordings", str(tmp_path), "--", *TRAIN_CMD, env=cluster.env,
    )  # fmt: skip
    assert res.returncode == 2
    error = [line for line in res.stderr.splitlines() if line.startswith("torchdoctor: error:")]
    assert len(error) == 1 and "sbatch refused the job" in error[0], res.stderr
    assert "Invalid partition name" in error[0]  # Slurm's own reason, passed on
    assert (tmp_path / "td-3.sbatch").exists()
