"""Figures of one trial, read from its recording: throughput after warm-up, the settings the
job ran with, its memory peak and whether the host swapped."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torchdoctor.recording.reader import Recording
from torchdoctor.recording.steps import decode_json, step_samples, step_wait_s, warmup_steps
from torchdoctor.tune.space import Config

BLOCKS = 4  # the measured window is cut into this many blocks to see the spread within a run


def trial_warmup(config: Config | None) -> int:
    """Steps left out at the start of a trial run with ``config`` (the one warm-up rule,
    :func:`torchdoctor.recording.steps.warmup_steps`, for its DataLoader workers)."""
    return warmup_steps(workers=config.num_workers if config is not None else 0)


@dataclass(slots=True)
class StepWindow:
    """Throughput over the steps after warm-up of the slowest training process."""

    steps: int
    warmup: int
    span_s: float
    steps_per_s: float
    samples_per_s: float | None
    spread: float | None  # relative standard error of the block rates
    data_wait_share: float | None
    # Each measured step's time, in order: what the verification's gain is computed from, with
    # compare's statistics (torchdoctor.compare.stats.speedup).
    step_s: list[float] = field(default_factory=list)


def step_window(steps: Iterable[Mapping[str, Any]], warmup: int) -> StepWindow | None:
    """The measured window of ``steps`` (rows of the steps table), None with too few steps.

    With several training processes (ranks) the slowest one sets the pace of the job.
    """
    by_pid: dict[int, list[Mapping[str, Any]]] = defaultdict(list)
    for row in steps:
        by_pid[row["pid"]].append(row)
    windows = [w for rows in by_pid.values() if (w := _window(rows, warmup)) is not None]
    if not windows:
        return None
    return min(windows, key=lambda w: w.steps_per_s)


def _window(rows: list[Mapping[str, Any]], warmup: int) -> StepWindow | None:
    rows = sorted(rows, key=lambda r: r["step"])
    if len(rows) < warmup + 2:
        return None
    start = rows[warmup - 1]["t_end"] if warmup > 0 else rows[0]["t_start"]
    measured = rows[warmup:]
    span = measured[-1]["t_end"] - start
    if span <= 0:
        return None
    n = len(measured)
    samples = [step_samples(r) for r in measured]
    samples_per_s = sum(samples) / span if all(s for s in samples) else None
    wall = sum(r["wall_s"] for r in measured)
    wait = sum(step_wait_s(r) for r in measured)
    return StepWindow(
        steps=n,
        warmup=warmup,
        span_s=span,
        steps_per_s=n / span,
        samples_per_s=samples_per_s,
        spread=_block_spread(measured, start),
        data_wait_share=wait / wall if wall > 0 else None,
        step_s=[float(r["wall_s"]) for r in measured],
    )


def _block_spread(measured: list[dict[str, Any]], start: float) -> float | None:
    """Relative standard error of the step rate, from the rates of consecutive blocks."""
    size = len(measured) // BLOCKS
    if size < 2:
        return None
    rates = []
    t0 = start
    for b in range(BLOCKS):
        block = measured[b * size : (b + 1) * size]
        t1 = block[-1]["t_end"]
        if t1 <= t0:
            return None
        rates.append(len(block) / (t1 - t0))
        t0 = t1
    mean = statistics.fmean(rates)
    return statistics.stdev(rates) / mean / math.sqrt(len(rates))


@dataclass(slots=True)
class ObservedJob:
    """What the job itself reported about its settings in a trial."""

    config: Config | None  # None: the job took no optimizer step
    has_loader: bool  # False: no DataLoader, only the threads can be tuned
    devices: list[str]
    epochs_seen: int  # epoch starts of the first DataLoader (1: the trial never left epoch 1)
    threads_set_in_script: bool  # torch.set_num_threads called by the script itself
    overrides_applied: bool


def observed_job(rec: Recording) -> ObservedJob:
    """The first training DataLoader's settings and the trainer's threads, as recorded."""
    trainer_pids = {pid for (pid,) in rec.iter_query("SELECT DISTINCT pid FROM steps")}
    loaders = [r for r in rec.rows("dataloaders") if r["pid"] in trainer_pids]
    settings: dict[str, Any] = {}
    for r in rec.rows("settings"):
        if r["pid"] in trainer_pids:
            settings.setdefault(r["key"], decode_json(r["value"]))
    events = rec.rows("events")
    epochs = defaultdict(int)
    threads_in_script = False
    applied = False
    for e in events:
        if e["pid"] not in trainer_pids:
            continue
        detail = decode_json(e["detail"]) or {}
        if e["kind"] == "epoch-start":
            epochs[detail.get("loader_id")] += 1
        elif e["kind"] == "override-applied":
            applied = True
            if "requested" in detail:
                threads_in_script = True
    config = None
    threads = settings.get("torch.num_threads")
    epochs_seen = max(epochs.values(), default=0)
    if loaders and isinstance(threads, int):
        first = min(loaders, key=lambda r: (r["t"], r["loader_id"]))
        config = Config(
            num_workers=int(first["num_workers"]),
            num_threads=threads,
            prefetch_factor=first["prefetch_factor"],
            persistent_workers=bool(first["persistent_workers"]),
            pin_memory=bool(first["pin_memory"]),
        ).normalized()
        epochs_seen = epochs.get(first["loader_id"], 0)
    elif isinstance(threads, int):
        config = Config(num_workers=0, num_threads=threads)  # data made in the loop itself
    devices = settings.get("params.devices") or []
    return ObservedJob(
        config, bool(loaders), list(devices), epochs_seen, threads_in_script, applied
    )


def memory_peak(rec: Recording) -> int | None:
    """Highest memory the job held at one sample: PSS summed over its processes (shared
    pages counted once), RSS for a process whose PSS is unknown."""
    # Summed in SQL, per sampling instant: no Python object per row of a long recording.
    ((peak,),) = rec.iter_query(
        "SELECT MAX(held) FROM (SELECT SUM(COALESCE(pss, rss)) AS held FROM process_samples"
        " GROUP BY t)"
    )
    return int(peak) if peak is not None else None


def snapshot_memory(processes) -> int:
    """The same figure for one live snapshot's ProcessSample list."""
    return sum(p.pss if p.pss is not None else p.rss for p in processes)
