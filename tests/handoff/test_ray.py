"""`handoff --to ray --submit` on a real local Ray cluster the test starts (head with the
dashboard, which serves the job API) and stops by its own process group: a 2-rank gloo job
succeeds with both ranks recorded; a rank that exits 1 fails the job with exit 1, named; on two
Ray nodes (ray.cluster_utils), one torchrun per node, node ranks 0 and 1, a recording each."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import run_td
from tests.helpers.dependencies import require
from tests.helpers.schemas import assert_valid
from tests.slurm.conftest import DDP_CMD

FAILS = Path(__file__).parent / "jobs" / "rank_fails.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_cluster():
    """`ray start --head --block`, small (2 CPUs, 80 MB object store), in a process group of its
    own; its address. Stopped by that group: `ray stop` would stop every Ray on the machine."""
    require("ray")
    temp = tempfile.mkdtemp(prefix="tdray-", dir="/tmp")  # short: Ray's sockets live in it
    dashboard = _free_port()
    cmd = [
        str(Path(sys.executable).parent / "ray"), "start", "--head", "--block",
        "--num-cpus", "2", "--object-store-memory", "80000000",
        "--node-ip-address", "127.0.0.1", "--dashboard-host", "127.0.0.1",
        "--dashboard-port", str(dashboard), "--port", str(_free_port()),
        "--ray-client-server-port", str(_free_port()),
        "--dashboard-agent-listen-port", str(_free_port()),
        "--temp-dir", temp, "--disable-usage-stats",
    ]  # fmt: skip
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    log = open(Path(temp) / "head.log", "w")  # noqa: SIM115 - open while the head runs
    head = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    address = f"http://127.0.0.1:{dashboard}"
    try:
        _wait_for_job_api(address, head, Path(temp) / "head.log")
        yield address
    finally:
        for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
            try:
                os.killpg(head.pid, sig)  # the group `ray start` leads: its daemons are in it
            except ProcessLookupError:
                break
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and _group_alive(head.pid):
                time.sleep(0.5)
        head.wait(timeout=10)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_for_job_api(address: str, head: subprocess.Popen | None, log: Path | None) -> None:
    from ray.job_submission import JobSubmissionClient

    deadline = time.monotonic() + 120
    while True:
        if head is not None and log is not None and head.poll() is not None:
            pytest.fail(f"ray start exited {head.returncode}: {log.read_text()[-2000:]}")
        try:
            JobSubmissionClient(address).list_jobs()
            return
        except Exception:  # noqa: BLE001 - not up yet (connection refused, 503 ...)
            if time.monotonic() > deadline:
                pytest.fail(f"Ray's job API at {address} did not answer in 120 s")
            time.sleep(1)


def _submit(ray_cluster: str, recording: Path, runs: Path, cmd: list[str]) -> str:
    res = run_td(
        "handoff", "--to", "ray", "--from", str(recording), "--address", ray_cluster,
        "--recordings", str(runs), "--submit", "--", *cmd, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def _status(ray_cluster: str, job_id: str):
    res = run_td(
        "handoff", "status", f"ray:{job_id}", "--address", ray_cluster, "--wait", "300",
        "--json", timeout=360,
    )  # fmt: skip
    return res, assert_valid("handoff-status", res.stdout)


def test_a_two_rank_job_runs_on_ray_with_every_rank_recorded(
    ray_cluster: str, ddp_recording: Path, tmp_path: Path
) -> None:
    job_id = _submit(ray_cluster, ddp_recording, tmp_path, DDP_CMD)
    res, report = _status(ray_cluster, job_id)
    state = report["state"]
    assert res.returncode == 0, res.stderr
    assert state["status"] == "SUCCEEDED" and state["driver_exit_code"] == 0
    # the sized entrypoint resources went with it
    assert state["entrypoint_num_cpus"] >= 1 and state["entrypoint_memory"] > 0
    (node,) = report["recordings"]
    assert node["ranks"] == 2 and node["exit_status"] == 0
    assert Path(node["path"]).parent == tmp_path / f"ray-{job_id}"
    # the ranks' own output is in the job's log: both ranks ran, in one gloo group
    from ray.job_submission import JobSubmissionClient

    log = JobSubmissionClient(ray_cluster).get_job_logs(job_id)
    assert "rank 0 of 2" in log and "rank 1 of 2" in log
    text = run_td("handoff", "status", f"ray:{job_id}", "--address", ray_cluster)
    assert f"ray:{job_id}: SUCCEEDED, driver exit 0" in text.stdout


def test_a_failing_rank_fails_the_job_with_its_exit(
    ray_cluster: str, ddp_recording: Path, tmp_path: Path
) -> None:
    job_id = _submit(ray_cluster, ddp_recording, tmp_path, [sys.executable, str(FAILS)])
    res, report = _status(ray_cluster, job_id)
    state = report["state"]
    assert state["status"] == "FAILED" and state["driver_exit_code"] == 1
    assert res.returncode == 1  # --wait exits with the driver's exit code
    assert state["failing_rank"] == "rank 1 (local rank 1), exit 1"
    (node,) = report["recordings"]
    assert node["exit_status"] == 1


def test_an_unknown_job_is_one_line(ray_cluster: str) -> None:
    res = run_td("handoff", "status", "ray:no-such-job", "--address", ray_cluster)
    assert res.returncode != 0
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


@pytest.fixture(scope="module")
def two_node_cluster():
    """Two Ray nodes on this machine (ray.cluster_utils.Cluster: a head with the dashboard on
    127.0.0.1 for the job API, and one more raylet), 1 CPU each; stopped by its own handle."""
    require("ray")
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    dashboard = _free_port()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "include_dashboard": True,
            "dashboard_host": "127.0.0.1",
            "dashboard_port": dashboard,
            "object_store_memory": 80_000_000,
        },
    )
    try:
        cluster.add_node(num_cpus=1, object_store_memory=80_000_000)
        cluster.wait_for_nodes()
        address = f"http://127.0.0.1:{dashboard}"
        _wait_for_job_api(address, None, None)
        yield address
    finally:
        cluster.shutdown()


def test_two_nodes_run_one_torchrun_each_with_a_recording_per_node(
    two_node_cluster: str, ddp_recording: Path, tmp_path: Path
) -> None:
    res = run_td(
        "handoff", "--to", "ray", "--from", str(ddp_recording), "--nodes", "2",
        "--ranks-per-node", "1", "--address", two_node_cluster, "--recordings", str(tmp_path),
        "--submit", "--", *DDP_CMD, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    job_id = res.stdout.strip()
    status, report = _status(two_node_cluster, job_id)
    assert status.returncode == 0, status.stderr
    assert report["state"]["status"] == "SUCCEEDED"
    nodes = sorted(report["recordings"], key=lambda r: r["path"])
    assert [Path(n["path"]).stem.rsplit("-", 1)[1] for n in nodes] == ["node0", "node1"]
    assert all(n["ranks"] == 1 and n["exit_status"] == 0 for n in nodes)
    from ray.job_submission import JobSubmissionClient

    log = JobSubmissionClient(two_node_cluster).get_job_logs(job_id)
    assert "rank 0 of 2" in log and "rank 1 of 2" in log  # one world across the two nodes


def test_ray_train_runs_a_script_that_makes_its_own_process_group(
    ray_cluster: str, ddp_recording: Path, tmp_path: Path
) -> None:
    """The TorchTrainer file with the shim: the unchanged script's init_process_group joins Ray
    Train's group instead of failing ("initialize ... twice"); fit succeeds."""
    require("ray.train")
    out = tmp_path / "trainer.py"
    res = run_td(
        "handoff", "--to", "ray-train", "--from", str(ddp_recording), "--address", ray_cluster,
        "-o", str(out), "--submit", "--", *DDP_CMD[:2], "--steps", "10", timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    job_id = res.stdout.strip()
    compile(out.read_text(), str(out), "exec")  # what was written is Python
    status, report = _status(ray_cluster, job_id)
    from ray.job_submission import JobSubmissionClient

    log = JobSubmissionClient(ray_cluster).get_job_logs(job_id)
    assert report["state"]["status"] == "SUCCEEDED", log[-3000:]
    assert "rank 0 of 2" in log and "rank 1 of 2" in log
    assert "twice" not in log
