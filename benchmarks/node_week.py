"""A week of a 72-process node (8 ranks x 8 DataLoader workers): bytes, `diagnose`, `report`.

Built the way soak.py builds its 20-process week, from real snapshots of a real process tree:
a launcher, 8 ranks, 8 workers under each rank (72 job processes and the launcher: 73 rows a
sample), read 20 times by the sampler and replayed through the recording writer at the
default 0.5 s with a commit per second of run time, as the recorder commits:

  full     --hours of that job kept full (``--keep full``); its bytes per hour give the
           full week's size (linear: every sample is one row per process; soak's 20-process
           week grew linearly, 3 GB). The full 72-process week itself (about 11 GB) is not
           built here; its `diagnose` cost is soak's 20-process week row (the reader thins a
           long run to a bounded number of instants).
  compact  the same --hours written with compaction (the default: recording.compaction folds
           every 60 s older than 15 min, its passes run by the writer as it commits), then made
           a week by SQLite: the folded rows between the start-up and the recent window
           repeated, shifted in time, and the start-up and the recent window kept whole at the
           week's two ends: the file a writer holds after a week. Its bytes, and `diagnose` and
           `report` on it (peak RSS, wall time), are measured.

With --gpus N (default 8: the node of an LLM fine-tune) each sample also holds N GPUs, each
with one rank's process on it (NVML's device and per-process rows, as the GPU reader writes
them: busy 88-99 %, memory drifting within 2 GiB of 60 GiB), which the writer folds as it
folds the processes.

The 8 ranks step once a sample (0.5 s, DDP's lock-step), written with the samples: the
compacted week folds them too (step_summaries, a few rows a minute kept); its bytes with every
step row kept are the compacted week's with the kept-full replay's step bytes per hour instead.

Targets (issue 46): the week <= 200 MB; `diagnose` and `report` on it <= 256 MiB and <= 60 s.

    python benchmarks/node_week.py [--hours 1] [--days 7] [--runs 2] [--gpus 8]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from job_trees import node_job, running, snapshots
from scorecard import Scorecard
from soak import load, peak_rss_of
from torchdoctor.recording import RecordingWriter, open_recording
from torchdoctor.recording.compaction import (
    FOLDINGS,
    META_THROUGH,
    STEP_SUMMARIES,
    CompactionPolicy,
)
from torchdoctor.recording.records import StepRecord
from torchdoctor.sampling import roles
from torchdoctor.sampling.types import GpuProcessSample, GpuSample

MB = 1_000_000
MIB = 1 << 20
INTERVAL_S = 0.5
RANKS = 8
WORKERS = 8
BYTES_TARGET_MB = 200
RSS_TARGET_MIB = 256
TIME_TARGET_S = 60
STEP_S = 0.5  # each rank steps once a sample: DDP ranks in lock-step


def rank_pids(infos: list) -> list[int]:
    """The tree's ranks: its compute processes, else the launcher's children."""
    ranks = sorted(p.pid for p in infos if p.role in roles.COMPUTE)
    if len(ranks) != RANKS:
        root = min(infos, key=lambda p: p.create_time).pid
        ranks = sorted(p.pid for p in infos if p.ppid == root)
    return ranks


def rank_steps(ranks: list[int], i: int, t: float) -> list[StepRecord]:
    """The step each rank ends at ``t`` (its ``i``-th): walls spread +-5 %, a data wait of
    0-20 ms, DDP's figures on its sampled iterations (1-10, then every 100th)."""
    out = []
    for rank, pid in enumerate(ranks):
        u = ((i * 7919 + rank * 104729) % 1000) / 1000  # spread, the same on every run
        wall = STEP_S * (0.95 + 0.1 * u)
        sampled = i <= 10 or i % 100 == 0
        ddp = {"comm_s": 0.05, "comm_overlap_s": 0.04, "backward_compute_s": 0.2}
        out.append(
            StepRecord(
                pid, rank, i, t - wall, t, wall, 0.02 * u, 32, 32, **(ddp if sampled else {})
            )
        )
    return out


