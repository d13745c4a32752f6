"""The queue's commands on bad input, history-based sizing, dependencies, restarts, privacy."""

from __future__ import annotations

import json
import os
import socket
import stat
import sys

import pytest

from tests.helpers.engines import not_root, require_engine
from tests.queue.conftest import FAKE_JOB, UUID0, one_gpu
from torchdoctor.queue.model import Job
from torchdoctor.queue.store import QueueStore


def _one_error_line(done) -> str:
    assert done.returncode != 0
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("torchdoctor: error: "), done.stderr
    return lines[0]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (
            ["--gpu", "GPU-nope"],
            "--gpu GPU-nope: no such GPU; this machine has 1 GPU(s): 0 (" + UUID0,
        ),
        (["--gpus", "2"], "--gpus 2: this machine has 1 GPU(s)"),
        (
            ["--gpus", "1", "--vram", "50GiB"],
            "can never fit: GPU 0 (NVIDIA A100-PCIE-40GB) has 40.0 GiB",
        ),
        (["--cpus", "99"], "--cpus 99: you may use"),
        (["--mem", "900TiB"], "--mem 900 TiB: this machine has"),
        (["--gpus", "1", "--vram", "auto"], "--vram auto: this queue has no finished run"),
        (["--after", "7"], "--after 7: there is no job 7"),
    ],
)
def test_what_the_machine_can_never_give_is_refused_at_submit(queue_env, args, says):
    q = queue_env(one_gpu(40))
    line = _one_error_line(q.td("submit", *args, "--", sys.executable, FAKE_JOB))
    assert says in line
    assert json.loads(q.td("queue", "--json", check=True).stdout)["jobs"] == []


def test_mem_auto_sizes_from_the_last_run_of_the_same_command_and_says_so(queue_env):
    q = queue_env()
    cmd = ["--", sys.executable, FAKE_JOB, "--hold", "0.5"]
    first = q.submit("--mem", "1GiB", *cmd)
    assert q.wait(first) == 0
    peak = q.job(first).used_rss
    done = q.td("submit", "--mem", "auto", *cmd, check=True)
    assert f"job {first}'s recording: peak" in done.stdout
    second = q.job(first + 1)
    assert second.mem == int(peak * 1.1) and second.mem_source.startswith(f"job {first}'s")
    assert q.wait(second.id) == 0
    from torchdoctor.queue import last_run_of

    assert last_run_of(second.argv, q.paths).id == second.id


def test_a_failed_dependency_fails_the_job_after_it_with_the_reason(queue_env):
    q = queue_env()
    first = q.submit("--", sys.executable, FAKE_JOB, "--exit", "2")
    after = q.submit("--after", str(first), "--", sys.executable, FAKE_JOB)
    assert q.wait(after) == 1
    job = q.job(after)
    assert job.state == "failed" and job.started_at is None
    assert job.reason == f"not started: job {first} it runs after ended failed (exit status 2)"
    ok = q.submit("--", sys.executable, FAKE_JOB)
    then = q.submit("--after", str(ok), "--", sys.executable, FAKE_JOB)
    assert q.wait(then) == 0 and q.job(then).started_at >= q.job(ok).ended_at


def test_a_corrupted_state_file_is_one_clear_line_and_kept(queue_env):
    q = queue_env()
    q.paths.make()
    q.paths.db.write_bytes(b"this is not sqlite" * 100)
    before = q.paths.db.read_bytes()
    line = _one_error_line(q.td("queue"))
    assert str(q.paths.db) in line and "kept" in line
    assert _one_error_line(q.td("submit", "--", sys.executable, FAKE_JOB))
    assert q.paths.db.read_bytes() == before
    done = q.td("queue", "recover", check=True)
    kept = [p for p in q.paths.state_dir.iterdir() if ".unreadable-" in p.name]
    assert len(kept) == 1 and kept[0].read_bytes() == before and str(kept[0]) in done.stdout
    assert q.wait(q.submit("--", sys.executable, FAKE_JOB)) == 0


def test_after_a_reboot_running_jobs_are_lost_and_the_queue_waits_for_resume(queue_env):
    q = queue_env()
    q.paths.make()
    store = QueueStore(q.paths.db)
    # What a scheduler of the previous boot left: one running job, one waiting.
    store.add(Job(0, "old", ["true"], {}, "/", 1.0, state="running", boot_id="an-earlier-boot",
                  supervisor_pid=1, supervisor_start=1, assigned_cpus=[0]))  # fmt: skip
    waiting = store.add(Job(0, "next", [sys.executable, FAKE_JOB], dict(q.env), "/", 2.0))
    store.close()
    listed = q.td("queue", check=True).stdout  # starts a scheduler
    lost = q.until(lambda: q.job(1).state == "lost" and q.job(1))
    assert lost.reason == "the machine restarted while it ran"
    q.until(lambda: "paused" in (q.job(waiting).reason or ""))
    assert q.job(waiting).state == "queued"
    assert "queue paused" in q.td("queue", check=True).stdout or "paused" in listed
    q.td("queue", "resume", check=True)
    assert q.wait(waiting) == 0


def test_logs_and_json_listing(queue_env):
    q = queue_env(one_gpu())
    job_id = q.submit("--gpu", "0", "--vram", "1GiB", "--", sys.executable, FAKE_JOB, "--gib", "1")
    assert q.wait(job_id) == 0
    out = q.td("queue", "logs", str(job_id), check=True).stdout
    assert json.loads(out.splitlines()[0])["CUDA_VISIBLE_DEVICES"] == UUID0
    (listed,) = json.loads(q.td("queue", "--json", check=True).stdout)["jobs"]
    assert listed["id"] == job_id and listed["assigned_gpus"] == [UUID0]
    assert listed["vram_source"] == "asked" and "env" not in listed


def test_the_scheduler_socket_is_private_to_its_user(queue_env):
    q = queue_env()
    q.wait(q.submit("--", sys.executable, FAKE_JOB))
    mode = stat.S_IMODE(os.stat(q.paths.socket).st_mode)
    assert mode == 0o600
    assert stat.S_IMODE(os.stat(q.paths.socket.parent).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(q.paths.state_dir).st_mode) == 0o700
    require_engine("root", not_root())  # connecting as another user
    pid = os.fork()
    if pid == 0:  # another user tries to reach this queue
        code = 1
        try:
            os.setgid(65534)
            os.setuid(65534)
            with socket.socket(socket.AF_UNIX) as conn:
                conn.connect(str(q.paths.socket))
        except PermissionError:
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
