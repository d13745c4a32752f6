"""Running totals of a recording: what its processes used and its ranks stepped, so far.

The sums a Prometheus counter needs, kept the way a counter must go: only forward. Each
process's cumulative CPU seconds and I/O bytes are followed per (PID, start time); what a
process added since its previous sample is credited to the role it had then. A DataLoader
worker that exits therefore keeps what it used in the job's total (Prometheus would read a
drop as a counter reset), and a process that changes role (classified again once its children
appear) moves no past usage between roles. The first reading of a process brings all it used
so far; a counter read lower than before adds nothing; one that could not be read keeps its
previous value. Steps are summed per rank.

The recording's writer keeps these beside the rows it commits (``meta["totals"]``, in the same
transaction, with the rowids they sum through), so that a reader that starts late (an
exporter's first scrape of a job that has run for a day) takes them as they stand and reads
only the rows after them; :class:`~torchdoctor.exporters.jobstate.JobState` then goes on with
the same code.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

TOTALS_KEY = "totals"  # where the writer keeps them in the recording's meta

# Read as tuples in these orders (the loops below unpack them by position).
PROCESS_COLUMNS = [
    "t",
    "pid",
    "create_time",
    "role",
    "cpu_user_s",
    "cpu_system_s",
    "rss",
    "pss",
    "uss",
    "swap",
    "threads",
    "read_bytes",
    "write_bytes",
]
STEP_COLUMNS = [
    "pid",
    "rank",
    "t_end",
    "wall_s",
    "data_wait_s",
    "batch_size",
    "samples",
    "cuda_allocated",
    "cuda_reserved",
    "cuda_max_allocated",
    "cuda_alloc_retries",
    "cuda_ooms",
]

FORMAT = 1  # of the saved totals: a reader that meets another reads the rows instead
TABLES = ("process_samples", "steps", "events")  # the tables the totals sum


@dataclass(slots=True)
class RoleTotals:
    """Cumulative usage of every process that ever had this role in the job."""

    cpu_user_s: float = 0.0
    cpu_system_s: float = 0.0
    read_bytes: int = 0
    write_bytes: int = 0
    io_known: bool = False  # some process of the role had readable /proc/<pid>/io


@dataclass(slots=True)
class RankSteps:
    """Steps of one rank ("" when the job is not distributed), from its step records."""

    steps: int = 0
    wall_s: float = 0.0
    data_wait_s: float = 0.0
    samples: int = 0
    samples_known: bool = False
    last_t_end: float = 0.0
    cuda_allocated: int | None = None
    cuda_reserved: int | None = None
    cuda_max_allocated: int | None = None
    # cumulative per process (torch counts per process): summed over the rank's processes
    cuda_alloc_retries: dict[int, int] = field(default_factory=dict)
    cuda_ooms: dict[int, int] = field(default_factory=dict)


ProcessKey = tuple[int, float]  # (pid, create_time)


class RunningTotals:
    """The sums; ``through`` holds, per table, the last rowid they include."""

    def __init__(self) -> None:
        self.roles: dict[str, RoleTotals] = {}
        self.steps: dict[str, RankSteps] = {}
        self.events: dict[str, int] = {}
        # Per process: its latest reading of each counter, and its latest PSS and USS.
        self.last: dict[ProcessKey, tuple[Any, ...]] = {}
        self.pss: dict[ProcessKey, tuple[int | None, int | None]] = {}
        self.through: dict[str, int] = dict.fromkeys(TABLES, 0)

    def add_process_rows(self, rows: list[tuple]) -> None:
        """Credit the counters of ``rows`` (tuples of PROCESS_COLUMNS, in rowid order)."""
        last = self.last
        totals = self.roles
        pss_of = self.pss
        # Written out field by field, on tuples (in the order of PROCESS_COLUMNS): the first scrape credits the whole history
        # so far (thousands of rows a minute of a 20-process job), and every scrape must stay
        # cheap.
        for (
            _t,
            pid,
            create_time,
            role,
            user,
            system,
            _rss,
            pss,
            uss,
            _swap,
            _thr,
            read,
            write,
        ) in rows:
            key = (pid, create_time)
            tot = totals.get(role)
            if tot is None:
                tot = totals[role] = RoleTotals()
            before = last.get(key)
            if before is None:
                # The first sample of a process brings everything it used so far.
                if user is not None:
                    tot.cpu_user_s += user
                if system is not None:
                    tot.cpu_system_s += system
                if read is not None:
                    tot.io_known = True
                    tot.read_bytes += read
                if write is not None:
                    tot.io_known = True
                    tot.write_bytes += write
                last[key] = (user, system, read, write)
            else:
                # A counter read lower than before (never expected) adds nothing; one that
                # could not be read keeps its previous value.
                b_user, b_system, b_read, b_write = before
                if user is None:
                    user = b_user
                elif b_user is None:
                    tot.cpu_user_s += user
                elif user > b_user:
                    tot.cpu_user_s += user - b_user
                if system is None:
                    system = b_system
                elif b_system is None:
                    tot.cpu_system_s += system
                elif system > b_system:
                    tot.cpu_system_s += system - b_system
                if read is None:
                    read = b_read
                else:
                    tot.io_known = True
                    if b_read is None:
                        tot.read_bytes += read
                    elif read > b_read:
                        tot.read_bytes += read - b_read
                if write is None:
                    write = b_write
                else:
                    tot.io_known = True
                    if b_write is None:
                        tot.write_bytes += write
                    elif write > b_write:
                        tot.write_bytes += write - b_write
                last[key] = (user, system, read, write)
            if pss is not None:
                pss_of[key] = (pss, uss)

    def forget_except(self, alive: set[ProcessKey]) -> None:
        """Drop what ended processes carry per process (their usage stays in the sums)."""
        for key in [k for k in self.pss if k not in alive]:
            del self.pss[key]
        if len(self.last) > 4 * max(len(alive), 64):
            for key in [k for k in self.last if k not in alive]:
                del self.last[key]

    def add_steps(self, rows: list[tuple]) -> None:
        """Add step rows (tuples of STEP_COLUMNS) to their ranks' sums."""
        steps = self.steps
        for (
            pid, rank, t_end, wall, wait, batch_size, n, allocated, reserved, max_allocated,
            retries, ooms,
        ) in rows:  # fmt: skip
            key = "" if rank is None else str(rank)
            s = steps.get(key)
            if s is None:
                s = steps[key] = RankSteps()
            s.steps += 1
            wall = wall or 0.0
            s.wall_s += wall
            # recording.steps' step_wait_s and step_samples, written out (see add_process_rows).
            wait = wait or 0.0
            s.data_wait_s += wait if wait < wall else wall
            if n is None:
                n = batch_size
            if n is not None:
                s.samples += n
                s.samples_known = True
            if t_end > s.last_t_end:
                s.last_t_end = t_end
            if allocated is not None:
                s.cuda_allocated = allocated
                s.cuda_reserved = reserved
                s.cuda_max_allocated = max_allocated
            if retries is not None:
                s.cuda_alloc_retries[pid] = retries
            if ooms is not None:
                s.cuda_ooms[pid] = ooms

    def add_events(self, kinds: list[str]) -> None:
        for kind in kinds:
            self.events[kind] = self.events.get(kind, 0) + 1

    # -- saved beside the rows ------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "through": self.through,
            "roles": {role: asdict(t) for role, t in self.roles.items()},
            "steps": {
                rank: {
                    **asdict(s),
                    "cuda_alloc_retries": list(s.cuda_alloc_retries.items()),
                    "cuda_ooms": list(s.cuda_ooms.items()),
                }
                for rank, s in self.steps.items()
            },
            "events": self.events,
            "last": [[*key, *values] for key, values in self.last.items()],
            "pss": [[*key, *values] for key, values in self.pss.items()],
        }

    @classmethod
    def from_json(cls, saved: Any) -> RunningTotals | None:
        """The totals a writer saved; None for another format or a damaged value."""
        if not isinstance(saved, dict) or saved.get("format") != FORMAT:
            return None
        try:
            totals = cls()
            totals.through = {t: int(saved["through"][t]) for t in TABLES}
            totals.roles = {r: RoleTotals(**t) for r, t in saved["roles"].items()}
            for rank, s in saved["steps"].items():
                s = dict(s)
                retries = {int(p): v for p, v in s.pop("cuda_alloc_retries")}
                ooms = {int(p): v for p, v in s.pop("cuda_ooms")}
                totals.steps[rank] = RankSteps(**s, cuda_alloc_retries=retries, cuda_ooms=ooms)
            totals.events = {str(k): int(v) for k, v in saved["events"].items()}
            totals.last = {(e[0], e[1]): tuple(e[2:]) for e in saved["last"]}
            totals.pss = {(e[0], e[1]): (e[2], e[3]) for e in saved["pss"]}
        except (KeyError, TypeError, ValueError, IndexError):
            return None
        return totals
