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

Folded steps: a recording the writer compacted (recording.compaction) keeps, outside the
windows it keeps whole, an evenly spread few of each process's steps per bucket; the others
are summed in ``step_summaries`` rows (:class:`FoldedSteps`). Every figure adds them back:
``step_count``, ``measured_steps``, the rates, the means and the data-wait share are those of
every step; the medians and p90s come from the folded steps' histograms merged with the kept
rows (recording.step_histogram: within 1.09 %, one bin's width). Warm-up and profiled steps are
never folded, so the warm-up rule counts every step of the process and cuts the same rows.

Evaluation between steps is not in the step records (the agent takes it out of the step it falls
in and records it as ``evaluation`` events), so the rates are over the steps' own wall time:
time spent evaluating makes training look neither slower nor faster. :func:`evaluation_stats`
sums up those events.
"""

from __future__ import annotations

import json
import math
import statistics
from array import array
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from torchdoctor.recording import step_histogram
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


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default) of ``values``; NaN when there are none."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    pos = (len(ordered) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(slots=True)
class FoldedSteps:
    """The steps of one process whose rows the writer folded away (recording.compaction):
    what they add to its figures. Never warm-up or profiled steps: those rows are kept."""

    count: int = 0
    wall_s: float = 0.0
    data_wait_s: float = 0.0  # each step's at most its wall (step_wait_s)
    samples: int = 0  # of the steps whose samples or batch size was known
    samples_unknown: int = 0  # steps that knew neither (the DataLoader's batch size is used)
    wall_min_s: float | None = None
    wall_max_s: float | None = None
    walls: Counter[int] = field(default_factory=Counter)  # recording.step_histogram bins
    waits: Counter[int] = field(default_factory=Counter)
    cuda_max_allocated: int | None = None  # the highest of the steps' CUDA peaks
    cuda_reserved: int | None = None
    # (first end, last end, steps) of each bucket folded, in the order read
    spans: list[tuple[float, float, int]] = field(default_factory=list)

    def add(self, other: FoldedSteps) -> None:
        self.count += other.count
        self.wall_s += other.wall_s
        self.data_wait_s += other.data_wait_s
        self.samples += other.samples
        self.samples_unknown += other.samples_unknown
        self.wall_min_s = _least(self.wall_min_s, other.wall_min_s)
        if other.wall_max_s is not None:
            self.wall_max_s = max(self.wall_max_s or other.wall_max_s, other.wall_max_s)
        self.walls.update(other.walls)
        self.waits.update(other.waits)
        self.spans.extend(other.spans)
        for name in ("cuda_max_allocated", "cuda_reserved"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if theirs is not None and (mine is None or theirs > mine):
                setattr(self, name, theirs)


def _least(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


# The columns the step figures (StepStats) and the rank rules (diagnosis.ranks) read.
FIGURE_COLUMNS = (
    "step", "rank", "t_start", "t_end", "wall_s", "data_wait_s", "batch_size", "samples",
    "profiled", "forward_s", "backward_s", "optimizer_s", "comm_s", "comm_overlap_s",
    "backward_compute_s",
)  # fmt: skip
NAN = math.nan


def _doubles(values: Sequence[Any]) -> array:
    """A column as doubles, NaN for NULL (SQLite never stores NaN as a number). A text in
    it (only a damaged file holds one) raises TypeError."""
    try:
        return array("d", values)
    except TypeError:
        return array("d", (NAN if v is None else v for v in values))


class ProcessSteps:
    """The step rows of one process in step order, one array of doubles per column (NaN
    where NULL): what its figures are computed from without a Python object per row. A rank
    of a compacted day at 64 ms keeps 150,000 rows; as dicts that is over 100 MB a rank."""

    __slots__ = ("pid", "columns", "folded", "length")

    def __init__(self, pid: int, columns: dict[str, array], folded: FoldedSteps | None) -> None:
        self.pid = pid
        self.columns = columns
        self.folded = folded or FoldedSteps()
        self.length = len(columns["step"])
        if any(v != v for v in columns["step"]):
            raise TypeError("a step has no number")

    @classmethod
    def from_chunks(
        cls,
        pid: int,
        names: Sequence[str],
        chunks: Iterable[Sequence[tuple]],
        folded: FoldedSteps | None = None,
    ) -> ProcessSteps:
        """From rows as tuples of ``names`` (chunks of them, already in step order)."""
        columns = {n: array("d") for n in names}
        arrays = [columns[n] for n in names]
        for chunk in chunks:
            for col, values in zip(arrays, zip(*chunk, strict=True), strict=True):
                col.extend(_doubles(values))
        return cls(pid, columns, folded)

    @classmethod
    def from_rows(
        cls, pid: int, rows: Iterable[Mapping[str, Any]], folded: FoldedSteps | None = None
    ) -> ProcessSteps:
        """From the process's rows as dicts (or a frame's row views), in any order: sorted
        by step (a stable sort: rows of one step keep their order)."""
        ordered = sorted(rows, key=lambda r: r["step"])
        # Dict rows of one query share their keys: a column they lack is NULL throughout,
        # made whole at once (`top` reads ten columns of each job's last 10 s of steps, a
        # hundred jobs a second, and converting the other six a value at a time cost most).
        if ordered and isinstance(ordered[0], dict):
            names = [n for n in FIGURE_COLUMNS if n in ordered[0]]
        else:
            names = list(FIGURE_COLUMNS)
        columns = {n: _doubles([r.get(n) for r in ordered]) for n in names}
        for n in FIGURE_COLUMNS:
            if n not in columns:
                columns[n] = array("d", [NAN]) * len(ordered)
        return cls(pid, columns, folded)

    def __len__(self) -> int:
        return self.length

    @property
    def count(self) -> int:
        """Steps the process took: its rows and the folded ones."""
        return self.length + self.folded.count

    @property
    def rank(self) -> int | None:
        """The rank of its first row (None when that row has none)."""
        ranks = self.columns.get("rank")
        if not ranks or ranks[0] != ranks[0]:
            return None
        return int(ranks[0])

    def first_rank(self) -> int | None:
        """The first rank any of its rows names."""
        for v in self.columns.get("rank", ()):
            if v == v:
                return int(v)
        return None

    def measured(self) -> Sequence[int]:
        """Indices of the rows its figures count (:func:`measured_steps`)."""
        first = min(warmup_steps(self.count), self.length)
        profiled = self.columns.get("profiled")
        if profiled is None or not any(p == p != 0 for p in profiled):
            return range(first, self.length)
        # NaN (not profiled: NULL) compares unequal to itself
        return [i for i in range(first, self.length) if not (profiled[i] == profiled[i] != 0)]

    def take(self, indices: Sequence[int]) -> ProcessSteps:
        """The rows at ``indices`` (in that order), without the folded steps."""
        columns = {n: array("d", (col[i] for i in indices)) for n, col in self.columns.items()}
        return ProcessSteps(self.pid, columns, None)

    def values(self, name: str, indices: Iterable[int] | None = None) -> list[float]:
        """The column's measured values (not NULL) at ``indices`` (every row by default)."""
        col = self.columns[name]
        if indices is None:
            return [v for v in col if v == v]
        return [v for i in indices if (v := col[i]) == v]

    def row(self, i: int) -> dict[str, Any]:
        """Row ``i`` as a dict like ``Recording.rows`` gives (None for NULL), numbers that
        are whole as ints where the column is an integer one."""
        out: dict[str, Any] = {"pid": self.pid}
        for name, col in self.columns.items():
            v = col[i]
            out[name] = None if v != v else int(v) if name in _INTEGER_COLUMNS else v
        if out.get("profiled") is not None:
            out["profiled"] = bool(out["profiled"])
        return out


