"""A job's step and event history summed by SQLite: where a :class:`JobState` starts from.

The first scrape of a job that has run for an hour (or a week) must not bring every step it
ever recorded into Python: a minute at 100 steps/s is 6,000 rows, and the host exporter reads
every job on the machine. These aggregates are the sums
:class:`~torchdoctor.exporters.jobstate.JobState` makes step by step (count, wall time, data
wait capped at the wall time, samples or else the batch size, the latest end and CUDA
figures), per rank, as SQL run over the rows in C; the JobState reads on from where they end.
(Process rows are fewer, and their crediting per process and role is order-dependent: they
are read on the row-by-row path, as tuples.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torchdoctor.recording.tail import RecordingTail


@dataclass(slots=True)
class RankHistory:
    """The step rows of one rank (None: not distributed), summed."""

    rank: int | None
    steps: int
    wall_s: float
    data_wait_s: float
    samples: int
    samples_known: bool
    last_t_end: float
    cuda: tuple[int, int | None, int | None] | None = None  # latest allocated, reserved, max
    cuda_alloc_retries: dict[int, int] = field(default_factory=dict)  # pid -> latest
    cuda_ooms: dict[int, int] = field(default_factory=dict)


def first_row_of_latest_sample(tail: RecordingTail, table: str) -> int:
    """The first rowid of the newest sample time in ``table`` (0 when it is empty): the rows
    from there on are the latest sample, which the gauges are read from."""
    (row,) = tail.query(
        f"SELECT MIN(rowid) FROM {table} WHERE t = "
        f"(SELECT t FROM {table} WHERE rowid = (SELECT MAX(rowid) FROM {table}))"
    )
    return row[0] or 0


def step_history(tail: RecordingTail, upto: int) -> list[RankHistory]:
    """The step rows up to rowid ``upto``, per rank, summed as JobState sums them."""

    def col(name: str) -> str:
        return tail.column("steps", name)

    wall, wait = f"COALESCE({col('wall_s')}, 0.0)", f"COALESCE({col('data_wait_s')}, 0.0)"
    samples = f"COALESCE({col('samples')}, {col('batch_size')})"
    sums = (
        f"COUNT(*), SUM({wall}), SUM(MIN({wait}, {wall})), COALESCE(SUM({samples}), 0), "
        f"COUNT({samples}), COALESCE(MAX(t_end), 0.0)"
    )
    cuda = ("cuda_allocated", "cuda_alloc_retries", "cuda_ooms")
    # One pass first, as if there were one rank: grouping sorts every row, and most jobs
    # have one rank (or none) a recording; it also says whether any CUDA figure is there.
    (whole,) = tail.query(
        f"SELECT MIN(rank), MAX(rank), COUNT(rank), {sums}, "
        + ", ".join(f"COUNT({col(c)})" for c in cuda)
        + " FROM steps WHERE rowid <= ?",
        [upto],
    )
    low, high, ranked, n = whole[:4]
    has_cuda = dict(zip(cuda, whole[-len(cuda) :], strict=True))
    ranks: dict[int | None, RankHistory] = {}
    if n and low == high and ranked in (0, n):
        rows = [(low, *whole[3 : 3 + 6])]
    else:
        rows = tail.query(f"SELECT rank, {sums} FROM steps WHERE rowid <= ? GROUP BY rank", [upto])
    for rank, count, wall_s, wait_s, total, known, t_end in rows:
        if count:
            ranks[rank] = RankHistory(rank, count, wall_s, wait_s, total, known > 0, t_end)
    allocated = col("cuda_allocated")
    if has_cuda["cuda_allocated"]:
        for rank, _, a, r, m in tail.query(
            f"""SELECT rank, MAX(rowid), {allocated}, {col("cuda_reserved")},
                       {col("cuda_max_allocated")}
                FROM steps WHERE rowid <= ? AND {allocated} IS NOT NULL GROUP BY rank""",
            [upto],
        ):
            ranks[rank].cuda = (a, r, m)
    for name in ("cuda_alloc_retries", "cuda_ooms"):
        if not has_cuda[name]:
            continue
        for rank, pid, _, value in tail.query(
            f"""SELECT rank, pid, MAX(rowid), {col(name)} FROM steps
                WHERE rowid <= ? AND {col(name)} IS NOT NULL GROUP BY rank, pid""",
            [upto],
        ):
            getattr(ranks[rank], name)[pid] = value
    return list(ranks.values())


def event_counts(tail: RecordingTail, upto: int) -> dict[str, int]:
    """Events up to rowid ``upto``, counted by kind."""
    return dict(
        tail.query("SELECT kind, COUNT(*) FROM events WHERE rowid <= ? GROUP BY kind", [upto])
    )
