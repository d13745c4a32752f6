"""Step figures of a recording: step time, data-wait share, throughput, per rank.

Pure functions over the rows of the ``steps``, ``dataloaders`` and ``settings`` tables (as
:meth:`Recording.rows` returns them). :class:`StepStats` is the one step summary of a recording:
``show``, ``diagnose`` (its rules and its ``--json``), ``report`` and ``top`` all print it, and the
exporters and tune count a step's data wait and samples with :func:`step_wait_s` and
:func:`step_samples`.

The definitions, once:

- a step's data wait is at most its wall time (:func:`step_wait_s`): a step cannot have waited
  longer than it lasted, and a wait measured across a boundary must not make a share above 100 %;
- a rank's rate is its measured steps over the sum of their wall times (evaluation between steps
  is not in those walls, see below);
- the job's ``steps_per_s`` is the steps of *one* rank per second: ranks step side by side (DDP
  keeps them in lock-step), so it is the mean of the ranks' rates, never their sum;
- the job's ``samples_per_s`` is the sum of the ranks' own rates: each rank consumes its own
  batches. It is None when one rank's batch size is unknown, rather than a guess;
- ``batch_size`` is the most common batch size of the measured steps (an epoch's short last batch
  does not hide it).

Warm-up rule: in every process, the first ``warmup_steps(n)`` of its ``n`` steps are left out
of the figures: ``max(1, min(5, n // 10))`` steps, i.e. at least the first step (it carries
worker start-up, lazy initialisation and the first allocations) and up to 10 % of the steps,
at most 5. A process with a single step keeps it. ``step_count`` still counts every step.

Profiled steps: the steps a profiler window touched (``profiled``: its warm-up step, its
active steps and the step its export stalled) are left out of every figure too, after the
warm-up rule; ``step_count`` still counts them.

Evaluation between steps is not in the step records (the agent takes it out of the step it falls
in and records it as ``evaluation`` events), so the rates are over the steps' own wall time:
time spent evaluating makes training look neither slower nor faster. :func:`evaluation_stats`
sums up those events.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from torchdoctor.sampling import roles

WARMUP_MIN_STEPS = 5  # a process's start-up: first iterations, allocator and caches warming


def warmup_steps(n: int | None = None, *, workers: int = 0) -> int:
    """Steps left out at the start of a process: its start-up, and the burst of batches its
    ``workers`` DataLoader workers made while it waited for its first one (one per worker).

    ``n``, the steps the process recorded, when known (a recording read afterwards): a short
    run keeps most of its steps, at most a tenth of them left out (at least one of two or
    more). Without ``n`` (tune, deciding before a trial how many steps to ask for): the whole
    warm-up, ``max(5, workers + 2)``.
    """
    full = max(WARMUP_MIN_STEPS, workers + 2)
    if n is None:
        return full
    if n <= 1:
        return 0
    return max(1, min(full, n // 10))


@dataclass(slots=True)
class RankStats:
    """The figures of one process that stepped (a rank, or the single trainer)."""

    pid: int
    rank: int | None
    step_count: int
    measured_steps: int
    median_step_s: float | None
    p90_step_s: float | None
    data_wait_fraction: float | None  # data wait / step wall time, over measured steps
    steps_per_s: float | None
    samples_per_s: float | None  # None when the batch size is unknown


@dataclass(slots=True)
class StepStats:
    """Whole-job figures; ``per_rank`` has one entry per process that stepped."""

    step_count: int
    measured_steps: int
    warmup_rule: str
    median_step_s: float | None
    p90_step_s: float | None
    data_wait_fraction: float | None  # data wait / step wall time, over all measured steps
    steps_per_s: float | None  # steps of one rank per second (the mean of the ranks' rates)
    samples_per_s: float | None  # all ranks together
    batch_size: int | None  # the most common batch size of the measured steps
    mean_step_s: float | None = None
    mean_data_wait_s: float | None = None
    median_data_wait_s: float | None = None
    p90_data_wait_s: float | None = None
    t_start: float | None = None  # the measured steps' time span (UNIX seconds)
    t_end: float | None = None
    per_rank: list[RankStats] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)  # the main process' settings
    dataloaders: list[dict[str, Any]] = field(default_factory=list)
    # What ended each step: "optimizer" (torch.optim's step), or "backward" (each top-level
    # backward pass, in loops that update their parameters without torch.optim).
    boundary: str = "optimizer"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


WARMUP_RULE = "first max(1, min(5, n // 10)) steps of each process excluded"


def quantile(values: list[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default) of ``values``; NaN when there are none."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    pos = (len(ordered) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def measured_steps(rows: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The steps of one process (in step order) that its figures count: past its warm-up
    (:func:`warmup_steps` of all its steps) and not touched by a profiler window."""
    return [r for r in rows[warmup_steps(len(rows)) :] if not r.get("profiled")]