_INTEGER_COLUMNS = frozenset(("step", "rank", "batch_size", "samples", "profiled"))


def measured_steps(
    rows: list[Mapping[str, Any]], count: int | None = None
) -> list[Mapping[str, Any]]:
    """The steps of one process (in step order) that its figures count: past its warm-up
    (:func:`warmup_steps` of all its steps) and not touched by a profiler window.

    ``count``: the steps the process took, where compaction thinned its rows (the rows and
    :attr:`FoldedSteps.count`); its first steps are always kept, so the same rows are cut."""
    n = len(rows) if count is None else count
    return [r for r in rows[warmup_steps(n) :] if not r.get("profiled")]


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


def _quantiles(
    values: Sequence[float], folded: Counter[int] | None
) -> tuple[float | None, float | None]:
    """(median, p90) of ``values`` and the folded steps' histogram: exact where nothing was
    folded, else read from the histogram of both (within one bin, 1.09 %)."""
    if folded:
        counts = step_histogram.histogram(values)
        counts.update(folded)
        return step_histogram.quantile(counts, 0.5), step_histogram.quantile(counts, 0.9)
    if not values:
        return None, None
    return statistics.median(values), quantile(values, 0.9)


@dataclass(slots=True)
class _Measured:
    """The measured rows of one process, as the figures read them."""

    index: Sequence[int]
    walls: array
    waits: array  # each at most its wall (step_wait_s)
    wall_bins: Counter[int] | None = None  # the walls' histogram, where it was needed


