"""`torchdoctor top` as a user runs it: --once, --once --json, bad input, and keys in tmux."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest

from tests import fake_nvml
from tests.helpers.engines import engine
from tests.helpers.machine_gpus import assert_gpu_status_matches, machine_gpus
from torchdoctor import cli
from torchdoctor.sampling import procfs
from torchdoctor.sampling.gpus import GpuReader
from torchdoctor.sampling.pidns import PidNamespace
from torchdoctor.thresholds import Thresholds
from torchdoctor.top.app import decode_keys, deliver
from torchdoctor.top.collect import TopCollector
from torchdoctor.top.keys import SendSignal
from torchdoctor.top.model import UiState, build_view
from torchdoctor.top.snapshot import SCHEMA, snapshot


def test_once_json_describes_the_job_and_its_workers(td, torch_job):
    result = td("top", "--once", "--json", "--interval", "0.3")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["schema"] == SCHEMA
    (job,) = [j for j in data["jobs"] if j["root_pid"] == torch_job.pid]
    assert job["workers"] == 2
    trainer, *workers = job["processes"]
    assert (trainer["pid"], trainer["role"], trainer["depth"]) == (torch_job.pid, "trainer", 0)
    assert trainer["cmdline"][-1] == "--td-live"
    assert sorted(w["pid"] for w in workers) == torch_job.workers
    for w in workers:
        assert (w["role"], w["ppid"], w["depth"]) == ("dataloader-worker", torch_job.pid, 1)
        assert w["rss"] > 0 and w["threads"] >= 1 and w["cpu_percent"] is not None
        # Workers share the trainer's pages: PSS counts them once, RSS in each.
        assert w["pss"] < w["rss"]
    assert job["rss"] == sum(p["rss"] for p in job["processes"])
    host = data["host"]
    assert len(host["per_core"]) >= 1 and host["cpu"]["iowait"] >= 0
    assert host["levels"]["cpu_load_pct"] in ("ok", "warn", "alert")
    assert_gpu_status_matches(data["gpu"]["available"], data["gpu"]["reason"], len(data["gpus"]))
    assert data["thresholds"]["gpu_memory_alert_pct"] == 90.0


def test_once_prints_the_screen_without_key_hints(torch_job, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["top", "--once", "--interval", "0.3"])
    assert exit_info.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].strip().startswith("torchdoctor top")
    if machine_gpus().available:  # one row per device, under the GPU header
        assert not any(line.startswith("GPUs: none shown: ") for line in lines)
        assert sum(gpu.name in line for gpu in machine_gpus().gpus for line in lines) >= 1
    else:
        assert any(line.startswith("GPUs: none shown: ") for line in lines)
    assert any(f"job {torch_job.pid} 2 workers" in line for line in lines)
    assert all(len(line) <= 80 for line in lines)
    assert not any("q quit" in line for line in lines)


def test_bad_input_is_one_line_and_a_non_zero_exit(tmp_path, capsys):
    bad = tmp_path / "t.toml"
    bad.write_text("gpu_memory_alert = 95\n")
    for args, message in [
        (["--json"], "--json prints one snapshot: use it with --once"),
        (["--once", "--interval", "0"], "--interval 0 is out of range: use 0.1-3600 seconds"),
        (["--once", "--interval", "0.01"], "--interval 0.01 is out of range: use 0.1-3600"),
        (["--once", "--interval", "1e-9"], "cannot read --interval '1e-9'"),
        (["--once", "--thresholds", str(bad)], "unknown threshold 'gpu_memory_alert'"),
        ([], "torchdoctor top needs a terminal"),  # pytest's stdin is not a terminal
    ]:
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["top", *args])
        assert exit_info.value.code == 2, args
        out, err = capsys.readouterr()
        assert out == ""
        (line,) = err.strip().splitlines()
        assert line.startswith("torchdoctor: error: ") and message in line


def test_once_does_not_wait_a_long_interval(td):
    # --once --interval 3600 waited an hour between its two readings; the timeout (far below
    # an hour, far above the snapshot's couple of seconds) fails the test if it still does.
    result = td("top", "--once", "--json", "--interval", "1h", timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)


def test_snapshot_json_of_gpus_levels_and_unresolved_pids(torch_job):
    gpu = fake_nvml.FakeGpu(compute_processes=[(torch_job.pid, 3 << 30), (4_000_000, 1 << 30)])
    gpu.memory_used = int(0.93 * gpu.memory_total)
    reader = GpuReader(fake_nvml.FakeNvml([gpu]), pid_namespace=PidNamespace(procfs_is_host=True))
    collector = TopCollector(Thresholds(), gpu_reader=reader)
    try:
        readings = collector.read()
    finally:
        collector.close()
    data = snapshot(readings, build_view(readings, Thresholds(), UiState()), Thresholds())
    json.dumps(data)  # serialisable as is
    (g,) = data["gpus"]
    assert g["level"] == "alert" and g["memory_pct"] == pytest.approx(93.0, abs=0.1)
    procs = {p["pid"]: p for p in data["gpu_processes"]}
    assert procs[torch_job.pid]["job"] == torch_job.pid
    assert procs[torch_job.pid]["used_memory"] == 3 << 30
    (job,) = [j for j in data["jobs"] if j["root_pid"] == torch_job.pid]
    assert job["gpu_memory"] == 3 << 30


def test_confirmed_signal_reaches_the_process_and_only_it():
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        # The identity top confirms: start time as JobReader computes it from /proc.
        stat = procfs.parse_pid_stat(procfs.read_path(f"/proc/{child.pid}/stat"))
        create_time = procfs.boot_time() + stat.starttime / procfs.CLK_TCK
        reused = SendSignal(child.pid, create_time - 100, signal.SIGTERM)
        assert "PID was reused" in deliver(reused)
        assert child.poll() is None
        confirmed = SendSignal(child.pid, create_time, signal.SIGTERM)
        assert deliver(confirmed) == f"sent SIGTERM to {child.pid}"
        assert child.wait(timeout=30) == -signal.SIGTERM
        assert "has exited" in deliver(confirmed)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_terminal_keys_are_decoded():
    assert decode_keys(b"\x1b[A\x1b[Bq") == ["up", "down", "q"]
    assert decode_keys(b"/ab\x7f\r") == ["/", "a", "b", "backspace", "enter"]
    assert decode_keys(b"\x1b[15~s") == ["s"]  # F5: ignored whole
    assert decode_keys(b"\x1b") == ["esc"]


@engine("tmux", None if shutil.which("tmux") else "tmux is not installed")
def test_interactive_in_an_80x24_terminal(torch_job):
    session = f"td-{uuid.uuid4().hex[:8]}"
    tmux = ["tmux", "-L", session]
    subprocess.run(
        [
            *tmux,
            "new-session",
            "-d",
            "-s",
            session,
            "-x",
            "80",
            "-y",
            "24",
            f"{sys.executable} -m torchdoctor top --interval 0.5",
        ],
        check=True,
        env=_env(),
    )

    def screen() -> str:
        return subprocess.run(
            [*tmux, "capture-pane", "-p", "-t", session], capture_output=True, text=True
        ).stdout

    def wait_for(predicate, what: str) -> str:
        # The screen is redrawn by another process: poll it, with a deadline generous enough
        # for a loaded machine (Python starting top alone can take seconds there).
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            text = screen()
            if predicate(text):
                return text
            time.sleep(0.05)
        raise AssertionError(f"{what} never appeared:\n{screen()}")

    def keys(*k: str) -> None:
        subprocess.run([*tmux, "send-keys", "-t", session, *k], check=True)

    try:
        text = wait_for(lambda t: "▸ job" in t and "MEM" in t, "the first screen")
        lines = text.splitlines()
        assert len(lines) <= 24 and all(len(line) <= 80 for line in lines)
        assert "sort CPU%" in lines[0]
        assert "q quit" in [line for line in lines if line.strip()][-1]
        # Other jobs may run on this machine: find ours by its PID.
        keys("/", str(torch_job.pid), "Enter")
        # The screen before the filter shows our job too: wait for the filtered redraw.
        text = wait_for(
            lambda t: f"filter '{torch_job.pid}'" in t and f"{torch_job.pid} trainer" in t,
            "our job, filtered",
        )
        jobs = [line for line in text.splitlines() if line.startswith("▸ job")]
        assert jobs == [line for line in jobs if line.startswith(f"▸ job {torch_job.pid} ")], text
        assert "2 workers" in jobs[0]
        keys("Down", "Enter")
        wait_for(lambda t: f"process {torch_job.pid}  trainer" in t, "the detail")
        keys("k")
        wait_for(lambda t: f"signal to {torch_job.pid}:" in t, "the signal prompt")
        keys("t")
        wait_for(lambda t: f"send SIGTERM to {torch_job.pid}" in t and "y/n" in t, "the question")
        keys("n")
        wait_for(lambda t: "no signal sent" in t, "the refusal")
        assert _alive(torch_job.pid)
        # A resize redraws at the new size, even in the middle of a question.
        keys("k")
        wait_for(lambda t: f"signal to {torch_job.pid}:" in t, "the signal prompt again")
        subprocess.run([*tmux, "resize-window", "-t", session, "-x", "100", "-y", "30"], check=True)
        text = wait_for(lambda t: len(t.splitlines()[0]) > 80, "the wider screen")
        assert f"signal to {torch_job.pid}:" in text
        keys("Escape")
        wait_for(lambda t: "no signal sent" in t, "the cancel")
        keys("q")
        deadline = time.monotonic() + 60
        while _has_session(tmux, session) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _has_session(tmux, session)
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)


def _has_session(tmux, session) -> bool:
    return (
        subprocess.run([*tmux, "has-session", "-t", session], capture_output=True).returncode == 0
    )


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "TERM": "xterm-256color"}
