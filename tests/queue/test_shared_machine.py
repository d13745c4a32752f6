"""The machine-wide queue with real users: shared cores and GPU memory, fair order, limits,
who may see and touch what, a killed scheduler, and the requests an attacker would send."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import socket
import subprocess
import sys
import threading

import pytest

from tests.queue.conftest import UUID0, one_gpu
from tests.queue.shared import JOB, SECRET_VALUE, shared_machines

CORES = len(os.sched_getaffinity(0))


@pytest.fixture
def shared(capsys):
    yield from shared_machines(capsys)


def _disjoint(a, b) -> bool:
    return a.ended_at <= b.started_at or b.ended_at <= a.started_at


def test_two_users_asking_for_every_core_at_once_run_one_after_the_other(shared):
    m = shared()
    alice, bob = m.add_user(), m.add_user()
    m.start_scheduler()
    ids: dict[str, int] = {}

    def submit(user):
        ids[user.name] = m.submit(user, "--cpus", str(CORES), *m.job_args("--burn", "1.0"))

    threads = [threading.Thread(target=submit, args=(u,)) for u in (alice, bob)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    a, b = (m.ended(ids[u.name]) for u in (alice, bob))
    assert (a.state, b.state) == ("done", "done"), m.scheduler_log()
    assert _disjoint(a, b), (a.started_at, a.ended_at, b.started_at, b.ended_at)
    seen = {}
    for user, job in ((alice, a), (bob, b)):
        first, last = m.report(job.id)
        seen[user.name] = (first["start"], last["end"])
        assert first["uid"] == first["euid"] == user.uid  # from /proc/self/status
        assert first["gid"] == user.gid
        assert first["cpus"] == (f"0-{CORES - 1}" if CORES > 1 else "0")
        assert job.uid == user.uid and job.user == user.name
        assert job.used_rss and job.used_rss > 1024 * 1024  # measured from its recording
        assert os.stat(job.recording).st_uid == user.uid  # written as its owner, in their home
    (s1, e1), (s2, e2) = seen.values()
    assert e1 <= s2 or e2 <= s1  # the jobs' own clocks: never on the same cores at once


def test_two_users_30gib_each_on_a_40gib_gpu_one_waits_and_says_why(shared):
    m = shared(one_gpu(40))
    alice, bob = m.add_user(), m.add_user()
    m.start_scheduler()
    hold = ["--gpus", "1", "--vram", "30GiB"]
    a = m.submit(alice, *hold, *m.job_args("--gate", m.gate("a")))
    m.until(lambda: m.job(a).state == "running")
    b = m.submit(bob, *hold, *m.job_args("--gate", m.gate("b")))
    shown = m.until(
        lambda: "waits" in (out := m.as_user(bob, "queue", "show", str(b)).stdout) and out
    )
    assert "needs 1 GPU(s) with 30.0 GiB free" in shown, shown
    assert m.job(b).state == "queued"
    m.open_gate("a")
    m.open_gate("b")
    ja, jb = m.ended(a), m.ended(b)
    assert (ja.state, jb.state) == ("done", "done"), m.scheduler_log()
    assert ja.assigned_gpus == jb.assigned_gpus == [UUID0]
    assert _disjoint(ja, jb)


def test_one_users_four_jobs_do_not_starve_anothers_one(shared):
    m = shared()
    alice, bob = m.add_user(), m.add_user()
    m.start_scheduler()
    every = ["--cpus", str(CORES)]
    first = m.submit(alice, *every, *m.job_args("--gate", m.gate("a1")))
    m.until(lambda: m.job(first).state == "running")
    rest = [m.submit(alice, *every, *m.job_args("--burn", "0.2")) for _ in range(3)]
    b = m.submit(bob, *every, *m.job_args("--burn", "0.2"))
    m.open_gate("a1")
    jobs = [m.ended(i) for i in (first, *rest, b)]
    assert all(j.state == "done" for j in jobs), m.scheduler_log()
    by_start = [j.id for j in sorted(jobs, key=lambda j: j.started_at)]
    assert by_start[1] == b, by_start  # second, not fifth
    for x, y in itertools.combinations(jobs, 2):
        assert _disjoint(x, y)


def test_an_admins_per_user_limit_holds(shared):
    m = shared(config="[limits]\ncpus = 1\n")
    alice = m.add_user()
    m.start_scheduler()
    refused = m.as_user(alice, "submit", "--cpus", "2", *m.job_args())
    assert refused.returncode != 0
    assert refused.stderr.count("\n") == 1 and "may use at most 1" in refused.stderr
    if CORES < 2:
        return
    ids = [m.submit(alice, "--cpus", "1", *m.job_args("--burn", "0.3")) for _ in range(2)]
    second = m.until(lambda: (j := m.job(ids[1])).reason and j)
    jobs = [m.ended(i) for i in ids]
    assert all(j.state == "done" for j in jobs), m.scheduler_log()
    assert _disjoint(*jobs)  # a free core, and still one job at a time
    assert (
        "may use 1 core(s) at once" in (second.reason or "")
        or jobs[1].started_at >= jobs[0].ended_at
    )


def test_another_users_job_cannot_be_touched_or_read_and_runs_as_its_owner(shared):
    m = shared()
    alice, bob = m.add_user(), m.add_user()
    m.start_scheduler()
    a = m.submit(alice, "--cpus", "1", *m.job_args("--gate", m.gate("a"), "--exit", "0"))
    job = m.until(lambda: (j := m.job(a)).state == "running" and j.job_pid and j)
    with open(f"/proc/{job.job_pid}/status") as f:
        uids = next(line for line in f if line.startswith("Uid:")).split()[1:]
    assert uids == [str(alice.uid)] * 4  # real, effective, saved, filesystem
    for args in (("queue", "cancel", str(a)), ("queue", "pause", str(a)), ("queue", "logs", str(a)),
                 ("queue", "priority", str(a), "5"), ("queue", "restart", str(a))):  # fmt: skip
        done = m.as_user(bob, *args)
        assert done.returncode != 0, args
        assert (
            done.stderr.count("\n") == 1
            and "your own jobs" in done.stderr
            or ("restart" in args and "only an ended job" in done.stderr)
        ), (args, done.stderr)
        assert done.stdout == ""
    listed = m.as_user(bob, "queue", "--json")
    seen = json.loads(listed.stdout)["jobs"]
    assert [(j["id"], j["user"], j["argv"], j["cwd"], j["log"]) for j in seen] == [
        (a, alice.name, [], None, None)
    ]
    shown = m.as_user(bob, "queue", "show", str(a)).stdout
    assert "only its owner and root see it" in shown and JOB not in shown
    assert m.job(a).state == "running"
    assert JOB in m.as_user(alice, "queue", "show", str(a)).stdout
    m.open_gate("a")
    assert m.ended(a).state == "done"
    assert '"uid"' in m.as_user(alice, "queue", "logs", str(a)).stdout


def test_scheduler_killed_while_both_users_jobs_run_keeps_both_exit_statuses(shared):
    m = shared()
    alice, bob = m.add_user(), m.add_user()
    m.start_scheduler()
    a = m.submit(alice, "--cpus", "1", *m.job_args("--gate", m.gate("a"), "--exit", "3"))
    b = m.submit(bob, "--cpus", "1", *m.job_args("--gate", m.gate("b"), "--exit", "0"))
    if CORES >= 2:
        m.until(lambda: m.job(a).state == m.job(b).state == "running")
    m.kill_scheduler()
    m.open_gate("a")
    m.open_gate("b")
    m.start_scheduler()  # a restarted service (systemd's Restart=on-failure)
    ja, jb = m.ended(a), m.ended(b)
    assert (ja.state, ja.exit_status) == ("failed", 3), m.scheduler_log()
    assert (jb.state, jb.exit_status) == ("done", 0)
    shown = json.loads(m.as_user(alice, "queue", "show", "--json", str(a)).stdout)
    assert shown["job"]["exit_status"] == 3


def _raw(m, user, payload: bytes) -> dict:
    """Send bytes to the machine-wide socket as ``user``; the scheduler's answer."""
    path = str(m.system_dir / "queue.sock")

    def send() -> int:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(20)
            conn.connect(path)
            # A request too large: it stops reading and answers; the answer waits for us.
            with contextlib.suppress(BrokenPipeError):
                conn.sendall(payload)
            data = b""
            while not data.endswith(b"\n"):
                chunk = conn.recv(65536)
                if not chunk:
                    break
                data += chunk
        print(data.decode().strip())
        return 0

    done = m.as_user_call(user, send)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _request(method: str, *args, **kwargs) -> bytes:
    return json.dumps({"method": method, "args": list(args), "kwargs": kwargs}).encode() + b"\n"