def _measured(proc: ProcessSteps) -> _Measured:
    index = proc.measured()
    wall_col, wait_col = proc.columns["wall_s"], proc.columns["data_wait_s"]
    walls = array("d", (wall_col[i] for i in index))
    if any(w != w for w in walls):
        raise TypeError("a step has no wall time")
    # step_wait_s, over columns: a NULL wait (NaN) is none, and a wait is at most its wall
    waits = array("d", (wait_col[i] for i in index))
    for j, (wait, wall) in enumerate(zip(waits, walls, strict=True)):
        if not wait <= wall:
            waits[j] = 0.0 if wait != wait else wall
    return _Measured(index, walls, waits)


def _process_stats(proc: ProcessSteps, fallback_batch: int | None, m: _Measured) -> RankStats:
    folded = proc.folded
    total_wall = sum(m.walls) + folded.wall_s
    total_wait = sum(m.waits) + folded.data_wait_s
    count = len(m.index) + folded.count
    # Steps follow each other: their walls add up to the time from the first one's start to
    # the last one's end, less the evaluations between them (not training).
    steps_per_s = count / total_wall if total_wall > 0 else None
    samples = folded.samples
    known = not folded.samples_unknown or fallback_batch is not None
    samples += folded.samples_unknown * (fallback_batch or 0)
    if known:
        # step_samples, over columns: the samples counted, else the batch size, else the
        # DataLoader's
        own, size = proc.columns["samples"], proc.columns["batch_size"]
        for i in m.index:
            n = own[i]
            if n != n:
                n = size[i]
                if n != n:
                    if fallback_batch is None:
                        known = False
                        break
                    n = fallback_batch
            samples += int(n)
    samples_per_s = samples / total_wall if known and total_wall > 0 else None
    if folded.walls:  # read from the histogram of its rows' walls and the folded ones'
        counts = m.wall_bins = step_histogram.histogram(m.walls)
        counts = counts + folded.walls
        median = step_histogram.quantile(counts, 0.5)
        p90 = step_histogram.quantile(counts, 0.9)
    else:
        median, p90 = _quantiles(m.walls, None)
    return RankStats(
        pid=proc.pid,
        rank=proc.rank,
        step_count=proc.count,
        measured_steps=count,
        median_step_s=median,
        p90_step_s=p90,
        data_wait_fraction=(total_wait / total_wall) if total_wall > 0 else None,
        steps_per_s=steps_per_s,
        samples_per_s=samples_per_s,
    )


