"""Soak: does the recorder's memory stay flat, and how fast does a recording grow?

Two parts, a few minutes in all (benchmark only, never in the test suite):

  live    `torchdoctor run --interval 0.05` (20 samples/s, the fastest allowed, 40x the
          default rate) on a 20-process job for --duration seconds. The torchdoctor process
          (recorder, collector, writer) has its RSS and open descriptors read every second.
          Target: RSS growth <= 5 MiB after the first minute, descriptors flat.
  replay  24 h compressed into a minute or two: real snapshots of the same job, read once,
          are written through the recording writer as fast as it takes them, with times
          0.5 s apart (the default interval) and a commit per second of run time, as the
          recorder commits: 24 h of the 1-process job (172,800 samples) and 24 h of the
          20-process job (172,800 samples, 3.5 million process rows). This process' RSS, SQLite's own heap (sqlite3_memory_used) and
          descriptors are read along the way; then the end-of-run summary is computed on each
          file and its memory cost read. File sizes give the growth per hour.
  week    the replayed day of the 20-process job extended to --week-days (7) by SQLite itself,
          each further day a copy of the first shifted in time (24 million process rows,
          3 GB): `torchdoctor diagnose` and `torchdoctor report` run on the day and on the
          week, alternately, twice each. Targets: each <= 256 MiB peak RSS on the week, and
          the week's wall time <= 2x the day's (both read at a bounded resolution).

    python benchmarks/soak.py [--duration 150] [--replay-hours 24] [--day-hours 24]
                              [--steps-per-s 5] [--diagnose] [--week-days 7]

Memory figures are the kernel's (VmRSS); the first minute (imports, SQLite's page cache
filling to its bound, the WAL reaching its checkpoint size) is the baseline growth is
measured against.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

from job_trees import TRAINER_JOB, running, snapshots
from scorecard import Scorecard
from torchdoctor.recording import RecordingWriter, open_recording
from torchdoctor.recording.records import StepRecord
from torchdoctor.recording.summary import summarize

MIB = 1 << 20
DEFAULT_INTERVAL_S = 0.5
# `torchdoctor diagnose` (the end of every run, report, top) on the day-long 1-process file:
# 1,130 MiB when it read whole tables as dicts; the diagnosis must not need the memory of the
# job it diagnoses.
DIAGNOSE_TARGET_MIB = 256
REPORT_TARGET_MIB = 256  # `torchdoctor report` on the week, charts and diagnosis included
WEEK_TIME_RATIO = 2.0  # the week's wall time at most this many times the day's


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def load() -> str:
    with open("/proc/loadavg") as fh:
        return " ".join(fh.read().split()[:3])


def live(duration: float, folder: Path) -> dict:
    out = folder / "live.sqlite"
    run = subprocess.Popen(
        [sys.executable, "-m", "torchdoctor", "run", "--quiet", "--interval", "0.05",
         "--out", str(out), "--", sys.executable, "-c", TRAINER_JOB],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    readings: list[tuple[float, int, int]] = []
    try:
        assert run.stdout.readline() == "ready\n"
        start = time.monotonic()
        while time.monotonic() - start < duration:
            readings.append((time.monotonic() - start, rss(run.pid), fds(run.pid)))
            time.sleep(1.0)  # a fixed reading cadence, as a monitor would
    finally:
        run.stdin.close()
        status = run.wait(120)
    with open_recording(out) as rec:
        samples = rec.count("host_samples")
        rows = rec.count("process_samples")
    after = [r for r in readings if r[0] >= 60.0] or readings
    base = after[0]
    return {
        "status": status,
        "samples": samples,
        "process_rows": rows,
        "rate": samples / duration,
        "rss_start": readings[0][1],
        "rss_60": base[1],
        "rss_end": readings[-1][1],
        "rss_max_after_60": max(r[1] for r in after),
        "growth_after_60": max(r[1] for r in after) - base[1],
        "fds_after_60": (min(r[2] for r in after), max(r[2] for r in after)),
        "readings": readings,
    }


def sqlite_memory() -> int | None:
    """SQLite's own heap in this process (page caches included), from the loaded library."""
    import _sqlite3

    for name in (_sqlite3.__file__, ctypes.util.find_library("sqlite3")):
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name)
            lib.sqlite3_memory_used.restype = ctypes.c_int64
            return lib.sqlite3_memory_used()
        except (OSError, AttributeError):
            continue
    return None


