"""The queue with real processes: placement, the GPU race, a killed scheduler, cancel, torchrun."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.queue.conftest import FAKE_JOB, GIB, UUID0, fake_nvml, one_gpu
from torchdoctor.queue.processes import start_time


def test_a_job_gets_its_own_cores_threads_and_no_gpu_and_leaves_a_recording(queue_env):
    q = queue_env(one_gpu())
    job_id = q.submit("--cpus", "1", "--", sys.executable, FAKE_JOB)
    assert q.wait(job_id) == 0
    job = q.job(job_id)
    seen = q.job_report(job_id)
    assert len(job.assigned_cpus) == 1
    assert seen["affinity"] == job.assigned_cpus  # pinned before it started: its whole life
    assert seen["OMP_NUM_THREADS"] == seen["MKL_NUM_THREADS"] == seen["OPENBLAS_NUM_THREADS"] == "1"
    assert seen["CUDA_VISIBLE_DEVICES"] == ""  # asked for no GPU: sees none
    assert seen["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert seen["MASTER_PORT"] == str(job.master_port)
    shown = q.td("queue", "show", str(job_id), check=True).stdout
    assert "exit       0" in shown and job.recording in shown
    assert "job RSS" in shown  # the recording's summary follows
    assert job.used_rss and job.used_rss > 1024 * 1024


def test_two_30gib_jobs_on_a_40gib_gpu_never_run_together_submitted_by_8_processes(queue_env):
    q = queue_env(one_gpu(40))
    # Eight submitters, imported and waiting, released at the same instant.
    submit = [
        "submit", "-q", "--gpus", "1", "--vram", "30GiB", "--",
        sys.executable, FAKE_JOB, "--gib", "30", "--hold", "0.3",
    ]  # fmt: skip
    code = (
        "import sys; from torchdoctor.cli import main; print('ready', flush=True);"
        f" sys.stdin.read(1); main({submit!r})"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=q.env,
        )
        for _ in range(8)
    ]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    for p in procs:
        p.stdin.write("x")
    for p in procs:
        p.stdin.flush()
    ids = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        ids.append(int(out.strip().splitlines()[-1]))
    statuses = [q.wait(i) for i in ids]
    logs = {i: q.log(i) for i in ids}
    assert statuses == [0] * 8, logs  # a job that lands beside another dies of CUDA OOM
    jobs = [q.job(i) for i in ids]
    for job in jobs:
        assert job.assigned_gpus == [UUID0]
        assert q.job_report(job.id)["CUDA_VISIBLE_DEVICES"] == UUID0
    for a, b in itertools.combinations(jobs, 2):
        assert a.ended_at <= b.started_at or b.ended_at <= a.started_at, (a, b)


def test_another_users_process_on_the_gpu_blocks_it_and_is_never_touched(queue_env):
    q = queue_env(one_gpu(40))
    other = dict(user=65534, group=65534) if os.getuid() == 0 else {}
    foreign = subprocess.Popen(["sleep", "600"], **other)
    try:
        fake_nvml.allocate(q.machine, UUID0, 30 * GIB, pid=foreign.pid)
        job_id = q.submit(
            "--gpus", "1", "--vram", "20GiB", "--", sys.executable, FAKE_JOB, "--gib", "20"
        )
        reason = q.until(
            lambda: (q.job(job_id).reason or "").startswith("waiting") and q.job(job_id).reason
        )
        assert "GPU 0" in reason and "available" in reason
        assert q.job(job_id).state == "queued"
        assert foreign.poll() is None  # never kills what it did not start
    finally:
        foreign.kill()  # we, not the queue, stop it
        foreign.wait(timeout=30)
    # Its memory is freed with it; the scheduler notices on its own and starts the job.
    assert q.wait(job_id) == 0


def _gate_job(gate: Path, status: int) -> list[str]:
    code = textwrap.dedent(
        f"""
        import os, sys, time
        while not os.path.exists({str(gate)!r}):
            time.sleep(0.02)
        sys.exit({status})
        """
    )
    return [sys.executable, "-c", code]


def test_scheduler_killed_with_two_jobs_running_loses_nothing(queue_env, tmp_path):
    q = queue_env()
    gate_a, gate_b = tmp_path / "a", tmp_path / "b"
    a = q.submit("--", *_gate_job(gate_a, 3))
    b = q.submit("--", *_gate_job(gate_b, 0))
    q.until(lambda: q.job(a).state == "running" and q.job(b).state == "running")
    old = q.scheduler_pid()
    os.kill(old, signal.SIGKILL)
    q.until(lambda: q.scheduler_pid() is None)
    gate_a.touch()  # A ends while no scheduler runs: its supervisor records it
    q.until(lambda: q.job(a).ended)
    listed = q.td("queue", check=True).stdout  # the next command starts a new scheduler
    assert listed.splitlines()[1].split()[:2] == [str(a), "failed"]
    new = q.scheduler_pid()
    assert new is not None and new != old
    assert q.job(b).state == "running"  # adopted, not lost
    gate_b.touch()
    assert q.wait(b) == 0
    assert (q.job(a).state, q.job(a).exit_status) == ("failed", 3)
    assert (q.job(b).state, q.job(b).exit_status) == ("done", 0)


def test_a_missing_command_is_recorded_as_failed_with_127(queue_env):
    q = queue_env()
    done = q.td("submit", "--", "no-such-command-td")
    assert done.returncode == 127
    assert done.stderr.count("\n") == 1 and "command not found: no-such-command-td" in done.stderr
    job = q.job(1)
    assert (job.state, job.exit_status) == ("failed", 127)
    assert q.wait(1) == 127


def test_pause_starts_nothing_new_and_resume_does(queue_env, tmp_path):
    q = queue_env()
    gate = tmp_path / "gate"
    running = q.submit("--", *_gate_job(gate, 0))
    q.until(lambda: q.job(running).state == "running")
    q.td("queue", "pause", check=True)
    later = q.submit("--", sys.executable, FAKE_JOB)
    q.until(lambda: "paused" in (q.job(later).reason or ""))
    assert q.job(later).state == "queued"
    gate.touch()
    assert q.wait(running) == 0  # a running job finishes
    assert q.job(later).state == "queued"
    assert "queue paused" in q.td("queue", check=True).stdout
    q.td("queue", "resume", check=True)
    assert q.wait(later) == 0


_TREE = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    stubborn = [sys.executable, "-c",
                "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"]
    child = subprocess.Popen(sleeper)
    deaf = subprocess.Popen(stubborn)
    escaped = subprocess.Popen(sleeper, start_new_session=True)  # leaves the process group
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(" ".join(str(p.pid) for p in (child, deaf, escaped)))
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(600)
    """
)