def gpu_rows(ranks: list[int], gpus: int, i: int, t: float) -> tuple[list, list]:
    """The ``i``-th sample of ``gpus`` devices, rank k's process on device k (k < gpus):
    NVML's device rows and per-process rows as the GPU reader writes them."""
    devices, procs = [], []
    for g in range(gpus):
        u = ((i * 6007 + g * 7919) % 1000) / 1000
        used = int((60 + 2 * u) * (1 << 30))
        devices.append(
            GpuSample(t, g, f"GPU-{g:08d}", 88 + 11 * u, 40 + 20 * u, used, 80 << 30,
                      300 + 100 * u, 400.0, 60 + 10 * u, 1410.0, [], 8e9 * u, 2e9 * u, 0, 0, [],
                      0)
        )  # fmt: skip
        if g < len(ranks):
            procs.append(GpuProcessSample(t, g, ranks[g], ranks[g], used - (500 << 20), True))
    return devices, procs


def node_snapshots(n: int) -> tuple[list, list]:
    """``n`` snapshots of a real 73-process tree (the launcher and its 72 processes)."""
    with running(node_job(RANKS, WORKERS)) as job:
        return snapshots(job.pid, n, 0.1)


def replay(
    path: Path,
    hours: float,
    snaps: list,
    infos: list,
    policy: CompactionPolicy | None,
    gpus: int = 0,
):
    t0 = time.time() - hours * 3600
    writer = RecordingWriter(
        path,
        {"command": ["node_week"], "started_at": t0, "interval_s": INTERVAL_S},
        flush_every_s=3600.0,  # flushed below: once per 2 samples (1 s of run time)
        compaction=policy,
    )
    n = int(hours * 3600 / INTERVAL_S)
    ranks = rank_pids(infos)
    started = time.monotonic()
    cpu = time.process_time()
    for i in range(n):
        snap = snaps[i % len(snaps)]
        t = t0 + (i + 1) * INTERVAL_S
        snap.t = t
        if snap.host is not None:
            snap.host.t = t
        for p in snap.processes:
            p.t = t
        snap.new_processes = [] if i else infos
        if gpus:
            snap.gpus, snap.gpu_processes = gpu_rows(ranks, gpus, i, t)
        writer.add_steps(rank_steps(ranks, i, t))
        writer.write_snapshot(snap)
        if i % 2 == 1:
            writer.flush()
    writer.close({"ended_at": t0 + n * INTERVAL_S + INTERVAL_S, "exit_status": 0})
    return n, time.monotonic() - started, time.process_time() - cpu