def step_wait_s(row: dict[str, Any]) -> float:
    """A step's data wait in seconds, at most its wall time (see the module doc)."""
    return min(float(row.get("data_wait_s") or 0.0), float(row.get("wall_s") or 0.0))


def step_samples(row: dict[str, Any], fallback: int | None = None) -> int | None:
    """Samples a step consumed: what the agent counted, else its batch size, else ``fallback``
    (the DataLoader's batch size); None when none is known."""
    for n in (row.get("samples"), row.get("batch_size")):
        if n is not None:
            return n
    return fallback


def decode_json(value: Any) -> Any:
    """A setting or event detail as the recording stores it (JSON text) turned back into its
    value; text that is not JSON, and what is not text, comes back as it is."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


_LOADER_FLAGS = ("pin_memory", "persistent_workers", "drop_last")


def _loader_value(key: str, value: Any) -> Any:
    """SQLite gives flags back as 0/1: make them booleans again for JSON readers."""
    return bool(value) if key in _LOADER_FLAGS and value is not None else value


def _process_stats(
    pid: int, rows: list[Mapping[str, Any]], fallback_batch: int | None
) -> RankStats:
    rows = sorted(rows, key=lambda r: r["step"])
    measured = measured_steps(rows)
    walls = sorted(float(r["wall_s"]) for r in measured)
    total_wall = sum(walls)
    total_wait = sum(step_wait_s(r) for r in measured)
    # Steps follow each other: their walls add up to the time from the first one's start to
    # the last one's end, less the evaluations between them (not training).
    steps_per_s = len(measured) / total_wall if total_wall > 0 else None
    samples = 0
    known = True
    for r in measured:
        n = step_samples(r, fallback_batch)
        if n is None:
            known = False
            break
        samples += n
    samples_per_s = samples / total_wall if known and total_wall > 0 else None
    return RankStats(
        pid=pid,
        rank=rows[0].get("rank"),
        step_count=len(rows),
        measured_steps=len(measured),
        median_step_s=statistics.median(walls) if walls else None,
        p90_step_s=quantile(walls, 0.9) if walls else None,
        data_wait_fraction=(total_wait / total_wall) if total_wall > 0 else None,
        steps_per_s=steps_per_s,
        samples_per_s=samples_per_s,
    )


def step_stats(
    steps_rows: Iterable[Mapping[str, Any]],  # dict rows, or a Recording.frame's row views
    dataloader_rows: list[dict[str, Any]],
    settings_rows: list[dict[str, Any]],
) -> StepStats:
    """Summarise the step records of one recording (see the module doc for warm-up)."""
    by_pid: dict[int, list[Mapping[str, Any]]] = defaultdict(list)
    for row in steps_rows:
        by_pid[row["pid"]].append(row)
    loaders_by_pid: dict[int, list[dict]] = defaultdict(list)
    for row in dataloader_rows:
        loaders_by_pid[row["pid"]].append(row)

    per_rank = []
    for pid, rows in by_pid.items():
        sizes = {r["batch_size"] for r in loaders_by_pid.get(pid, []) if r.get("batch_size")}
        fallback = sizes.pop() if len(sizes) == 1 else None
        per_rank.append(_process_stats(pid, rows, fallback))
    per_rank.sort(key=lambda s: (s.rank is None, s.rank if s.rank is not None else 0, s.pid))

    main_pid = _main_pid(per_rank, settings_rows)
    settings = {
        row["key"]: decode_json(row["value"])
        for row in sorted(settings_rows, key=lambda r: r["t"])
        if row["pid"] == main_pid
    }
    dataloaders = [
        {k: _loader_value(k, v) for k, v in row.items() if k != "rank"}
        for row in dataloader_rows
        if main_pid is None or row["pid"] == main_pid
    ]

    measured_rows = []
    for rows in by_pid.values():
        measured_rows.extend(measured_steps(sorted(rows, key=lambda r: r["step"])))
    walls = [float(r["wall_s"]) for r in measured_rows]
    waits = [step_wait_s(r) for r in measured_rows]
    total_wall = sum(walls)
    rates = [s.steps_per_s for s in per_rank if s.steps_per_s is not None]
    samples = [s.samples_per_s for s in per_rank]
    batch_sizes = [r["batch_size"] for r in measured_rows if r.get("batch_size")]
    starts = [r["t_start"] for r in measured_rows if r.get("t_start") is not None]
    ends = [r["t_end"] for r in measured_rows if r.get("t_end") is not None]
    return StepStats(
        step_count=len(steps_rows),
        measured_steps=len(measured_rows),
        warmup_rule=WARMUP_RULE,
        median_step_s=statistics.median(walls) if walls else None,
        p90_step_s=quantile(walls, 0.9) if walls else None,
        data_wait_fraction=(sum(waits) / total_wall) if total_wall > 0 else None,
        steps_per_s=statistics.fmean(rates) if rates else None,
        samples_per_s=sum(samples) if samples and None not in samples else None,
        batch_size=statistics.mode(batch_sizes) if batch_sizes else None,
        mean_step_s=statistics.fmean(walls) if walls else None,
        mean_data_wait_s=statistics.fmean(waits) if waits else None,
        median_data_wait_s=statistics.median(waits) if waits else None,
        p90_data_wait_s=quantile(waits, 0.9) if waits else None,
        t_start=min(starts) if starts else None,
        t_end=max(ends) if ends else None,
        per_rank=per_rank,
        settings=settings,
        dataloaders=dataloaders,
        boundary=str(settings.get("steps.boundary") or "optimizer"),
    )


@dataclass(slots=True)
class EvaluationStats:
    """The evaluation passes between training steps (the agent's ``evaluation`` events).

    Ranks evaluate side by side: ``passes`` and ``seconds`` are those of the process that spent
    the longest evaluating, ``batches`` and ``samples`` are all processes' together.
    """

    passes: int
    seconds: float
    batches: int
    samples: int | None  # None when a batch's size was not known

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def evaluation_stats(event_rows: list[dict[str, Any]]) -> EvaluationStats | None:
    """Sum up the ``evaluation`` events of a recording; None when there was no evaluation."""
    seconds: dict[int, float] = defaultdict(float)
    passes: dict[int, int] = defaultdict(int)
    batches = samples = 0
    samples_known = True
    for row in event_rows:
        if row["kind"] != "evaluation":
            continue
        detail = decode_json(row["detail"])
        if not isinstance(detail, dict):
            continue
        pid = row["pid"]
        passes[pid] += 1
        seconds[pid] += float(detail.get("seconds") or 0.0)
        batches += int(detail.get("batches") or 0)
        if detail.get("samples") is None:
            samples_known = False
        else:
            samples += int(detail["samples"])
    if not passes:
        return None
    slowest = max(passes, key=lambda pid: seconds[pid])
    return EvaluationStats(
        passes=passes[slowest],
        seconds=seconds[slowest],
        batches=batches,
        samples=samples if samples_known else None,
    )


def _main_pid(per_rank: list[RankStats], settings_rows: list[dict]) -> int | None:
    """The process whose settings describe the job: rank 0 or the one that stepped most."""
    if per_rank:
        ranked = [s for s in per_rank if s.rank == 0]
        if ranked:
            return ranked[0].pid
        return max(per_rank, key=lambda s: s.step_count).pid
    trainers = [
        r["pid"]
        for r in settings_rows
        if r["key"] == "process.role" and decode_json(r["value"]) in roles.COMPUTE
    ]
    return trainers[0] if trainers else None