def real_snapshots(n: int, only_root: bool) -> list:
    """``n`` snapshots of a real 20-process job (or of its root alone)."""
    with running(TRAINER_JOB) as job:
        snaps, infos = snapshots(job.pid, n, 0.05)
    if only_root:
        for s in snaps:
            s.processes = [p for p in s.processes if p.pid == job.pid]
        infos = [p for p in infos if p.pid == job.pid]
    return snaps, infos


def replay(
    hours: float, folder: Path, name: str, only_root: bool, diagnose: bool, steps_per_s: float = 0.0
) -> dict:
    snaps, infos = real_snapshots(20, only_root)
    out = folder / f"{name}.sqlite"
    t0 = time.time()
    writer = RecordingWriter(
        out,
        {"command": ["soak", name], "started_at": t0, "interval_s": DEFAULT_INTERVAL_S},
        flush_every_s=3600.0,  # flushing is driven below: once per 2 samples (1 s of run time)
    )
    n = int(hours * 3600 / DEFAULT_INTERVAL_S)
    me = os.getpid()
    trace: list[tuple[int, int, int | None, int]] = []
    every = max(1, n // 12)
    wall = time.monotonic()
    for i in range(n):
        snap = snaps[i % len(snaps)]
        t = t0 + i * DEFAULT_INTERVAL_S
        snap.t = t
        if snap.host is not None:
            snap.host.t = t
        for p in snap.processes:
            p.t = t
        snap.new_processes = [] if i else infos  # each process described once, at the start
        writer.write_snapshot(snap)
        if i % 2 == 1:
            writer.flush()
        if i % every == 0 or i == n - 1:
            trace.append((i, rss(me), sqlite_memory(), fds(me)))
    if steps_per_s > 0:
        write_steps(writer, snaps[0].processes[0].pid, t0, hours * 3600, steps_per_s)
    writer.close({"ended_at": t0 + n * DEFAULT_INTERVAL_S, "exit_status": 0})
    wall = time.monotonic() - wall
    size = out.stat().st_size
    before = rss(me)
    with open_recording(out) as rec:
        started = time.monotonic()
        summary = summarize(rec)
        summary_s = time.monotonic() - started
        rows = rec.count("process_samples")
    after = rss(me)
    return {
        "samples": n,
        "process_rows": rows,
        "processes": len(snaps[0].processes),
        "wall_s": wall,
        "size": size,
        "per_hour": size / hours,
        "trace": trace,
        "summary_rss": after - before,
        "summary_s": summary_s,
        "summary_samples": summary.samples,
        "show_peak": peak_rss_of("show", str(out))[0],
        # (peak RSS, seconds) of the diagnosis every run ends with, or None
        "diagnose": peak_rss_of("diagnose", str(out)) if diagnose else None,
    }


def write_steps(writer, pid: int, t0: float, seconds: float, per_s: float) -> None:
    """Back-to-back training steps of ``pid`` at ``per_s`` a second, a third of each spent
    waiting for data, with the CUDA figures a GPU job records."""
    wall = 1.0 / per_s
    batch: list[StepRecord] = []
    for i in range(int(seconds * per_s) - 1):
        t = t0 + 0.5 + i * wall
        batch.append(
            StepRecord(
                pid=pid, rank=None, step=i, t_start=t, t_end=t + wall, wall_s=wall,
                data_wait_s=wall / 3, batch_size=64, samples=64, cuda_allocated=6 << 30,
                cuda_reserved=7 << 30, cuda_max_allocated=6 << 30, forward_s=wall / 4,
                backward_s=wall / 3, optimizer_s=wall / 20,
            )
        )  # fmt: skip
        if len(batch) == 10_000:
            writer.add_steps(batch)
            writer.flush()
            batch = []
    writer.add_steps(batch)


def extend_to_days(day: Path, out: Path, days: int) -> None:
    """A copy of the recording ``day`` made ``days`` times as long: the sample tables' rows
    written again by SQLite, shifted by the recording's span each time, and the end moved."""
    import json
    import shutil
    import sqlite3

    shutil.copyfile(day, out)
    db = sqlite3.connect(out)
    try:
        meta = {k: json.loads(v) for k, v in db.execute("SELECT key, value FROM meta")}
        span = meta["ended_at"] - meta["started_at"]
        for table in ("host_samples", "process_samples", "gpu_samples", "gpu_process_samples"):
            cols = [row[1] for row in db.execute(f"PRAGMA table_info({table})")]
            names = ", ".join(f'"{c}"' for c in cols)
            shifted = ", ".join("t + ?" if c == "t" else f'"{c}"' for c in cols)
            (last,) = db.execute(f"SELECT MAX(rowid) FROM {table}").fetchone()
            for d in range(1, days):
                db.execute(
                    f"INSERT INTO {table} ({names}) SELECT {shifted} FROM {table} WHERE rowid <= ?",
                    (d * span, last or 0),
                )
            db.commit()
        db.execute(
            "INSERT OR REPLACE INTO meta (key, value) VALUES ('ended_at', ?)",
            (json.dumps(meta["started_at"] + days * span),),
        )
        db.commit()
    finally:
        db.close()


def week_vs_day(day: Path, days: int, folder: Path, card: Scorecard) -> None:
    """`torchdoctor diagnose` and `report` on the day and on the week made of it."""
    week = folder / "week.sqlite"
    started = time.monotonic()
    extend_to_days(day, week, days)
    with open_recording(week) as rec:
        rows = rec.count("process_samples")
    print(
        f"\nweek: the 20-process day extended to {days} days by SQLite in"
        f" {time.monotonic() - started:.0f} s: {rows:,} process rows,"
        f" {week.stat().st_size / MIB:,.0f} MiB"
    )
    for command, target in (("diagnose", DIAGNOSE_TARGET_MIB), ("report", REPORT_TARGET_MIB)):
        runs: dict[str, list[tuple[int, float]]] = {"day": [], "week": []}
        for _ in range(2):  # alternately, so a change in the machine's speed hits both
            for name, path in (("day", day), ("week", week)):
                extra = ["-o", str(folder / f"{name}.html")] if command == "report" else []
                runs[name].append(peak_rss_of(command, str(path), *extra))
        day_s = min(s for _, s in runs["day"])
        week_s = min(s for _, s in runs["week"])
        day_peak = max(p for p, _ in runs["day"])
        week_peak = max(p for p, _ in runs["week"])
        print(
            f"  `torchdoctor {command}`: day {day_s:.1f} s, {day_peak / MIB:.0f} MiB;"
            f" week {week_s:.1f} s, {week_peak / MIB:.0f} MiB (fastest of 2, highest peak)"
        )
        card.check(
            f"`torchdoctor {command}` on {days} days of the 20-process job, peak RSS",
            week_peak / MIB,
            f"{week_peak / MIB:.0f} MiB ({rows:,} process rows; the day: {day_peak / MIB:.0f} MiB)",
            at_most=target,
        )
        card.check(
            f"`torchdoctor {command}` on {days} days vs on 1 day, wall time",
            week_s / day_s,
            f"{week_s / day_s:.2f}x ({week_s:.1f} s vs {day_s:.1f} s)",
            at_most=WEEK_TIME_RATIO,
            target=f"<= {WEEK_TIME_RATIO:g}x",
        )


# `torchdoctor ARGS` that writes its own peak RSS (VmHWM, KiB) on the descriptor it is given
# as it exits: getrusage's ru_maxrss of a child also counts the memory of the process it was
# forked from (the kernel keeps the higher at exec), so a benchmark holding 450 MiB read as
# the peak of a diagnosis that took far less.
_PEAK = (
    "import atexit, os, runpy, sys\n"
    "fd = int(sys.argv.pop(1))\n"
    "def hwm():\n"
    "    with open('/proc/self/status') as f:\n"
    "        os.write(fd, next(x for x in f if x.startswith('VmHWM:')).split()[1].encode())\n"
    "atexit.register(hwm)\n"
    "sys.argv[0] = 'torchdoctor'\n"
    "runpy.run_module('torchdoctor', run_name='__main__')\n"
)


def peak_rss_of(*args: str, stdout: IO[str] | None = None) -> tuple[int, float]:
    """Peak RSS and wall time of `torchdoctor ARGS` run to completion (what the end of a
    run does); its output goes to ``stdout`` (a file), else nowhere."""
    started = time.monotonic()
    r, w = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-c", _PEAK, str(w), *args],
        stdout=stdout if stdout is not None else subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        pass_fds=(w,),
    )
    os.close(w)
    with os.fdopen(r, "rb") as fh:
        said = fh.read()
    proc.wait()
    seconds = time.monotonic() - started
    if not said:
        raise RuntimeError(f"`torchdoctor {args[0]}` exited {proc.returncode} before its peak")
    return int(said) * 1024, seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=150.0, help="live part, seconds")
    parser.add_argument(
        "--replay-hours", type=float, default=24.0, help="replayed run time of the 20-process job"
    )
    parser.add_argument(
        "--day-hours", type=float, default=24.0, help="replayed run time of the 1-process job"
    )
    parser.add_argument(
        "--steps-per-s",
        type=float,
        default=0.0,
        help="also record training steps of the 1-process job, this many a second",
    )
    parser.add_argument(
        "--diagnose",
        action="store_true",
        help="also diagnose the 20-process file (the 1-process file always is:"
        f" `torchdoctor diagnose` peak RSS target <= {DIAGNOSE_TARGET_MIB} MiB)",
    )
    parser.add_argument(
        "--week-days",
        type=int,
        default=7,
        help="extend the replayed 20-process day to this many days and diagnose and report"
        " both (0: skip; needs --replay-hours 24)",
    )
    args = parser.parse_args()
    card = Scorecard("soak")
    print(f"load before: {load()}")
    with tempfile.TemporaryDirectory(prefix="td-soak-") as tmp:
        folder = Path(tmp)
        lv = live(args.duration, folder) if args.duration > 0 else None
        if lv is None:
            print("live part skipped (--duration 0)")
        if lv is not None:
            print(
                f"\nlive: torchdoctor run --interval 0.05 on a 20-process job, {args.duration:.0f} s"
            )
            print(
                f"  {lv['samples']} samples ({lv['rate']:.1f}/s), {lv['process_rows']:,} process rows,"
                f" job exit {lv['status']}"
            )
            for t, r, f in lv["readings"][:: max(1, len(lv["readings"]) // 8)]:
                print(f"  t={t:5.0f} s  RSS {r / MIB:6.1f} MiB  fds {f}")
            lo, hi = lv["fds_after_60"]
            print(
                f"  RSS {lv['rss_start'] / MIB:.1f} MiB at start, {lv['rss_60'] / MIB:.1f} MiB at 60 s,"
                f" {lv['rss_end'] / MIB:.1f} MiB at the end; growth after the first minute"
                f" {lv['growth_after_60'] / MIB:.2f} MiB (target <= 5 MiB); fds {lo}-{hi}"
            )
            print(f"  load after live: {load()}")
        for label, hours, only_root in (
            ("1-process job", args.day_hours, True),
            ("20-process job", args.replay_hours, False),
        ):
            if hours <= 0:
                continue
            steps = args.steps_per_s if only_root else 0.0
            rp = replay(
                hours, folder, label.split()[0], only_root, only_root or args.diagnose, steps
            )
            print(
                f"\nreplay: {label}, {hours:g} h at the default 0.5 s = {rp['samples']:,} samples,"
                f" {rp['process_rows']:,} process rows, written in {rp['wall_s']:.0f} s"
            )
            for i, r, sq, f in rp["trace"][::2] + rp["trace"][-1:]:
                sq_text = "n/a" if sq is None else f"{sq / MIB:.2f} MiB"
                print(
                    f"  after {i * DEFAULT_INTERVAL_S / 3600:5.1f} h: RSS {r / MIB:6.1f} MiB,"
                    f" SQLite heap {sq_text}, fds {f}"
                )
            first = next((x for x in rp["trace"] if x[0] >= 7200), rp["trace"][0])
            grown = max(x[1] for x in rp["trace"] if x[0] >= first[0]) - first[1]
            print(f"  RSS growth after the first hour of run time: {grown / MIB:.2f} MiB")
            print(
                f"  file {rp['size'] / MIB:.1f} MiB: {rp['per_hour'] / MIB:.2f} MiB per hour of run"
                f" ({rp['size'] / rp['samples']:.0f} bytes per sample of {rp['processes']} processes)"
            )
            print(
                f"  end-of-run summary over the whole file: {rp['summary_s']:.1f} s,"
                f" RSS +{rp['summary_rss'] / MIB:.1f} MiB ({rp['summary_samples']:,} samples)"
            )
            line = f"  peak RSS of `torchdoctor show` on that file {rp['show_peak'] / MIB:.0f} MiB"
            print(line)
            if rp["diagnose"] is not None:
                peak, seconds = rp["diagnose"]
                text = f"{peak / MIB:.0f} MiB peak RSS, {seconds:.1f} s (load {load()})"
                figure = f"`torchdoctor diagnose` on {hours:g} h of the {label}"
                if steps:
                    figure += f" with {steps:g} steps/s"
                if only_root and hours >= 24 and not steps:
                    card.check(figure, peak / MIB, text, at_most=DIAGNOSE_TARGET_MIB)
                else:
                    card.info(figure, text)
        if args.week_days > 1 and args.replay_hours == 24:
            week_vs_day(folder / "20-process.sqlite", args.week_days, folder, card)
    print(f"\nload after: {load()}")
    return card.exit_code()


if __name__ == "__main__":
    sys.exit(main())