def extend_compacted(src: Path, out: Path, days: float) -> None:
    """The compacted recording ``src`` made ``days`` long as its writer would leave it: the
    folded block of whole summary periods after the start-up repeated after itself, and
    everything after that block (the rest of the folded part, the recent window kept whole)
    moved to the end."""
    shutil.copyfile(src, out)
    db = sqlite3.connect(out, isolation_level=None)
    try:
        meta = {k: json.loads(v) for k, v in db.execute("SELECT key, value FROM meta")}
        policy = CompactionPolicy.from_meta(meta["compaction"])
        assert policy is not None
        start = meta["started_at"]
        lo = start + policy.startup_s
        # whole summary periods, so the copies' periods line up with the originals'
        block = (meta[META_THROUGH] - lo) // policy.summary_s * policy.summary_s
        assert block > 0, "replay longer: nothing folded in whole summary periods"
        copies = int((days * 86400 - (meta["ended_at"] - start)) // block)
        extra = copies * block
        periods = int(round(block / policy.summary_s))
        db.execute("BEGIN")
        for table in ("host_samples", "process_samples", "gpu_samples", "gpu_process_samples"):
            cols = [row[1] for row in db.execute(f"PRAGMA table_info({table})")]
            names = ", ".join(f'"{c}"' for c in cols)
            db.execute(f"UPDATE {table} SET t = t + ? WHERE t >= ?", (extra, lo + block))
            shifted = ", ".join("t + ?" if c == "t" else f'"{c}"' for c in cols)
            for k in range(1, copies + 1):
                db.execute(
                    f"INSERT INTO {table} ({names}) SELECT {shifted} FROM {table}"
                    " WHERE t >= ? AND t < ?",
                    (k * block, lo, lo + block),
                )
        _extend_steps(db, policy, lo, block, copies)
        for folding in FOLDINGS:
            table = folding.summary
            cols = [row[1] for row in db.execute(f"PRAGMA table_info({table})")]
            names = ", ".join(f'"{c}"' for c in cols)
            db.execute(
                f"UPDATE {table} SET t_from = t_from + ?, t_to = t_to + ?, period = period + ?"
                " WHERE t_from >= ?",
                (extra, extra, copies * periods, lo + block),
            )
            shifted = ", ".join(
                "period + ?" if c == "period" else f'"{c}" + ?' if c in ("t_from", "t_to")
                else f'"{c}"'
                for c in cols
            )  # fmt: skip
            for k in range(1, copies + 1):
                db.execute(
                    f"INSERT INTO {table} ({names}) SELECT {shifted} FROM {table}"
                    " WHERE t_from >= ? AND t_from < ?",
                    (k * periods, k * block, k * block, lo, lo + block),
                )
        for key, value in (
            ("ended_at", meta["ended_at"] + extra),
            (META_THROUGH, meta[META_THROUGH] + extra),
        ):
            db.execute(
                "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, json.dumps(value))
            )
        db.execute("COMMIT")  # no VACUUM: the pages the replay's passes freed stay, as in a run
    finally:
        db.close()


def _extend_steps(
    db: sqlite3.Connection, policy: CompactionPolicy, lo: float, block: float, copies: int
) -> None:
    """The steps of the folded block (rows kept and step_summaries) repeated as the samples
    are, each copy's step numbers after the block's: shifted by the most steps a process took
    in the block, rows and folded (ranks_day's ranks step at their own pace)."""
    (numbers,) = db.execute(
        "SELECT COALESCE(MAX(n), 0) FROM (SELECT pid, SUM(c) AS n FROM ("
        " SELECT pid, COUNT(*) AS c FROM steps WHERE t_end >= ? AND t_end < ? GROUP BY pid"
        f" UNION ALL SELECT pid, SUM(n) FROM {STEP_SUMMARIES} WHERE t_from >= ? AND t_from < ?"
        " GROUP BY pid) GROUP BY pid)",
        (lo, lo + block, lo, lo + block),
    ).fetchone()
    buckets = int(round(block / policy.bucket_s))
    _repeat_block(db, "steps", "t_end", {"t_start": block, "t_end": block, "step": numbers},
                  lo, block, copies)  # fmt: skip
    _repeat_block(db, STEP_SUMMARIES, "t_from",
                  {"bucket": buckets, "t_from": block, "t_to": block}, lo, block, copies)  # fmt: skip


def _repeat_block(
    db: sqlite3.Connection,
    table: str,
    time_col: str,
    per_copy: dict[str, float],
    lo: float,
    block: float,
    copies: int,
) -> None:
    """Rows of ``table`` after the block moved past its ``copies`` copies, then the block's
    rows (``time_col`` in [lo, lo + block)) inserted ``copies`` times, copy k with each column
    of ``per_copy`` shifted by k times its value."""
    moved = ", ".join(f"{c} = {c} + ?" for c in per_copy)
    db.execute(
        f"UPDATE {table} SET {moved} WHERE {time_col} >= ?",
        (*(copies * v for v in per_copy.values()), lo + block),
    )
    cols = [row[1] for row in db.execute(f"PRAGMA table_info({table})")]
    names = ", ".join(f'"{c}"' for c in cols)
    shifted = ", ".join(f'"{c}" + ?' if c in per_copy else f'"{c}"' for c in cols)
    for k in range(1, copies + 1):
        db.execute(
            f"INSERT INTO {table} ({names}) SELECT {shifted} FROM {table}"
            f" WHERE {time_col} >= ? AND {time_col} < ?",
            (*(k * per_copy[c] for c in cols if c in per_copy), lo, lo + block),
        )


def step_bytes(path: Path) -> int:
    """Bytes the steps take in the file: their rows, index and summaries (SQLite's dbstat)."""
    db = sqlite3.connect(path)
    try:
        (size,) = db.execute(
            "SELECT COALESCE(SUM(pgsize), 0) FROM dbstat WHERE name IN (?, ?, ?)",
            ("steps", "steps_i0", STEP_SUMMARIES),
        ).fetchone()
        return size
    finally:
        db.close()


def table_bytes(path: Path) -> dict[str, int]:
    """Bytes per table in the file, its indexes counted with it (SQLite's dbstat)."""
    db = sqlite3.connect(path)
    try:
        tables = {name: tbl for name, tbl in db.execute("SELECT name, tbl_name FROM sqlite_master")}
        out: dict[str, int] = {}
        for name, size in db.execute("SELECT name, SUM(pgsize) FROM dbstat GROUP BY name"):
            table = tables.get(name, name)
            out[table] = out.get(table, 0) + size
        return out
    finally:
        db.close()


def best_of(runs: int, *args: str) -> tuple[int, float]:
    got = [peak_rss_of(*args) for _ in range(runs)]
    return max(p for p, _ in got), min(s for _, s in got)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hours", type=float, default=1.0, help="replayed run time (>= 0.5)")
    parser.add_argument("--days", type=float, default=7.0, help="the week's length")
    parser.add_argument("--runs", type=int, default=2, help="diagnose/report runs each")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs of the node (default 8)")
    args = parser.parse_args()
    card = Scorecard("node_week")
    policy = CompactionPolicy()
    print(f"load before: {load()}")
    snaps, infos = node_snapshots(20)
    procs = len(snaps[0].processes)
    print(f"a real node tree: {procs} processes a sample, {args.gpus} GPUs")
    with tempfile.TemporaryDirectory(prefix="td-node-") as tmp:
        folder = Path(tmp)
        sizes = {}
        cpu_s = {}
        for name, pol in (("full", None), ("compact", policy)):
            path = folder / f"{name}.sqlite"
            n, wall, cpu_s[name] = replay(path, args.hours, snaps, infos, pol, args.gpus)
            sizes[name] = path.stat().st_size
            with open_recording(path) as rec:
                rows = rec.count("process_samples")
            print(
                f"{name}: {args.hours:g} h = {n:,} samples, {rows:,} process rows,"
                f" {sizes[name] / MB:.1f} MB, written in {wall:.0f} s ({cpu_s[name]:.1f} s CPU)"
            )
        # What folding adds to the writer's CPU, per second of run time (the replay runs the
        # same rows through the same writer both ways; the difference is the passes)
        extra = (cpu_s["compact"] - cpu_s["full"]) / (args.hours * 3600)
        card.info(
            f"folding passes' CPU at {procs} processes, share of one core",
            f"{extra * 100:.2f} % ({cpu_s['compact']:.1f} s vs {cpu_s['full']:.1f} s of writer"
            f" CPU for {args.hours:g} h of run time; one pass per 60 s)",
        )
        week_s = args.days * 86400
        full_week = sizes["full"] / (args.hours * 3600) * week_s
        week = folder / "week.sqlite"
        extend_compacted(folder / "compact.sqlite", week, args.days)
        with open_recording(week) as rec:
            rows = rec.count("process_samples")
            spans = rec.summarised_spans()
            step_rows = rec.count("steps")
            stats = rec.step_stats()
        size = week.stat().st_size
        print(
            f"compacted week: {rows:,} process rows, {size / MB:.1f} MB,"
            f" {len(spans)} folded span(s); full week (extrapolated) {full_week / MB:,.0f} MB"
        )
        biggest = sorted(table_bytes(week).items(), key=lambda kv: -kv[1])[:6]
        print("  by table: " + ", ".join(f"{name} {size / MB:.1f} MB" for name, size in biggest))
        # Every step kept (no step folding): the kept-full replay's step bytes per hour
        steps_full = step_bytes(folder / "full.sqlite") / (args.hours * 3600) * week_s
        steps_week = step_bytes(week)
        unfolded = size - steps_week + steps_full
        assert stats is not None
        print(
            f"steps of the week: {stats.step_count:,} ({RANKS} ranks at {STEP_S:g} s),"
            f" {step_rows:,} rows kept, {steps_week / MB:.1f} MB with their summaries;"
            f" every step kept: {steps_full / MB:.0f} MB (extrapolated)"
        )
        card.info(
            f"bytes of {args.days:g} days of the 72-process node job without step folding",
            f"{unfolded / MB:.0f} MB: every step row kept ({steps_full / MB:.0f} MB of steps,"
            f" from {args.hours:g} h kept full) beside the folded samples; folded:"
            f" {steps_week / MB:.1f} MB of steps ({step_rows:,} rows kept of"
            f" {stats.step_count:,}, median step {stats.median_step_s:.3f} s)",
        )
        card.check(
            f"bytes of {args.days:g} days of the 72-process node job ({procs} processes a sample)",
            size / MB,
            f"{size / MB:.0f} MB compacted, {args.gpus} GPUs (kept full: {full_week / MB:,.0f} MB,"
            f" from {args.hours:g} h x {week_s / (args.hours * 3600):.0f}; x{full_week / size:.0f})",
            at_most=BYTES_TARGET_MB,
            target=f"<= {BYTES_TARGET_MB} MB",
        )
        # What the measured runs below found (they print nothing): the findings, and any rule
        # that failed on the folded week
        said = subprocess.run(
            [sys.executable, "-m", "torchdoctor", "diagnose", "--json", str(week)],
            capture_output=True,
            text=True,
        )
        try:
            ids = [f["id"] for f in json.loads(said.stdout)["findings"]]
        except (ValueError, KeyError, TypeError):
            ids = [f"unreadable output, exit {said.returncode}"]
        print(
            f"diagnose on the week found {ids or 'nothing'}; stderr: {said.stderr.strip() or '-'}"
        )
        for command in ("diagnose", "report"):
            extra = ["-o", str(folder / "week.html")] if command == "report" else []
            peak, seconds = best_of(args.runs, command, str(week), *extra)
            fpeak, fseconds = best_of(
                1,
                command,
                str(folder / "full.sqlite"),
                *(["-o", str(folder / "f.html")] if extra else []),
            )
            print(
                f"`torchdoctor {command}`: compacted week {seconds:.1f} s, {peak / MIB:.0f} MiB;"
                f" the {args.hours:g} h kept full {fseconds:.1f} s, {fpeak / MIB:.0f} MiB"
            )
            card.check(
                f"`torchdoctor {command}` on {args.days:g} days of the 72-process node job, peak RSS",
                peak / MIB,
                f"{peak / MIB:.0f} MiB compacted ({args.hours:g} h kept full: {fpeak / MIB:.0f} MiB)",
                at_most=RSS_TARGET_MIB,
                target=f"<= {RSS_TARGET_MIB} MiB",
            )
            card.check(
                f"`torchdoctor {command}` on {args.days:g} days of the 72-process node job, wall time",
                seconds,
                f"{seconds:.1f} s compacted ({args.hours:g} h kept full: {fseconds:.1f} s; load {load()})",
                at_most=TIME_TARGET_S,
                target=f"<= {TIME_TARGET_S} s",
            )
    print(f"load after: {load()}")
    return card.exit_code()


if __name__ == "__main__":
    sys.exit(main())