def test_cancel_stops_the_whole_tree_and_leaves_no_orphan(queue_env, tmp_path):
    q = queue_env()
    pids_file = tmp_path / "pids"
    job_id = q.submit("--", sys.executable, "-c", _TREE, str(pids_file))
    q.until(pids_file.exists, timeout=60)
    job = q.job(job_id)
    tree = [job.job_pid, *map(int, pids_file.read_text().split())]
    starts = {pid: start_time(pid) for pid in tree}
    assert all(starts.values())
    done = q.td("queue", "cancel", str(job_id), "--grace", "1", check=True)
    assert f"job {job_id} cancelled" in done.stdout
    assert [pid for pid in tree if start_time(pid) == starts[pid]] == []
    job = q.job(job_id)
    assert job.state == "cancelled" and job.exit_status in (143, 137)


_RANK = textwrap.dedent(
    """
    import os, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(4) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    assert t.tolist() == [3.0] * 4, t
    print("rank", dist.get_rank(), "port", os.environ["MASTER_PORT"], flush=True)
    dist.barrier()
    dist.destroy_process_group()
    """
)


@pytest.mark.filterwarnings("ignore")
def test_two_torchrun_jobs_submitted_together_both_succeed(queue_env, tmp_path):
    q = queue_env()
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    cmd = ["--", torchrun, "--nnodes", "1", "--nproc-per-node", "2", str(script)]
    a, b = q.submit(*cmd), q.submit(*cmd)
    assert (q.wait(a), q.wait(b)) == (0, 0), (q.log(a), q.log(b))
    ja, jb = q.job(a), q.job(b)
    assert ja.master_port != jb.master_port
    assert ja.started_at < jb.ended_at and jb.started_at < ja.ended_at  # they ran side by side
    assert f"port {ja.master_port}" in q.log(a)


def test_a_running_queued_job_is_announced_so_top_and_the_exporter_find_it(
    queue_env, tmp_path, monkeypatch
):
    from torchdoctor.recording import registry

    q = queue_env()
    monkeypatch.setenv("XDG_RUNTIME_DIR", q.env["XDG_RUNTIME_DIR"])
    gate = tmp_path / "gate"
    job_id = q.submit("--", *_gate_job(gate, 0))
    running = q.until(lambda: (j := q.job(job_id)).state == "running" and j.job_pid and j)
    # the supervisor announces the job once it runs (the store says running a moment before)
    (entry,) = q.until(lambda: [e for e in registry.active() if e.pid == running.job_pid])
    assert entry.recording_path == Path(running.recording).resolve()
    gate.touch()
    assert q.wait(job_id) == 0
    assert [e for e in registry.active() if e.pid == running.job_pid] == []
