"""The job's Prometheus counters from a recording: monotonic while processes come, go and
change role; recordings made before the raw counters existed still read."""

from __future__ import annotations

import dataclasses
import sqlite3
from pathlib import Path

from tests.top.builders import host, proc
from torchdoctor import open_recording
from torchdoctor.exporters.jobstate import JobState
from torchdoctor.exporters.metrics import Families, add_host, add_job
from torchdoctor.recording import RecordingWriter
from torchdoctor.recording.tail import RecordingTail
from torchdoctor.sampling.types import Snapshot

T = 1_796_000_000.0


def _sample(t, pid, role, cpu_user, read=None):
    p = proc(pid, 1, role=role)
    return dataclasses.replace(
        p, t=t, create_time=T - pid, cpu_user_s=cpu_user, cpu_system_s=0.0, read_bytes=read
    )


def _write(writer: RecordingWriter, t: float, *procs) -> None:
    writer.write_snapshot(
        Snapshot(t=t, host=None, processes=list(procs), gpus=[], gpu_processes=[])
    )
    writer.flush()


def _cpu(state: JobState) -> dict[str, float]:
    return {role: tot.cpu_user_s for role, tot in state.totals.items()}


def test_an_exited_worker_keeps_its_cpu_in_the_job_total(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite"
    writer = RecordingWriter(path, {"started_at": T})
    state = JobState(RecordingTail(path))
    _write(
        writer,
        T + 1,
        _sample(T + 1, 10, "trainer", 1.0),
        _sample(T + 1, 11, "dataloader-worker", 2.0, 100),
    )
    state.update()
    assert _cpu(state) == {"trainer": 1.0, "dataloader-worker": 2.0}
    assert state.now["dataloader-worker"].processes == 1
    # The worker exits; a new one starts from zero: the role's counter must not drop.
    _write(
        writer,
        T + 2,
        _sample(T + 2, 10, "trainer", 1.5),
        _sample(T + 2, 12, "dataloader-worker", 0.25, 50),
    )
    state.update()
    assert _cpu(state) == {"trainer": 1.5, "dataloader-worker": 2.25}
    assert state.totals["dataloader-worker"].read_bytes == 150
    assert state.now["dataloader-worker"].processes == 1
    # A process classified again (a child appeared) brings no past usage to its new role.
    _write(writer, T + 3, _sample(T + 3, 10, "launcher", 1.75))
    state.update()
    assert _cpu(state) == {"trainer": 1.5, "dataloader-worker": 2.25, "launcher": 0.25}
    assert "dataloader-worker" not in state.now
    f = Families()
    add_job(f, state, None)
    by_name = {m.name: m for m in f}
    workers = [
        s.value
        for s in by_name["torchdoctor_job_cpu_seconds"].samples
        if s.labels["role"] == "dataloader-worker" and s.labels["mode"] == "user"
    ]
    assert workers == [2.25]
    gone = [
        s.value
        for s in by_name["torchdoctor_job_processes"].samples
        if s.labels["role"] == "dataloader-worker"
    ]
    assert gone == [0]  # exported as 0, not left missing
    writer.close()


def test_a_recording_without_the_raw_counters_still_reads(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    writer = RecordingWriter(path, {"started_at": T})
    writer.write_snapshot(
        Snapshot(t=T, host=host(), processes=[_sample(T, 10, "trainer", 1.0, 7)], gpus=[],
                 gpu_processes=[])
    )  # fmt: skip
    writer.close()
    # What a recording written before these columns existed looks like.
    db = sqlite3.connect(path)
    for table, column in (("process_samples", "read_bytes"), ("host_samples", "swap_in_bytes")):
        db.execute(f'ALTER TABLE {table} DROP COLUMN "{column}"')
    db.execute("DELETE FROM meta WHERE key = 'totals'")  # written by later versions too
    db.commit()
    db.close()
    with open_recording(path) as rec:
        (row,) = rec.rows("process_samples")
        assert row["read_bytes"] is None and row["cpu_user_s"] == 1.0
        assert next(rec.iter_rows("host_samples"))["swap_in_bytes"] is None
    state = JobState(RecordingTail(path))
    state.update()
    assert state.totals["trainer"].read_bytes == 0 and not state.totals["trainer"].io_known
    f = Families()
    add_job(f, state, None)
    add_host(f, state.host)
    names = {m.name for m in f}
    assert "torchdoctor_job_read_bytes" not in names  # not measured: no series, not a zero
    assert "torchdoctor_host_swap_in_bytes" not in names
    assert "torchdoctor_host_memory_total_bytes" in names