def test_forged_identity_symlinks_and_bad_requests_are_refused_and_it_keeps_serving(shared):
    m = shared()
    alice, mallory = m.add_user(), m.add_user()
    m.start_scheduler()
    a = m.submit(alice, "--cpus", "1", *m.job_args("--gate", m.gate("a")))
    # A uid in the request is not who sent it: the kernel's peer credential is.
    forged = json.loads(_request("cancel", a))
    forged.update(uid=alice.uid, user=alice.name)
    answer = _raw(m, mallory, json.dumps(forged).encode() + b"\n")
    assert not answer["ok"] and "your own jobs" in answer["error"]
    assert not m.job(a).ended
    env = m.user_env(mallory)
    base = {"argv": ["/usr/bin/python3", JOB], "env": env, "name": "x", "cpus": 1}
    answer = _raw(m, mallory, _request("submit", {**base, "cwd": "/", "uid": 0}))
    assert not answer["ok"] and "unknown request fields" in answer["error"]
    # Paths into alice's home (0700), named directly or through a symlink mallory made.
    link = mallory.home / "into-alice"
    os.symlink(alice.home, link)
    os.lchown(link, mallory.uid, mallory.gid)
    bad_log = _raw(m, mallory, _request("submit", {**base, "cwd": "/", "log_dir": str(link)}))
    bad_cwd = _raw(m, mallory, _request("submit", {**base, "cwd": str(link), "log_dir": "/tmp"}))
    jobs = [m.ended(bad_log["result"]["job"]["id"]), m.ended(bad_cwd["result"]["job"]["id"])]
    assert [j.state for j in jobs] == ["failed", "failed"]
    assert "Permission denied" in jobs[0].reason and "cannot write" in jobs[0].reason
    assert "cannot enter its folder" in jobs[1].reason
    assert sorted(p.name for p in alice.home.iterdir() if not p.name.startswith(".")) == []
    # Malformed and oversized requests get a line each; the scheduler goes on.
    assert "one JSON object" in _raw(m, mallory, b"not json\n")["error"]
    assert "too large" in _raw(m, mallory, b"[" * (2 << 20) + b"\n")["error"]
    assert "unknown request" in _raw(m, mallory, _request("close"))["error"]
    assert _raw(m, mallory, _request("jobs"))["ok"]
    m.open_gate("a")
    assert m.ended(a).state == "done"


