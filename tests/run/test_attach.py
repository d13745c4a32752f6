"""`torchdoctor attach PID` on real jobs started without torchdoctor: steps seen from outside.

Each job is a torch CPU loop that runs until the test writes a line on its stdin; the attach is
ended with Ctrl-C (SIGINT) once the recording holds enough steps, and the job then runs on to
its own end, with its own output and exit status.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import TORCHDOCTOR
from tests.helpers.engines import engine
from torchdoctor import open_recording
from torchdoctor.compare.runs import run_figures
from torchdoctor.diagnosis.engine import diagnose
from torchdoctor.sampling.pystacks import py_spy_path
from torchdoctor.thresholds import Thresholds
from torchdoctor.top.recordings import RecordingWatcher

IN_CI = os.environ.get("CI") == "true"
IS_ROOT = os.geteuid() == 0

# py-spy comes from PyPI with its binary in the wheel (a base dependency of torchdoctor): the
# one engine rule applies (skip here, fail on CI).
needs_py_spy = engine(
    "py-spy",
    None if py_spy_path() else "py-spy is not installed (pip install torchdoctor)",
)

# The loop runs until a line arrives on stdin; it prints its own lines and exits with 7, and
# writes when each of its steps ended to the file argv[2] names, if one does.
# The data-bound loops wait 32 ms for each batch; the model's forward then waits as if on a GPU:
# 16 ms ("data-bound": three sampling periods, so nearly every step is seen) or 0.5 ms
# ("data-bound-short": under one, so most steps go unseen and the seen ones merge). Sleeps, not
# computing, so that what the samples can resolve does not depend on the speed of the CPU.
LOOP = textwrap.dedent(
    """
    import json, sys, threading, time, torch
    from torch.utils.data import DataLoader, Dataset, TensorDataset
    torch.set_num_threads(1)
    KIND = sys.argv[1]
    ENDS = sys.argv[2] if len(sys.argv) > 2 else None
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()

    class Slow(Dataset):
        def __len__(self):
            return 10**7
        def __getitem__(self, i):
            time.sleep(0.004)   # decoding a sample from disk, say
            return torch.randn(16), torch.randn(1)

    class Waits(torch.nn.Module):
        def __init__(self, seconds):
            super().__init__()
            self.seconds = seconds
            self.linear = torch.nn.Linear(16, 1)
        def forward(self, x):
            time.sleep(self.seconds)
            return self.linear(x)

    if KIND.startswith("data-bound"):
        data = DataLoader(Slow(), batch_size=8)
        model = Waits(0.016 if KIND == "data-bound" else 0.0005)
    else:
        data = DataLoader(TensorDataset(torch.randn(4096, 512), torch.randn(4096, 1)), batch_size=256)
        model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(6)], torch.nn.Linear(512, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3) if KIND != "no-optimizer" else None
    steps = 0
    ends = []
    while not stop.is_set():
        for x, y in data:
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            if opt is not None:
                opt.step()
                opt.zero_grad()
            else:
                with torch.no_grad():
                    for p in model.parameters():
                        p -= 1e-3 * p.grad
                        p.grad = None
            steps += 1
            ends.append(time.time())
            if steps == 3:
                print("training", flush=True)
            if stop.is_set():
                break
    if ENDS:
        with open(ENDS, "w") as f:
            json.dump(ends, f)
    print(f"job finished after {steps} steps", flush=True)
    sys.exit(7)
    """
)


def _start_job(kind: str, *args: str, **kwargs) -> subprocess.Popen[str]:
    job = subprocess.Popen(
        [sys.executable, "-c", LOOP, kind, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "TORCHDOCTOR_NO_INSTRUMENT": "1"},
        **kwargs,
    )
    assert job.stdout.readline().strip() == "training"  # mid-run from here on
    return job


def _attach(pid: int, out: Path, *prefix: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*prefix, *TORCHDOCTOR, "attach", str(pid), "--interval", "0.25", "--out", str(out)],
        stderr=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _count(path: Path, table: str) -> int:
    if not path.exists():
        return 0
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            return db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]
        finally:
            db.close()
    except sqlite3.Error:
        return 0


def _wait_for(path: Path, table: str, n: int, proc: subprocess.Popen[str], timeout=150) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _count(path, table) >= n:
            return
        if proc.poll() is not None:
            raise AssertionError(f"attach ended early: {proc.stderr.read()}")
        time.sleep(0.2)
    raise AssertionError(f"fewer than {n} rows in {table} after {timeout} s")


def _attach_until_steps(kind: str, tmp_path: Path, steps: int = 40):
    """Attach to a running ``kind`` loop until ``steps`` steps are recorded, Ctrl-C the attach,
    then let the job finish; (attach stderr, job stdout, job status, recording path). The job's
    own step ends are in ``tmp_path / "ends.json"``."""
    job = _start_job(kind, str(tmp_path / "ends.json"))
    rec = tmp_path / f"{kind}.sqlite"
    try:
        attach = _attach(job.pid, rec)
        _wait_for(rec, "steps", steps, attach)
        attach.send_signal(signal.SIGINT)
        _, err = attach.communicate(timeout=60)
        assert attach.returncode == 0, err
        assert job.poll() is None, "the job must run on after the attach ends"
        out, _ = job.communicate("stop\n", timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
    return err, out, job.returncode, rec


def _steps_of_the_job_within(rec_steps: list[dict], ends_file: Path) -> tuple[int, int]:
    """(steps recorded, steps the job itself ended) over the recorded steps' span."""
    ends = json.loads(ends_file.read_text())
    first, last = min(s["t_start"] for s in rec_steps), max(s["t_end"] for s in rec_steps)
    return len(rec_steps), sum(first < t <= last for t in ends)


