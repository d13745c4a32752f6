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

from torchdoctor.recording.tail import RecordingTail
from torchdoctor.recording.totals import RankSteps


def first_row_of_latest_sample(tail: RecordingTail, table: str) -> int:
    """The first rowid of the newest sample time in ``table`` (0 when it is empty): the rows
    from there on are the latest sample, which the gauges are read from."""
    (row,) = tail.query(
        f"SELECT MIN(rowid) FROM {table} WHERE t = "
        f"(SELECT t FROM {table} WHERE rowid = (SELECT MAX(rowid) FROM {table}))"
    )
    return row[0] or 0


def rows_of_sample(tail: RecordingTail, table: str, columns: list[str], rowid: int) -> list:
    """The rows of the sample row ``rowid`` belongs to (same ``t``), up to it, as tuples of
    ``columns`` in rowid order: found through the index on ``t``, however long the table."""
    select = tail.selection(table, columns)
    return tail.query(
        f"SELECT {select} FROM {table} "
        f"WHERE t = (SELECT t FROM {table} WHERE rowid = ?) AND rowid <= ? ORDER BY rowid",
        [rowid, rowid],
    )


def step_history(tail: RecordingTail, upto: int) -> dict[str, RankSteps]:
    """The step rows up to rowid ``upto``, summed per rank ("" when not distributed) as
    JobState sums them."""

    def col(name: str) -> str:
        return tail.column("steps", name)

    # A NULL in a sum adds nothing, as a missing wall or wait adds nothing step by step (and
    # MIN of a NULL is NULL): written bare, each aggregate costs SQLite the least.
    wall, wait = col("wall_s"), col("data_wait_s")
    samples = f"COALESCE({col('samples')}, {col('batch_size')})"
    sums = (
        f"COUNT(*), COALESCE(SUM({wall}), 0.0), COALESCE(SUM(MIN({wait}, {wall})), 0.0), "
        f"COALESCE(SUM({samples}), 0), COUNT({samples}), COALESCE(MAX(t_end), 0.0)"
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
    ranks: dict[int | None, RankSteps] = {}
    if n and low == high and ranked in (0, n):
        rows = [(low, *whole[3 : 3 + 6])]
    else:
        rows = tail.query(f"SELECT rank, {sums} FROM steps WHERE rowid <= ? GROUP BY rank", [upto])
    for rank, count, wall_s, wait_s, total, known, t_end in rows:
        if count:
            ranks[rank] = RankSteps(count, wall_s, wait_s, total, known > 0, t_end)
    allocated = col("cuda_allocated")
    if has_cuda["cuda_allocated"]:
        for rank, _, a, r, m in tail.query(
            f"""SELECT rank, MAX(rowid), {allocated}, {col("cuda_reserved")},
                       {col("cuda_max_allocated")}
                FROM steps WHERE rowid <= ? AND {allocated} IS NOT NULL GROUP BY rank""",
            [upto],
        ):
            s = ranks[rank]
            s.cuda_allocated, s.cuda_reserved, s.cuda_max_allocated = a, r, m
    for name in ("cuda_alloc_retries", "cuda_ooms"):
        if not has_cuda[name]:
            continue
        for rank, pid, _, value in tail.query(
            f"""SELECT rank, pid, MAX(rowid), {col(name)} FROM steps
                WHERE rowid <= ? AND {col(name)} IS NOT NULL GROUP BY rank, pid""",
            [upto],
        ):
            getattr(ranks[rank], name)[pid] = value
    return {"" if rank is None else str(rank): s for rank, s in ranks.items()}


def event_counts(tail: RecordingTail, upto: int) -> dict[str, int]:
    """Events up to rowid ``upto``, counted by kind."""
    return dict(
        tail.query("SELECT kind, COUNT(*) FROM events WHERE rowid <= ? GROUP BY kind", [upto])
    )
