"""A torch.profiler window armed by `torchdoctor run --profile-steps`: real CPU jobs, both agent
paths (the compiled one and TORCHDOCTOR_AGENT_PURE_PYTHON=1)."""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import TORCHDOCTOR, run_td
from torchdoctor.recording import open_recording
from torchdoctor.recording.paths import profile_folder

JOB = Path(__file__).resolve().parent / "jobs" / "sync_loop.py"
PATHS = {"compiled": {}, "python": {"TORCHDOCTOR_AGENT_PURE_PYTHON": "1"}}


def line_of(marker: str) -> int:
    for number, text in enumerate(JOB.read_text().splitlines(), start=1):
        if marker in text:
            return number
    raise AssertionError(marker)


def job_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHDOCTOR_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(extra or {}))
    return env


def td_run(out: Path, *job_args: str, options=()) -> list[str]:
    """`torchdoctor run` of the job into ``out`` (without `torchdoctor` itself)."""
    return [
        "run",
        "--quiet",
        "--out",
        str(out),
        *options,
        "--",
        sys.executable,
        str(JOB),
        *job_args,
    ]


def record(tmp_path: Path, *job_args: str, options=(), env=None):
    out = tmp_path / "run.sqlite"
    proc = run_td(*td_run(out, *job_args, options=options), env=job_env(env), timeout=180)
    return proc, out


@pytest.mark.parametrize("path", sorted(PATHS))
def test_window_of_steps_5_to_7(tmp_path, path):
    proc, out = record(
        tmp_path, "20", "--print", options=("--profile-steps", "5-7"), env=PATHS[path]
    )
    assert proc.returncode == 0, proc.stderr
    with open_recording(out) as rec:
        settings = {r["key"]: r["value"] for r in rec.rows("settings")}
        assert json.loads(settings["agent.fast_path"]).startswith(path)
        (window,) = rec.profile_windows()
        steps = rec.steps()
        stats = rec.step_stats()
        sites = rec.profile_sync_sites(window.id)
    assert (window.first_step, window.last_step, window.warmup_step) == (5, 7, 4)
    assert window.state == "done" and window.reason is None
    trace = Path(window.trace_path)
    assert trace == profile_folder(out) / "rank0-steps5-7.pt.trace.json.gz"
    assert window.trace_bytes == trace.stat().st_size > 0

    # The trace: gzipped Chrome JSON, ProfilerStep#N for the job's steps 5..7, aten ops.
    with gzip.open(trace, "rt") as fh:
        events = json.load(fh)["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert sorted(n for n in names if n.startswith("ProfilerStep#")) == [
        "ProfilerStep#5",
        "ProfilerStep#6",
        "ProfilerStep#7",
    ]
    assert {"aten::addmm", "aten::item", "aten::_local_scalar_dense"} <= names

    # Steps 4 (warm-up) to 8 (the export's stall) are marked and left out of the figures.
    assert [r["step"] for r in steps if r["profiled"]] == [4, 5, 6, 7, 8]
    assert stats.step_count == 20
    assert stats.measured_steps == 20 - 2 - 5  # the warm-up rule's 2, the window's 5

    # The sync points, by source line: once per active step each.
    by_site = {(s.op, Path(s.file).name, s.line): s for s in sites}
    item = by_site[("item", JOB.name, line_of("ITEM-LINE"))]
    printed = by_site[("__repr__", JOB.name, line_of("PRINT-LINE"))]
    assert item.count == printed.count == 3
    assert item.function == "<module>" and item.total_s > 0
    # repr's own item()/tolist() calls inside torch are part of the print, not sites.
    assert {s.op for s in sites} == {"item", "__repr__"}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_no_window_without_the_option(tmp_path, path):
    check = tmp_path / "check.json"
    proc, out = record(tmp_path, "12", "--check-originals", str(check), env=PATHS[path])
    assert proc.returncode == 0, proc.stderr
    assert json.loads(check.read_text()) == {"identical": True, "wrapped_seen": False}
    with open_recording(out) as rec:
        assert rec.profile_windows() == []
        assert not any(r["profiled"] for r in rec.steps())
        assert rec.step_stats().measured_steps == 12 - 1
    assert not profile_folder(out).exists()