def test_a_state_file_others_can_write_is_refused(shared):
    m = shared()
    m.start_scheduler()
    m.kill_scheduler()
    os.chmod(m.system_dir / "queue.sqlite", 0o666)
    done = subprocess.run(
        [sys.executable, "-m", "torchdoctor", "queue", "serve", "--system"],
        env=m.root_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert done.stderr.count("\n") == 1 and "writable by others" in done.stderr, done.stderr


def test_the_machines_exporter_scraped_by_prometheus_has_both_users_jobs(shared, tmp_path):
    from tests.exporters.prom import PROMETHEUS, free_port, prometheus, wait_for

    if not os.path.exists(PROMETHEUS):
        if os.environ.get("CI") == "true":
            raise AssertionError("CI=true: Prometheus is missing (make system)")
        pytest.skip("Prometheus is not installed (make system)")
    m = shared()
    alice, bob = m.add_user(), m.add_user()
    m.start_scheduler()
    ids = {
        u.name: m.submit(u, "--cpus", "1", *m.job_args("--gate", m.gate(u.name)))
        for u in (alice, bob)
    }
    m.until(lambda: all(m.job(i).state == "running" for i in ids.values()) if CORES > 1 else True)
    port = free_port()
    exporter = subprocess.Popen(
        [sys.executable, "-m", "torchdoctor", "exporter", "--all-users", "--no-findings",
         "--listen", str(port)],
        env=m.root_env(),
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert "/metrics" in exporter.stderr.readline()
        with prometheus(tmp_path, [f"127.0.0.1:{port}"]) as prom:

            def both() -> set[str]:
                users = {
                    r["metric"].get("user") for r in prom.query("torchdoctor_job_recording_up == 1")
                }
                return users >= {alice.name, bob.name} and users

            wait_for("both users' jobs in Prometheus", both)
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        assert SECRET_VALUE not in text and JOB not in text  # no environment, no command line
    finally:
        exporter.terminate()
        exporter.wait(timeout=30)
        for u in (alice, bob):
            m.open_gate(u.name)
    assert all(m.ended(i).state == "done" for i in ids.values()), m.scheduler_log()
