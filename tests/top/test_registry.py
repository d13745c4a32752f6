"""The registry of recorded jobs, and what top shows of a job under `torchdoctor run`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import psutil
import pytest

from tests import fake_nvml
from tests.top.screen import show
from torchdoctor.recording import registry
from torchdoctor.recording.records import StepRecord
from torchdoctor.recording.writer import RecordingWriter
from torchdoctor.sampling.gpus import GpuReader
from torchdoctor.thresholds import Thresholds
from torchdoctor.top.collect import TopCollector
from torchdoctor.top.model import UiState, build_view
from torchdoctor.top.recordings import RecordingWatcher


def write_recording(path, pid, *, steps=20, wall=0.1, wait=0.04, end=None):
    """A real recording holding ``steps`` steps of ``pid`` that ended just before ``end``."""
    end = time.time() if end is None else end
    writer = RecordingWriter(path, {"command": ["python", "train.py"], "started_at": end - 60})
    writer.add_steps(
        StepRecord(
            pid=pid,
            rank=None,
            step=i,
            t_start=end - (steps - i) * wall,
            t_end=end - (steps - i - 1) * wall,
            wall_s=wall,
            data_wait_s=wait,
            batch_size=32,
            samples=32,
        )
        for i in range(steps)
    )
    writer.flush()
    return writer


def test_register_lists_then_prunes_an_exited_process(runtime_dir, tmp_path):
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        entry_file = registry.register(child.pid, tmp_path / "r.sqlite")
        assert entry_file.parent == runtime_dir / "torchdoctor"
        assert oct(entry_file.parent.stat().st_mode & 0o777) == "0o700"
        (entry,) = registry.active()
        assert entry.pid == child.pid
        assert entry.recording_path == (tmp_path / "r.sqlite").resolve()
    finally:
        child.stdin.close()
        child.wait()
    # The recorder died without unregistering: the stale entry goes away by itself.
    assert registry.active() == []
    assert not entry_file.exists()


def test_unregister_and_errors(runtime_dir, tmp_path):
    registry.register(os.getpid(), tmp_path / "r.sqlite")
    registry.unregister(os.getpid())
    registry.unregister(os.getpid())  # twice is fine
    assert registry.active() == []
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    with pytest.raises(ProcessLookupError):
        registry.register(child.pid, tmp_path / "r.sqlite")


def test_a_new_entry_for_the_same_pid_is_read_and_a_reused_pid_is_not_the_job(
    runtime_dir, tmp_path
):
    # The exporter lists the registry at every scrape and keeps what it read: a job that
    # announces itself again (a new recording) must be seen, not the entry as first read.
    registry.register(os.getpid(), tmp_path / "first.sqlite")
    (entry,) = registry.active()
    assert entry.recording_path.name == "first.sqlite"
    entry_file = registry.register(os.getpid(), tmp_path / "second.sqlite")
    (entry,) = registry.active()
    assert entry.recording_path.name == "second.sqlite"
    assert abs(entry.create_time - psutil.Process().create_time()) < 1.0
    # The same PID started at another time is another process: the entry is stale.
    data = json.loads(entry_file.read_text())
    data["create_time"] -= 3600
    replacement = entry_file.with_suffix(".new")  # written then renamed, as register() does
    replacement.write_text(json.dumps(data))
    os.replace(replacement, entry_file)
    assert registry.active() == []
    assert not entry_file.exists()


def test_a_folder_others_can_write_is_refused(runtime_dir):
    folder = runtime_dir / "torchdoctor"
    folder.mkdir()
    folder.chmod(0o777)
    with pytest.raises(PermissionError, match="not a private folder"):
        registry.active()


def test_watcher_gives_step_rate_and_data_wait_of_the_recent_window(tmp_path):
    now = time.time()
    # A job that stepped long ago, one that has not stepped yet, one stepping now: 50 steps
    # of 0.1 s, waiting 40 % of the time for data.
    write_recording(
        tmp_path / "old.sqlite", 4242, steps=10, wall=1.0, wait=0.0, end=now - 30
    ).close()
    RecordingWriter(tmp_path / "empty.sqlite", {"command": ["python", "train.py"]}).close()
    live = write_recording(tmp_path / "live.sqlite", 4242, steps=50, wall=0.1, wait=0.04, end=now)
    watcher = RecordingWatcher(Thresholds())
    try:
        status = watcher.status(tmp_path / "live.sqlite", now=now)
        assert status.steps == 50
        assert status.step_rate_per_s == pytest.approx(10.0, rel=0.05)
        assert status.samples_per_s == pytest.approx(320.0, rel=0.05)
        assert status.data_wait_share == pytest.approx(0.4, rel=0.01)
        stalled = watcher.status(tmp_path / "old.sqlite", now=now)
        assert stalled.steps == 10 and stalled.step_rate_per_s == 0.0
        assert stalled.stalled_s == pytest.approx(30.0, abs=0.5)
        # Steps of 20 s each, the last one just ended: slow, not stalled.
        write_recording(tmp_path / "slow.sqlite", 7, steps=3, wall=20.0, wait=15.0, end=now).close()
        slow = watcher.status(tmp_path / "slow.sqlite", now=now)
        assert slow.stalled_s is None
        assert slow.step_rate_per_s == pytest.approx(0.05, rel=0.05)
        assert slow.data_wait_share == pytest.approx(0.75, rel=0.01)
        empty = watcher.status(tmp_path / "empty.sqlite", now=now)
        assert "no step recorded yet" in empty.unavailable["steps"]
        missing = watcher.status(tmp_path / "nope.sqlite", now=now)
        assert "no such file" in missing.unavailable["steps"]
    finally:
        watcher.close()
        live.close()


def test_the_window_read_piecemeal_is_the_window_read_whole(tmp_path):
    """Each refresh reads only the steps appended since the last one: the figures are those of
    the window's steps read whole, as the recording grows, with late batches and old steps."""
    from torchdoctor.recording.steps import step_stats
    from torchdoctor.recording.tail import RecordingTail
    from torchdoctor.top.recordings import _STEP_COLUMNS

    now = time.time()
    path = tmp_path / "live.sqlite"
    writer = write_recording(path, 4242, steps=100, wall=0.1, wait=0.04, end=now)

    def steps(pid, first, n, wall, wait, start):
        writer.add_steps(
            StepRecord(
                pid=pid, rank=None, step=first + i, t_start=start + i * wall,
                t_end=start + (i + 1) * wall, wall_s=wall, data_wait_s=wait, batch_size=32,
            )
            for i in range(n)
        )  # fmt: skip
        writer.flush()

    watcher = RecordingWatcher(Thresholds())
    whole = RecordingTail(path)

    def check(at):
        status = watcher.status(path, now=at)
        rows = whole.recent_rows("steps", _STEP_COLUMNS, by="t_end", since=at - 10.0)
        assert watcher._watched[path].window == rows
        if len(rows) >= 4 and status.stalled_s is None:  # else the last steps, however old
            expected = step_stats(rows, [], [])
            assert status.step_rate_per_s == pytest.approx(expected.steps_per_s)
            shares = [r.data_wait_fraction for r in expected.per_rank]
            assert status.data_wait_share == pytest.approx(max(shares))
        return status

    try:
        first = check(now)
        assert first.step_rate_per_s == pytest.approx(10.0, rel=0.05)
        # The running totals, rewritten at every flush, are the exporter's: top skips them.
        from torchdoctor.recording.totals import TOTALS_KEY

        assert TOTALS_KEY in whole.refresh_meta()
        meta = watcher._watched[path].tail.refresh_meta()
        assert TOTALS_KEY not in meta and meta.keys() == whole.meta.keys() - {TOTALS_KEY}
        steps(4242, 100, 30, 0.2, 0.0, now)  # slower steps, no wait, up to now + 6
        late = check(now + 6)
        assert late.data_wait_share < 0.4
        # A second process's batch, ended before the first's last step, arrives late; and a
        # step that ended before the window is appended: counted, and not.
        steps(5151, 0, 40, 0.1, 0.05, now + 1)
        steps(6161, 0, 1, 0.5, 0.5, now - 20)
        both = check(now + 6)
        assert both.data_wait_share == pytest.approx(0.5, rel=0.05)  # the late batch's
        # Time passes with nothing new: steps leave the window, all of them in the end.
        check(now + 12)
        check(now + 15)
        assert check(now + 40).stalled_s == pytest.approx(34.0, abs=0.5)
        assert watcher._watched[path].window == []
    finally:
        whole.close()
        watcher.close()
        writer.close()


