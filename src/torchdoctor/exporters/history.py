"""A job's history summed by SQLite: where a :class:`JobState` starts from.

The first scrape of a job that has run for an hour (or a week) must not bring every row it
ever recorded into Python: one minute of a 20-process job at 100 steps/s is 8,000 rows, and
the host exporter reads every job on the machine. These aggregates give what
:class:`~torchdoctor.exporters.jobstate.JobState` credits row by row, by the same rules
(each process's counters followed per (PID, start time), the first reading bringing all it
used so far, a lower reading adding nothing, an unread one keeping the previous value; each
increase credited to the role the process had in the row that shows it), as SQL run over the
rows in C. The JobState then reads on from where the sums end, row by row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torchdoctor.recording.tail import RecordingTail

COUNTERS = ("cpu_user_s", "cpu_system_s", "read_bytes", "write_bytes")
IO_COUNTERS = ("read_bytes", "write_bytes")

ProcessKey = tuple[int, float]  # (pid, create_time)


@dataclass(slots=True)
class ProcessHistory:
    """The process rows up to a rowid, summed."""

    credited: dict[str, dict[str, float]] = field(default_factory=dict)  # role -> counter -> sum
    io_known: set[str] = field(default_factory=set)  # roles with a readable /proc/<pid>/io
    last: dict[ProcessKey, tuple] = field(default_factory=dict)  # latest reading per counter
    pss: dict[ProcessKey, tuple[int, int | None]] = field(default_factory=dict)  # latest PSS


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


def process_history(tail: RecordingTail, before: int) -> ProcessHistory:
    """The process rows with a rowid below ``before``, credited as JobState credits them."""
    history = ProcessHistory()
    for (role,) in tail.query(
        "SELECT DISTINCT role FROM process_samples WHERE rowid < ?", [before]
    ):
        history.credited[role] = dict.fromkeys(COUNTERS, 0.0)
    cols = {c: tail.column("process_samples", c) for c in COUNTERS}
    present = [c for c in COUNTERS if cols[c] != "NULL"]  # older recordings lack some
    unread = tail.query(
        "SELECT " + ", ".join(f"COUNT(*) - COUNT({cols[c]})" for c in present)
        + " FROM process_samples WHERE rowid < ?",
        [before],
    )[0] if present else ()  # fmt: skip
    # Counters all read in every row (the usual case) are credited in one pass; one that was
    # unread now and then is credited over the rows that have it, alone.
    groups = [[c] for c in present] if any(unread) else [present] if present else []
    for group in groups:
        _credit(tail, history, [cols[c] for c in group], group, before)
    pss, uss = tail.column("process_samples", "pss"), tail.column("process_samples", "uss")
    if pss != "NULL":
        for pid, create_time, _, p, u in tail.query(
            f"""SELECT pid, create_time, MAX(rowid), {pss}, {uss} FROM process_samples
                WHERE rowid < ? AND {pss} IS NOT NULL GROUP BY pid, create_time""",
            [before],
        ):
            history.pss[(pid, create_time)] = (p, u)
    return history


def _credit(
    tail: RecordingTail, history: ProcessHistory, cols: list[str], names: list[str], before: int
) -> None:
    """Credit the counters ``names`` (SELECT expressions ``cols``) over the rows that read
    them all, and note each process's latest reading of them."""
    read = " AND ".join(f"{c} IS NOT NULL" for c in cols)
    # Over only the rows that read the counter, LAG is the previous reading, whatever unread
    # samples lie between (an unread counter keeps its previous value).
    lags = ", ".join(f"{c} AS v{i}, LAG({c}) OVER k AS p{i}" for i, c in enumerate(cols))
    sums = ", ".join(
        f"SUM(CASE WHEN p{i} IS NULL THEN v{i} WHEN v{i} > p{i} THEN v{i} - p{i} ELSE 0 END)"
        for i in range(len(cols))
    )
    for role, *totals in tail.query(
        f"""SELECT role, {sums} FROM (
              SELECT role, {lags} FROM process_samples WHERE rowid < ? AND {read}
              WINDOW k AS (PARTITION BY pid, create_time ORDER BY rowid))
            GROUP BY role""",
        [before],
    ):
        for name, total in zip(names, totals, strict=True):
            history.credited[role][name] = total
            if name in IO_COUNTERS:
                history.io_known.add(role)
    # SQLite gives bare columns the values of the row that holds the MAX(): each process's
    # latest row that read these counters.
    for pid, create_time, _, *values in tail.query(
        f"""SELECT pid, create_time, MAX(rowid), {", ".join(cols)} FROM process_samples
            WHERE rowid < ? AND {read} GROUP BY pid, create_time""",
        [before],
    ):
        key = (pid, create_time)
        last = dict(zip(COUNTERS, history.last.get(key) or (None,) * len(COUNTERS), strict=True))
        last.update(zip(names, values, strict=True))
        history.last[key] = tuple(last[c] for c in COUNTERS)


def step_history(tail: RecordingTail, upto: int) -> list[RankHistory]:
    """The step rows up to rowid ``upto``, per rank, summed as JobState sums them."""

    def col(name: str) -> str:
        return tail.column("steps", name)

    wall, wait = f"COALESCE({col('wall_s')}, 0.0)", f"COALESCE({col('data_wait_s')}, 0.0)"
    samples = f"COALESCE({col('samples')}, {col('batch_size')})"
    ranks: dict[int | None, RankHistory] = {}
    for rank, n, wall_s, wait_s, count, known, t_end in tail.query(
        f"""SELECT rank, COUNT(*), SUM({wall}), SUM(MIN({wait}, {wall})),
                   COALESCE(SUM({samples}), 0), COUNT({samples}), COALESCE(MAX(t_end), 0.0)
            FROM steps WHERE rowid <= ? GROUP BY rank""",
        [upto],
    ):
        ranks[rank] = RankHistory(rank, n, wall_s, wait_s, count, known > 0, t_end)
    allocated = col("cuda_allocated")
    if allocated != "NULL":
        for rank, _, a, r, m in tail.query(
            f"""SELECT rank, MAX(rowid), {allocated}, {col("cuda_reserved")},
                       {col("cuda_max_allocated")}
                FROM steps WHERE rowid <= ? AND {allocated} IS NOT NULL GROUP BY rank""",
            [upto],
        ):
            ranks[rank].cuda = (a, r, m)
    for name in ("cuda_alloc_retries", "cuda_ooms"):
        if col(name) == "NULL":
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