@needs_py_spy
def test_data_bound_job_attached_mid_run_is_named_dataloader_bound(tmp_path: Path) -> None:
    err, out, status, rec = _attach_until_steps("data-bound", tmp_path)
    assert "seeing steps by sampling" in err and "not looking inside" not in err
    assert out.startswith("job finished after ") and status == 7  # its own output and status
    with open_recording(rec) as r:
        assert r.meta["steps_source"] == "sampled-stacks"
        assert r.meta.get("steps_source_limit") is None  # its steps resolve: counted
        seen, ran = _steps_of_the_job_within(r.rows("steps"), tmp_path / "ends.json")
        # The steps the job ran while sampled, up to those in the gaps between py-spy's runs
        # (and to py-spy's clock: a chunk's span is its samples times the period).
        assert 0.75 * ran <= seen <= 1.1 * ran + 2, (seen, ran)
        stats = r.step_stats()
        assert stats.step_count >= 40
        assert stats.data_wait_fraction > 0.5
        loaders = r.rows("dataloaders")
        assert [d["num_workers"] for d in loaders] == [0]
        assert loaders[0]["dataset_type"] == "Slow"
        findings = {f.id: f for f in diagnose(r)}
    found = findings["dataloader-bound"]
    assert found.severity in ("warning", "critical")
    assert found.recommendation  # the fix, sized as under `torchdoctor run`
    html = tmp_path / "report.html"
    report = subprocess.run(
        [*TORCHDOCTOR, "report", str(rec), "-o", str(html)], capture_output=True, text=True
    )
    assert report.returncode == 0, report.stderr
    page = html.read_text()
    assert "steps seen by" in page and "sampled-stacks: main thread" in page
    assert "dataloader-bound" in page


