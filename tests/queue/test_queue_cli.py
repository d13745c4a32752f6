"""The queue's commands on bad input, history-based sizing, dependencies, restarts, privacy."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys

import pytest

from tests.conftest import TORCHDOCTOR
from tests.helpers.engines import not_root, require_engine
from tests.queue.conftest import FAKE_JOB, UUID0, one_gpu
from torchdoctor.queue.model import Job
from torchdoctor.queue.paths import queue_paths
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
        # a size of 0 placed the job anywhere ("0 B asked")
        (["--mem", "0"], "--mem 0: give a size above 0"),
        (["--gpus", "1", "--vram", "0G"], "--vram 0G: give a size above 0"),
        # --estimate sizes --vram auto; without it, it was silently dropped
        (["--estimate", "m.py:make"], "--estimate sizes the GPU memory of --vram auto"),
        (
            ["--gpus", "1", "--vram", "8GiB", "--estimate", "m.py:make"],
            "add --vram auto, or drop --estimate (--vram 8GiB is given)",
        ),
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


# -- the queue's folders and numbers on bad input (probe M9, minor item 11) -----------------


def _read_only(folder) -> list[str]:
    """A command prefix under which ``folder`` is read-only: a private read-only bind mount for
    root (whom a mode does not stop), the mode for anyone else."""
    if os.geteuid() != 0:
        os.chmod(folder, 0o555)
        return []
    require_engine("unshare", None if shutil.which("unshare") else "util-linux is not installed")
    script = f'mount --bind -o ro "{folder}" "{folder}" && exec "$@"'
    return ["unshare", "--mount", "sh", "-c", script, "sh"]


@pytest.mark.parametrize("variable", ["XDG_STATE_HOME", "XDG_RUNTIME_DIR"])
def test_a_queue_folder_variable_naming_a_file_is_one_line(queue_env, tmp_path, variable):
    q = queue_env()
    afile = tmp_path / "afile"
    afile.write_text("")
    q.env[variable] = str(afile)
    line = _one_error_line(q.td("submit", "--", sys.executable, FAKE_JOB))
    assert f"{afile}/torchdoctor cannot be made (Not a directory)" in line
    assert line.endswith(f"set {variable} to a folder you can write")


def test_a_read_only_state_folder_is_one_line(queue_env, tmp_path):
    q = queue_env()
    state = tmp_path / "read-only"
    state.mkdir()
    q.env["XDG_STATE_HOME"] = str(state)
    done = subprocess.run(
        [*_read_only(state), *TORCHDOCTOR, "submit", "--", sys.executable, FAKE_JOB],
        capture_output=True,
        text=True,
        timeout=120,
        env=q.env,
    )
    os.chmod(state, 0o755)
    line = _one_error_line(done)
    assert "(Read-only file system)" in line or "(Permission denied)" in line
    assert "set XDG_STATE_HOME to a folder you can write" in line
    assert not any(state.iterdir())


def test_a_relative_state_home_is_ignored_as_the_xdg_spec_says(queue_env, tmp_path):
    q = queue_env()
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    q.env.update(HOME=str(home), XDG_STATE_HOME="rel/state")
    q.paths = queue_paths(q.env)  # so that the test stops the scheduler this queue starts
    assert q.paths.state_dir == home / ".local" / "state" / "torchdoctor"
    job_id = int(q.td("submit", "-q", "--", sys.executable, FAKE_JOB, cwd=cwd, check=True).stdout)
    assert q.job(job_id) is not None
    assert list(cwd.iterdir()) == []


def test_a_priority_beyond_64_bits_is_one_line_with_the_range(queue_env):
    q = queue_env()
    q.td("queue", "pause", check=True)  # the jobs wait, so their priority can change
    huge, most = str(2**63), str(2**63 - 1)
    line = _one_error_line(q.td("submit", "--priority", huge, "--", sys.executable, FAKE_JOB))
    assert line.endswith(f"priority {huge}: give a whole number from {-(2**63)} to {most}")
    assert json.loads(q.td("queue", "--json", check=True).stdout)["jobs"] == []
    job_id = q.submit("--priority", most, "--", sys.executable, FAKE_JOB)
    assert q.job(job_id).priority == 2**63 - 1
    line = _one_error_line(q.td("queue", "priority", str(job_id), "-" + huge + "1"))
    assert f"give a whole number from {-(2**63)} to {most}" in line
    # A negative priority is a value, without `--` (as `submit --priority -5` reads it).
    done = q.td("queue", "priority", str(job_id), "-5", check=True)
    assert done.stdout == f"job {job_id} priority -5\n"
    assert q.job(job_id).priority == -5


@pytest.mark.parametrize("name", ["a\nb", "tab\there", "esc\x1b[31m", "line\u2028sep"])
def test_a_job_name_with_control_characters_is_refused(queue_env, name):
    q = queue_env()
    line = _one_error_line(q.td("submit", "--name", name, "--", sys.executable, FAKE_JOB))
    assert line.endswith("give one without newlines or control characters (--name NAME)")
    assert json.loads(q.td("queue", "--json", check=True).stdout)["jobs"] == []


def test_queue_install_into_a_folder_it_cannot_write_is_one_line(tmp_path):
    folder = tmp_path / "units"
    folder.mkdir()
    done = subprocess.run(
        [*_read_only(folder), *TORCHDOCTOR, "queue", "install", "--dir", str(folder)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    os.chmod(folder, 0o755)
    line = _one_error_line(done)
    assert line.startswith(f"torchdoctor: error: cannot write the unit files into {folder} (")
    assert line.endswith("run it as root, or give --dir a folder you can write")
    assert list(folder.iterdir()) == []


def test_text_of_non_utf8_bytes_is_stored_and_read_back_as_it_was(tmp_path):
    # A legal Linux name (a Latin-1 folder, a script's argument): Python hands it over with
    # surrogate escapes, which a TEXT column cannot take; found by the fuzz suite.
    store = QueueStore(tmp_path / "queue.sqlite")
    odd = os.fsdecode(b"/tmp/caf\xe9")
    job_id = store.add(Job(0, "caf\udce9", ["python", odd], {"X": odd}, odd, 1.0))
    store.update(job_id, reason=f"no such folder {odd}")
    job = store.get(job_id)
    store.close()
    assert (job.name, job.cwd, job.argv[1], job.env["X"]) == ("caf\udce9", odd, odd, odd)
    assert job.reason == f"no such folder {odd}"


def test_a_job_in_a_folder_of_non_utf8_bytes_runs(queue_env, tmp_path):
    q = queue_env()
    folder = os.fsdecode(os.fsencode(tmp_path) + b"/caf\xe9")
    os.mkdir(folder)
    job_id = q.submit("--cwd", folder, "--", sys.executable, FAKE_JOB)
    assert q.wait(job_id) == 0
    assert q.job(job_id).cwd == folder


def test_queue_install_into_a_folder_of_non_utf8_bytes_prints_it_escaped(tmp_path):
    folder = os.fsencode(tmp_path) + b"/units-\xff"
    done = subprocess.run(
        [*TORCHDOCTOR, "queue", "install", "--dir", folder],
        capture_output=True,
        timeout=60,
        env={**os.environ, "LC_ALL": "C.UTF-8", "PYTHONUTF8": "0", "PYTHONIOENCODING": "utf-8"},
    )
    assert done.returncode == 0, done.stderr
    assert b"Traceback" not in done.stderr
    assert b"units-\\udcff/torchdoctor-queue.service" in done.stdout  # escaped, one line
    assert sorted(os.listdir(folder)) == [
        b"torchdoctor-exporter.service",
        b"torchdoctor-queue.service",
    ]