def test_a_job_under_torchdoctor_run_shows_step_rate_and_starvation(
    runtime_dir, tmp_path, torch_job
):
    writer = write_recording(tmp_path / "job.sqlite", torch_job.pid, steps=50, wall=0.1, wait=0.04)
    registry.register(torch_job.pid, tmp_path / "job.sqlite")
    collector = TopCollector(Thresholds(), gpu_reader=GpuReader(fake_nvml.scenario("no_driver")))
    try:
        readings = collector.read()
    finally:
        collector.close()
        writer.close()
        registry.unregister(torch_job.pid)
    (job,) = [j for j in readings.jobs if j.root_pid == torch_job.pid]
    assert job.recording is not None
    assert job.recording.path == str((tmp_path / "job.sqlite").resolve())
    screen = show(build_view(readings, Thresholds(), UiState()), height=200)
    line = screen.lines[screen.lines.index(screen.line_with(f"job {torch_job.pid}")) + 1]
    assert "10.0 step/s" in line and "data wait 40%" in line
    assert screen.colour_of("40%", after=f"job {torch_job.pid}") == "red"


def test_top_finds_a_real_recorded_job_and_shows_its_rate_and_finding(runtime_dir, tmp_path):
    """The whole path a user takes: `torchdoctor run` announces the job, top finds its live
    recording, reads its steps and diagnoses it, and the job's line says what holds it back."""
    from tests.conftest import REPO, TORCHDOCTOR

    path = tmp_path / "live.sqlite"
    run = subprocess.Popen(
        [*TORCHDOCTOR, "run", "--quiet", "--out", str(path), "--", sys.executable,
         str(REPO / "examples" / "scenarios" / "data_bound.py"), "--steps", "5000"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "XDG_RUNTIME_DIR": str(runtime_dir)},
    )  # fmt: skip
    collector = TopCollector(Thresholds(), gpu_reader=GpuReader(fake_nvml.scenario("no_driver")))
    job = None
    try:
        deadline = time.monotonic() + 240
        while True:
            assert run.poll() is None, run.stderr.read()
            assert time.monotonic() < deadline, f"top never showed the finding: {job}"
            readings = collector.read()
            mine = [j for j in readings.jobs if j.recording and j.recording.path == str(path)]
            job = mine[0] if mine else None
            if job and "dataloader-bound" in {f.id for f in job.recording.findings}:
                break
            time.sleep(0.5)  # top's own refresh pace: the recording grows between looks
        screen = show(build_view(readings, Thresholds(), UiState()), height=200)
    finally:
        collector.close()
        run.terminate()  # the recorder forwards it to the job and closes the recording
        run.wait(timeout=60)
    (entry,) = [e for e in registry.active() if e.recording_path == path] or [None]
    assert entry is None, "the recorder did not unregister the job when it ended"
    assert job.recording.steps > 0 and job.recording.step_rate_per_s > 0
    line = screen.lines[screen.lines.index(screen.line_with(f"job {job.root_pid}")) + 1]
    assert f"{job.recording.step_rate_per_s:.1f} step/s" in line
    assert f"data wait {100 * job.recording.data_wait_share:.0f}%" in line
    # The job's status is its worst finding: dataloader-bound, or on a machine that other
    # processes keep busy, the contention that comes first
    shown = [f for f in job.recording.findings if f.title[:30] in line]
    assert shown and shown[0].severity in ("warning", "critical"), (line, job.recording.findings)