@needs_py_spy
def test_steps_too_short_to_resolve_are_said_to_be_a_lower_bound(tmp_path: Path) -> None:
    # The work between two data waits is shorter than the 5 ms sampling period: most steps go
    # unseen, and the seen ones are several merged. A rate read off them would be far too low.
    _, _, status, rec = _attach_until_steps("data-bound-short", tmp_path, steps=20)
    assert status == 7
    with open_recording(rec) as r:
        limit = r.meta["steps_source_limit"]
        seen, ran = _steps_of_the_job_within(r.rows("steps"), tmp_path / "ends.json")
        assert seen < 0.75 * ran, (seen, ran)  # what the note is there for
        last = max(s["t_end"] for s in r.rows("steps"))
        assert any("merge" in n for n in run_figures(r).notes)  # compare says so of the run
        assert r.step_stats().data_wait_fraction > 0.8  # the share holds: 32 ms of about 33
        found = {f.id: f for f in diagnose(r)}["dataloader-bound"]
    assert "lower bounds" in limit and "5 ms" in limit
    # The fix and its speed-up come from the ratios, which hold; no time per step is claimed.
    assert found.settings["num_workers"] >= 2
    assert "x the compute" in found.recommendation and "of each step" not in found.recommendation
    assert "more steps per second" in found.expected_effect
    assert "per step" not in found.expected_effect
    assert limit in found.details
    assert "predicted step time after the fix" not in {e.label for e in found.evidence}
    show = subprocess.run([*TORCHDOCTOR, "show", str(rec)], capture_output=True, text=True)
    assert show.returncode == 0, show.stderr
    assert f"  {limit}" in show.stdout.splitlines()
    html = tmp_path / "report.html"
    report = subprocess.run(
        [*TORCHDOCTOR, "report", str(rec), "-o", str(html)], capture_output=True, text=True
    )
    assert report.returncode == 0, report.stderr
    assert "steps counted" in html.read_text()
    watcher = RecordingWatcher(Thresholds())  # `top` shows the rate as at least what it saw
    try:
        assert watcher.status(rec, now=last + 1.0).rate_lower_bound
    finally:
        watcher.close()
    shown = subprocess.run(
        [*TORCHDOCTOR, "show", "--json", str(rec)], capture_output=True, text=True
    )
    assert json.loads(shown.stdout)["steps_source_limit"] == limit


@needs_py_spy
def test_healthy_job_attached_gets_no_false_finding(tmp_path: Path) -> None:
    err, _, status, rec = _attach_until_steps("healthy", tmp_path, steps=30)
    assert status == 7
    with open_recording(rec) as r:
        assert r.meta["steps_source"] == "sampled-stacks"
        stats = r.step_stats()
        assert stats.step_count >= 30 and stats.data_wait_fraction < 0.2
        assert stats.boundary == "optimizer"
        ids = {f.id for f in diagnose(r)}
    assert "dataloader-bound" not in ids, ids


@needs_py_spy
def test_no_optimizer_loop_attached_steps_by_backward(tmp_path: Path) -> None:
    _, _, status, rec = _attach_until_steps("no-optimizer", tmp_path, steps=30)
    assert status == 7
    with open_recording(rec) as r:
        stats = r.step_stats()
        assert stats.step_count >= 30 and stats.boundary == "backward"
    show = subprocess.run([*TORCHDOCTOR, "show", str(rec)], capture_output=True, text=True)
    assert "each backward() ends a step" in show.stdout
    assert "estimated from sampled stacks" in show.stdout


@needs_py_spy
def test_job_that_ends_during_the_attach_is_recorded_to_its_end(tmp_path: Path) -> None:
    job = _start_job("data-bound")
    rec = tmp_path / "ends.sqlite"
    try:
        attach = _attach(job.pid, rec)
        _wait_for(rec, "steps", 10, attach)
        asked = time.time()
        out, _ = job.communicate("stop\n", timeout=60)
        ended = time.time()
        _, err = attach.communicate(timeout=60)  # ends by itself with the job
    finally:
        if job.poll() is None:
            job.kill()
    assert attach.returncode == 0, err
    assert job.returncode == 7 and out.startswith("job finished after ")
    with open_recording(rec) as r:
        assert r.complete and r.meta["ended_at"] >= ended - 1.0
        assert len(r.rows("steps")) >= 10
        # The job was sampled until it ended, not until the attach gave up on it.
        last = max(p["t"] for p in r.rows("process_samples") if p["pid"] == job.pid)
        assert last >= asked


# -- refused targets: one line, the tree still recorded -------------------------------------

HOLD = "import sys; print('ready', flush=True); sys.stdin.readline()"


