"""`torchdoctor run --tensorboard`: scalars written while the job runs, equal to the recording,
and the same series from `export --format tensorboard` afterwards. Needs no Prometheus."""

from __future__ import annotations

import sqlite3
import subprocess

import pytest

from tests.conftest import TORCHDOCTOR
from tests.exporters.jobs import StoppableJob, run_with_tensorboard
from tests.exporters.prom import wait_for


@pytest.fixture
def live(tmp_path):
    job = run_with_tensorboard(tmp_path, tmp_path / "tb")
    try:
        yield job
    finally:
        job.ensure_stopped()


def test_tensorboard_scalars_match_the_recording(live: StoppableJob) -> None:
    import numpy as np
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logdir = live.tensorboard / live.recording.stem

    def scalars_while_running():
        assert live.proc.poll() is None
        if not logdir.is_dir():  # made with the first scalars
            return False
        acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
        acc.Reload()
        return "step/time_seconds" in acc.Tags()["scalars"]

    # Written during the run, not only at the end.
    wait_for("TensorBoard scalars during the run", scalars_while_running, every_s=1.0)
    live.finish()
    assert live.returncode == 0, live.stderr
    assert "epochs" in live.stdout

    (event_file,) = logdir.glob("*tfevents*")
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"step/time_seconds", "step/data_wait_ratio", "step/samples_per_second",
            "job/cpu_cores", "job/pss_bytes", "host/iowait_ratio",
            "host/swap_used_bytes"} <= tags  # fmt: skip
    for tag in tags:
        steps = [e.step for e in acc.Scalars(tag)]
        assert steps == sorted(steps), f"{tag}: steps go backwards"

    db = sqlite3.connect(live.recording)
    walls = [r[0] for r in db.execute("SELECT wall_s FROM steps ORDER BY rowid")]
    points = acc.Scalars("step/time_seconds")
    assert [p.step for p in points] == list(range(len(walls)))
    assert np.array_equal(
        np.array([p.value for p in points], np.float32), np.array(walls, np.float32)
    )
    waits = [
        r[0] / r[1] for r in db.execute("SELECT data_wait_s, wall_s FROM steps ORDER BY rowid")
    ]
    assert np.allclose([p.value for p in acc.Scalars("step/data_wait_ratio")], waits, rtol=1e-6)

    # PSS: per sample, every live process counted with its latest PSS reading.
    latest: dict[tuple, int] = {}
    expected: dict[float, int] = {}
    for t, pid, ct, pss in db.execute(
        "SELECT t, pid, create_time, pss FROM process_samples ORDER BY rowid"
    ):
        if pss is not None:
            latest[(pid, ct)] = pss
        expected.setdefault(t, 0)
        expected[t] += latest.get((pid, ct), 0)
    got = {round(e.wall_time, 3): e.value for e in acc.Scalars("job/pss_bytes")}
    assert got
    for t, value in got.items():
        match = [v for tt, v in expected.items() if abs(tt - t) < 2e-3]
        assert match and np.float32(match[0]) == np.float32(value)
    swap = [r[0] for r in db.execute("SELECT swap_used FROM host_samples ORDER BY rowid")]
    assert np.array_equal(
        np.array([e.value for e in acc.Scalars("host/swap_used_bytes")], np.float32),
        np.array(swap, np.float32),
    )
    db.close()

    # The same recording exported afterwards gives the same series.
    out = live.tensorboard.parent / "exported"
    res = subprocess.run(
        [*TORCHDOCTOR, "export", str(live.recording), "--format", "tensorboard", "--out-dir", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    again = EventAccumulator(str(out / live.recording.stem), size_guidance={"scalars": 0})
    again.Reload()
    assert set(again.Tags()["scalars"]) == tags
    for tag in ("step/time_seconds", "job/pss_bytes", "host/iowait_ratio"):
        assert [(e.step, e.value) for e in again.Scalars(tag)] == [
            (e.step, e.value) for e in acc.Scalars(tag)
        ]
    assert event_file.name.startswith("events.out.tfevents.")