def step_stats(
    steps_rows: Iterable[Mapping[str, Any]],  # dict rows, or a Recording.frame's row views
    dataloader_rows: list[dict[str, Any]],
    settings_rows: list[dict[str, Any]],
    folded: Mapping[int, FoldedSteps] | None = None,
) -> StepStats:
    """Summarise the step records of one recording (see the module doc for warm-up);
    ``folded``: per pid, the steps compaction left out of ``steps_rows``."""
    folded = folded or {}
    by_pid: dict[int, list[Mapping[str, Any]]] = defaultdict(list)
    for row in steps_rows:
        by_pid[row["pid"]].append(row)
    processes = (ProcessSteps.from_rows(pid, rows, folded.get(pid)) for pid, rows in by_pid.items())
    return process_step_stats(processes, dataloader_rows, settings_rows)


def process_step_stats(
    processes: Iterable[ProcessSteps],
    dataloader_rows: list[dict[str, Any]],
    settings_rows: list[dict[str, Any]],
) -> StepStats:
    """:func:`step_stats` over the processes' steps given one process at a time (as
    ``Recording.process_steps`` reads them): what it keeps of each is its figures, so a long
    recording costs one process's columns at a time."""
    loaders_by_pid: dict[int, list[dict]] = defaultdict(list)
    for row in dataloader_rows:
        loaders_by_pid[row["pid"]].append(row)

    per_rank = []
    # Every folded step of a process that has rows (the rows hold its first steps).
    gone = FoldedSteps()
    # The walls of processes that folded none (exact figures where no process folded),
    # and the histogram of the others' (the job's quantiles are then the histogram's)
    walls, wall_bins = array("d"), Counter()
    waits, wait_bins = array("d"), Counter()
    batch_sizes: Counter[int] = Counter()  # in the order met, as statistics.mode counts
    t_start = t_end = None
    measured, total_wall, total_wait = 0, 0.0, 0.0
    for proc in processes:
        sizes = {r["batch_size"] for r in loaders_by_pid.get(proc.pid, []) if r.get("batch_size")}
        fallback = sizes.pop() if len(sizes) == 1 else None
        m = _measured(proc)
        per_rank.append(_process_stats(proc, fallback, m))
        gone.add(proc.folded)
        if m.wall_bins is None:
            walls.extend(m.walls)
        else:
            wall_bins.update(m.wall_bins)
        measured += len(m.index)
        total_wall = sum(m.walls, total_wall)  # one sum over every row, in order
        total_wait = sum(m.waits, total_wait)
        if proc.folded.waits:
            wait_bins.update(step_histogram.histogram(m.waits))
        else:
            waits.extend(m.waits)
        size, t0, t1 = proc.columns["batch_size"], proc.columns["t_start"], proc.columns["t_end"]
        batch_sizes.update(int(b) for i in m.index if (b := size[i]) == b and b)
        t_start = _least(t_start, min((v for i in m.index if (v := t0[i]) == v), default=None))
        last = max((v for i in m.index if (v := t1[i]) == v), default=None)
        t_end = t_end if last is None else last if t_end is None else max(t_end, last)
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

    measured += gone.count
    total_wall += gone.wall_s
    total_wait += gone.data_wait_s
    rates = [s.steps_per_s for s in per_rank if s.steps_per_s is not None]
    samples = [s.samples_per_s for s in per_rank]
    median, p90 = _quantiles(walls, wall_bins + gone.walls)
    median_wait, p90_wait = _quantiles(waits, wait_bins + gone.waits)
    return StepStats(
        step_count=sum(s.step_count for s in per_rank),
        measured_steps=measured,
        warmup_rule=WARMUP_RULE,
        median_step_s=median,
        p90_step_s=p90,
        data_wait_fraction=(total_wait / total_wall) if total_wall > 0 else None,
        steps_per_s=statistics.fmean(rates) if rates else None,
        samples_per_s=sum(samples) if samples and None not in samples else None,
        batch_size=batch_sizes.most_common(1)[0][0] if batch_sizes else None,
        mean_step_s=total_wall / measured if measured else None,
        mean_data_wait_s=total_wait / measured if measured else None,
        median_data_wait_s=median_wait,
        p90_data_wait_s=p90_wait,
        t_start=t_start,
        t_end=t_end,
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