def test_jobs_coming_and_going_by_the_hundred_leave_exactly_the_live_ones(runtime_dir, tmp_path):
    """Issue 46: a box where recorded jobs start and end by the hundred. Three rounds of 100
    real processes announced, then half of all running ended, half of those withdrawn by their
    recorder first and the others gone without a word (a recorder killed): after each round the
    registry lists exactly the jobs still running, each with its own recording, and holds no
    entry of an ended one; a reader pruning all along (top, the exporter) never drops a live
    one."""
    live: dict[int, subprocess.Popen] = {}
    stop = threading.Event()
    reader_errors: list[BaseException] = []

    def reader() -> None:
        while not stop.is_set():
            try:
                registry.active()
            except BaseException as exc:  # noqa: BLE001 - reported by the test below
                reader_errors.append(exc)
                return

    pruning = threading.Thread(target=reader)
    pruning.start()
    try:
        for round_ in range(3):
            for i in range(100):
                job = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
                registry.register(job.pid, tmp_path / f"{round_}-{i}.sqlite")
                live[job.pid] = job
            for n, pid in enumerate(list(live)[: len(live) // 2]):
                job = live.pop(pid)
                if n % 2:
                    registry.withdraw(pid)
                job.stdin.close()  # cat exits at the end of its input
                job.wait()
            entries = registry.active()
            assert sorted(e.pid for e in entries) == sorted(live)
            for e in entries:
                assert e.recording_path.name.endswith(".sqlite")
                assert live[e.pid].poll() is None
            assert len({e.recording_path for e in entries}) == len(live)
            files = {p.name for p in (runtime_dir / "torchdoctor").iterdir()}
            assert files == {f"{pid}.json" for pid in live}
    finally:
        stop.set()
        pruning.join()
        for job in live.values():
            job.stdin.close()
            job.wait()
    assert reader_errors == []
    assert registry.active() == []