def test_originals_back_after_the_window(tmp_path):
    check = tmp_path / "check.json"
    proc, out = record(
        tmp_path, "12", "--check-originals", str(check), options=("--profile-steps", "3-4")
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(check.read_text()) == {"identical": True, "wrapped_seen": True}


def test_a_failing_profiler_ends_the_window_not_the_job(tmp_path):
    proc, out = record(
        tmp_path, "12", "--break-profiler", "--exit", "3", options=("--profile-steps", "5-6")
    )
    assert proc.returncode == 3, proc.stderr
    with open_recording(out) as rec:
        (window,) = rec.profile_windows()
        assert rec.step_stats().step_count == 12  # every step recorded: the agent stayed on
        assert not rec.rows("events", where={"kind": "instrumentation-disabled"})
    assert window.state == "failed"
    assert "profiler unavailable here" in window.reason
    assert window.trace_path is None


def test_a_job_ending_inside_the_window_keeps_what_was_recorded(tmp_path):
    proc, out = record(tmp_path, "8", options=("--profile-steps", "5-20"))
    assert proc.returncode == 0, proc.stderr
    with open_recording(out) as rec:
        (window,) = rec.profile_windows()
    assert window.state == "cut", window.reason
    assert (window.first_step, window.last_step) == (5, 7)
    assert "ended" in window.reason
    with gzip.open(window.trace_path, "rt") as fh:
        names = {e.get("name", "") for e in json.load(fh)["traceEvents"]}
    assert {"ProfilerStep#5", "ProfilerStep#7"} <= names


def test_bad_window_is_refused_before_the_job_starts(tmp_path):
    proc, out = record(tmp_path, "3", options=("--profile-steps", "1-80"))
    assert proc.returncode == 2
    assert "--profile-steps" in proc.stderr
    assert not out.exists()


def wait_for_steps(path: Path, n: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open_recording(path) as rec:
                if rec.count("steps") >= n:
                    return
        except Exception:  # noqa: BLE001 - not created yet, or just starting
            pass
        time.sleep(0.5)
    raise AssertionError(f"{path} has no {n} steps after {timeout} s")


def test_profile_asks_a_running_job_for_a_window(tmp_path):
    out = tmp_path / "live.sqlite"
    job = subprocess.Popen(
        [*TORCHDOCTOR, *td_run(out, "100000", "--sleep", "0.005")],
        env=job_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_steps(out, 3)
        asked = run_td("profile", str(out), "--steps", "2", "--timeout", "150", timeout=240)
        assert asked.returncode == 0, asked.stderr
        first, last = map(int, re.search(r"steps (\d+)-(\d+)", asked.stderr).groups())
        assert last == first + 1
        with open_recording(out) as rec:
            (window,) = rec.profile_windows()
            profiled = [r["step"] for r in rec.steps() if r["profiled"]]
            sites = rec.profile_sync_sites(window.id)
        assert (window.state, window.first_step, window.last_step) == ("done", first, last)
        assert window.trace_path in asked.stderr
        assert profiled[:4] == [first - 1, first, first + 1, first + 2]
        with gzip.open(window.trace_path, "rt") as fh:
            names = {e.get("name", "") for e in json.load(fh)["traceEvents"]}
        assert {f"ProfilerStep#{first}", f"ProfilerStep#{last}"} <= names
        assert [(s.op, s.line, s.count) for s in sites] == [("item", line_of("ITEM-LINE"), 2)]
    finally:
        job.terminate()
        job.wait(60)


def test_profile_refuses_a_recording_that_is_not_running(tmp_path):
    proc, out = record(tmp_path, "3")
    assert proc.returncode == 0
    asked = run_td("profile", str(out), "--steps", "2")
    assert asked.returncode != 0
    assert "not the recording of a running job" in asked.stderr


def test_the_size_cap_cuts_the_window(tmp_path):
    # A cap below one step's estimate: the window keeps its first step and says why.
    proc, out = record(
        tmp_path,
        "14",
        options=("--profile-steps", "5-8"),
        env={"TORCHDOCTOR_PROFILE_MAX_BYTES": "1000"},
    )
    assert proc.returncode == 0, proc.stderr
    with open_recording(out) as rec:
        (window,) = rec.profile_windows()
        profiled = [r["step"] for r in rec.steps() if r["profiled"]]
    assert (window.state, window.first_step, window.last_step) == ("cut", 5, 5)
    assert window.reason.startswith("window cut to steps 5-5")
    assert Path(window.trace_path).name == "rank0-steps5-5.pt.trace.json.gz"
    assert profiled == [4, 5, 6]
    with gzip.open(window.trace_path, "rt") as fh:
        names = {e.get("name", "") for e in json.load(fh)["traceEvents"]}
    assert "ProfilerStep#5" in names and "ProfilerStep#6" not in names


def test_sync_points_inside_the_optimizer_are_the_step_line(tmp_path):
    # Adam's step() calls item() on its step counts (foreach=False): the site is the job's
    # opt.step() line, never a frame of torch or of the agent (whose wrapper runs it).
    proc, out = record(tmp_path, "10", "--adam", options=("--profile-steps", "4-5"))
    assert proc.returncode == 0, proc.stderr
    with open_recording(out) as rec:
        (window,) = rec.profile_windows()
        sites = rec.profile_sync_sites(window.id)
    assert all(Path(s.file) == JOB for s in sites), sites
    lines = {(s.op, s.line): s.count for s in sites}
    assert lines[("item", line_of("ITEM-LINE"))] == 2
    assert lines[("item", line_of("STEP-LINE"))] >= 2


def test_a_job_ending_before_the_window_says_so(tmp_path):
    proc, out = record(tmp_path, "6", options=("--profile-steps", "10-12"))
    assert proc.returncode == 0, proc.stderr
    with open_recording(out) as rec:
        (window,) = rec.profile_windows()
        assert not any(r["profiled"] for r in rec.steps())
    assert window.state == "failed"
    assert window.reason == "the process ended at step 6, before the window's warm-up"