def _refused(job: subprocess.Popen[str], tmp_path: Path, *prefix: str) -> tuple[str, Path]:
    """Attach to ``job`` (which waits on stdin), let the tree be sampled, end the job;
    the attach's stderr and the recording."""
    rec = tmp_path / "refused.sqlite"
    try:
        attach = _attach(job.pid, rec, *prefix)
        _wait_for(rec, "process_samples", 3, attach)
        job.communicate("end\n", timeout=30)
        _, err = attach.communicate(timeout=60)
        assert attach.returncode == 0, err
    finally:
        if job.poll() is None:
            job.kill()
    with open_recording(rec) as r:
        assert job.pid in {p["pid"] for p in r.processes()}
        assert r.meta["steps_source"] == "none"
        assert r.meta["steps_source_reason"]
        assert r.step_stats() is None or r.step_stats().step_count == 0
    watcher = RecordingWatcher(Thresholds())  # `top` says why there are no steps
    try:
        status = watcher.status(rec, now=time.time())
        assert status.unavailable["steps"] == f"steps not seen: {r.meta['steps_source_reason']}"
    finally:
        watcher.close()
    lines = [line for line in err.splitlines() if "not looking inside" in line]
    assert len(lines) == 1, err
    assert lines[0].endswith("recording the process tree only.")
    return lines[0], rec


def test_non_python_process_is_refused_in_one_line(tmp_path: Path) -> None:
    job = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line, _ = _refused(job, tmp_path)
    assert f"PID {job.pid} runs cat, not Python" in line


def test_remote_debug_opt_out_is_respected(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON_DISABLE_REMOTE_DEBUG": "1"}
    job = subprocess.Popen(
        [sys.executable, "-c", HOLD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=env,
    )  # fmt: skip
    assert job.stdout.readline().strip() == "ready"
    line, _ = _refused(job, tmp_path)
    assert "PYTHON_DISABLE_REMOTE_DEBUG" in line


@pytest.mark.skipif(not IS_ROOT and not IN_CI, reason="creating another user needs root")
def test_another_users_job_is_refused_in_one_line(tmp_path: Path) -> None:
    name = "tdattach"
    try:
        pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--no-create-home", name], check=True)
    user = pwd.getpwnam(name)
    python = shutil.which("python3", path="/usr/bin:/bin") or "/usr/bin/python3"
    job = subprocess.Popen(
        ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups",
         python, "-c", HOLD],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/",
    )  # fmt: skip
    assert job.stdout.readline().strip() == "ready"
    line, _ = _refused(job, tmp_path)
    assert f"PID {job.pid} belongs to user {name}" in line
    assert f"as user {name}" in line


# The job makes itself non-dumpable (as setuid programs are): without CAP_SYS_PTRACE the kernel
# refuses any ptrace-mode access to it, Yama or not.
UNDUMPABLE = "import ctypes; ctypes.CDLL(None).prctl(4, 0, 0, 0, 0); " + HOLD


def _no_ptrace_cap() -> tuple[str, ...]:
    if not IS_ROOT:
        return ()  # an ordinary user has no CAP_SYS_PTRACE to drop
    return ("setpriv", "--inh-caps=-sys_ptrace", "--bounding-set=-sys_ptrace")


def test_ptrace_forbidden_is_refused_in_one_line(tmp_path: Path) -> None:
    job = subprocess.Popen(
        [sys.executable, "-c", UNDUMPABLE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert job.stdout.readline().strip() == "ready"
    line, _ = _refused(job, tmp_path, *_no_ptrace_cap())
    assert "the kernel refuses to let us read" in line and "CAP_SYS_PTRACE" in line


YAMA = Path("/proc/sys/kernel/yama/ptrace_scope")


@pytest.mark.skipif(not YAMA.exists(), reason="this kernel has no Yama LSM")
@pytest.mark.skipif(not IS_ROOT, reason="setting kernel.yama.ptrace_scope needs root")
def test_yama_scope_is_named_in_the_refusal(tmp_path: Path) -> None:
    # Scope 1 (not 3: that one sticks until reboot), and without CAP_SYS_PTRACE, which root
    # would otherwise use to pass: the attach is not the job's ancestor.
    before = YAMA.read_text().strip()
    try:
        YAMA.write_text("1\n")
        job = subprocess.Popen(
            [sys.executable, "-c", HOLD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        assert job.stdout.readline().strip() == "ready"
        line, _ = _refused(job, tmp_path, *_no_ptrace_cap())
    finally:
        with contextlib.suppress(OSError):
            YAMA.write_text(before + "\n")
    assert "kernel.yama.ptrace_scope = 1" in line
