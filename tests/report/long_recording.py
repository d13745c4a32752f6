"""A long recording written in seconds: a few real snapshots through RecordingWriter (schema,
metadata, process table), then the bulk of the samples inserted by SQLite itself from a
recursive counter, so a test can read hours of a 20-process job without spending minutes
writing it in Python."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from report_recordings import CPUS, GIB, T0, host_info

from torchdoctor.recording.writer import RecordingWriter
from torchdoctor.sampling.types import ProcessInfo, Snapshot

INTERVAL = 0.5
TRAINER = 5000
SPIKE_AT = 0.37  # where in the run (share of its length) the one-sample peaks are


def write_long_recording(path: Path, samples: int, workers: int = 19, steps: bool = True) -> Path:
    """``samples`` sampling instants of a trainer and ``workers`` DataLoader workers: rows of
    process samples are ``samples * (workers + 1)``. One GPU, a step every 1.5 s, and at
    SPIKE_AT one-sample peaks of swap-out, job CPU and trainer RSS that the charts must keep."""
    meta = {
        "mode": "run",
        "command": ["python", "train.py"],
        "started_at": T0,
        "interval_s": INTERVAL,
        "instrumented": steps,
        "host": host_info(),
        "gpus": {"available": True, "gpus": [{"index": 0, "name": "GPU", "memory_total": GIB}]},
    }
    infos = [ProcessInfo(TRAINER, 1, T0 - 1.0, "python", ["python"], "trainer", None)] + [
        ProcessInfo(TRAINER + 1 + i, TRAINER, T0, "python", [], "dataloader-worker", None)
        for i in range(workers)
    ]
    writer = RecordingWriter(path, meta, flush_every_s=3600)
    writer.write_snapshot(
        Snapshot(t=T0, host=None, processes=[], gpus=[], gpu_processes=[], new_processes=infos)
    )
    writer.close({"ended_at": T0 + samples * INTERVAL, "exit_status": 0})
    spike = int(samples * SPIKE_AT)
    db = sqlite3.connect(path)
    with db:
        db.execute(f"CREATE TEMP TABLE k AS {_counter(samples)}")
        db.execute(
            "INSERT INTO host_samples (t, cpu_busy, cpu_iowait, mem_total, mem_used, swap_used,"
            " swap_in_per_s, swap_out_per_s, disk_read_per_s, disk_write_per_s, per_core)"
            f" SELECT {T0} + i * {INTERVAL}, 40.0 + (i % 37), 1.0 + (i % 5) * 0.5, {64 * GIB},"
            f" {20 * GIB} + i * 1000, 0, 0.0, CASE WHEN i = {spike} THEN 9e7 ELSE 0.0 END,"
            " 1e6 + (i % 11) * 1e5, 2e6,"
            f" '[' || substr(replace(hex(zeroblob({CPUS})), '00', ',[40,0,10,49,1,0,0,0]'), 2)"
            " || ']' FROM k"
        )
        db.execute(
            "INSERT INTO process_samples (t, pid, ppid, create_time, name, role, rank, cpu_percent,"
            " cpu_user_s, cpu_system_s, rss, pss, uss, swap, threads, read_bytes_per_s)"
            f" SELECT {T0} + i * {INTERVAL}, p.pid, p.ppid, p.create_time, 'python', p.role, NULL,"
            f" CASE WHEN i = {spike} AND p.role = 'trainer' THEN 1500.0 ELSE 50.0 + (i % 13) END,"
            f" i * 0.4, i * 0.05,"
            f" CASE WHEN i = {spike} AND p.role = 'trainer' THEN {40 * GIB} ELSE {GIB} + i END,"
            f" {GIB // 2} + (i % 7), {GIB // 4}, 0, 8, 1e6"
            " FROM k, processes AS p ORDER BY i, p.rowid"
        )
        db.execute(
            'INSERT INTO gpu_samples (t, "index", uuid, utilization_gpu, memory_used,'
            f" memory_total) SELECT {T0} + i * {INTERVAL}, 0, 'GPU-0', 30.0 + (i % 50),"
            f" {GIB // 2} + (i % 100) * 1000, {GIB} FROM k"
        )
        db.execute(
            "INSERT INTO gpu_process_samples (t, gpu_index, pid, used_memory, in_job)"
            f" SELECT {T0} + i * {INTERVAL}, 0, {TRAINER}, {GIB // 3}, 1 FROM k"
        )
        if steps:
            db.execute(
                "INSERT INTO steps (pid, rank, step, t_start, t_end, wall_s, data_wait_s,"
                f" batch_size, samples) SELECT {TRAINER}, NULL, i, {T0} + 2 + i * 1.5,"
                f" {T0} + 3.5 + i * 1.5, 1.5, 0.2 + (i % 9) * 0.01, 64, 64"
                f" FROM k WHERE i < {int(samples * INTERVAL / 1.5) - 2}"
            )
    db.close()
    return path


def _counter(n: int) -> str:
    return (
        f"WITH RECURSIVE c(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM c WHERE i + 1 < {n})"
        " SELECT i FROM c"
    )
