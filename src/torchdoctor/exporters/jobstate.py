"""One recorded job as Prometheus sees it: counters that only go forward, the latest gauges.

Fed with the rows a :class:`~torchdoctor.recording.tail.RecordingTail` returns, so the
per-job endpoint of ``torchdoctor run --prometheus`` and the host-wide exporter compute the
same numbers from the same file. The counters are a
:class:`~torchdoctor.recording.totals.RunningTotals` (their rules are there); a job's first
update starts from the totals its writer saved beside the rows, or, in a recording from before
them, from its step history summed in SQL (:mod:`.history`), and reads on row by row.

While the writer keeps saving its totals, each later update takes them as they stand and
reads only the latest sample's process rows for the gauges: the writer summed the rows of
every commit already, with the same code, and reading them again (100 steps a second a job)
was most of a steady scrape of the host exporter.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import itemgetter
from typing import Any

from torchdoctor.exporters import history
from torchdoctor.recording.tail import RecordingTail
from torchdoctor.recording.totals import (
    PROCESS_COLUMNS,
    STEP_COLUMNS,
    TABLES,
    TOTALS_KEY,
    RankSteps,
    RoleTotals,
    RunningTotals,
)

# Process rows read at once at most: a week of a 20-process job is 24 million.
PROCESS_PART = 50_000
# What the gauges are made of, of a sample's process rows: a steady update reads only these
# (each value read costs, and a job has tens of processes a sample).
GAUGE_COLUMNS = ["t", "pid", "create_time", "role", "rss", "swap", "threads"]
_GAUGE_OF_PROCESS_ROW = itemgetter(*(PROCESS_COLUMNS.index(c) for c in GAUGE_COLUMNS))
GPU_PROCESS_COLUMNS = ["t", "gpu_index", "used_memory", "in_job"]
# The host figures the series are made of: scalars only (the per-core JSON is not decoded).
HOST_COLUMNS = [
    "t",
    *(
        f"cpu_seconds_{m}"
        for m in ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    ),
    "load1",
    "procs_running",
    "procs_blocked",
    "mem_total",
    "mem_available",
    "swap_total",
    "swap_used",
    "ctx_switches",
    "swap_in_bytes",
    "swap_out_bytes",
    "major_faults",
    "disk_read_bytes",
    "disk_written_bytes",
    "psi_cpu_some_s",
    "psi_memory_some_s",
    "psi_memory_full_s",
    "psi_io_some_s",
    "psi_io_full_s",
    "cgroup_throttled_s",
    "cgroup_throttled_periods",
]


@dataclass(slots=True)
class RoleNow:
    """The role's processes in the latest sample."""

    processes: int = 0
    threads: int = 0
    rss: int = 0
    pss: int = 0
    uss: int = 0
    swap: int = 0
    pss_known: bool = False


class JobState:
    """The aggregates of one recording, brought up to date by :meth:`update`."""

    def __init__(self, tail: RecordingTail, *, saved_totals: bool = True) -> None:
        """``saved_totals=False`` reads every row after the first update (the tests compare
        the two ways)."""
        self.tail = tail
        self._use_saved = saved_totals
        self._saved: Any = None  # the meta totals value taken last (the same object: unchanged)
        self.run_id = tail.run_id
        self.sums = RunningTotals()
        self.now: dict[str, RoleNow] = {}
        self.sample_t: float | None = None
        self.host: dict[str, Any] | None = None  # the latest host sample (flattened row)
        self.gpus: dict[int, dict[str, Any]] = {}  # latest sample per device index
        self.gpu_memory: dict[int, int] = {}  # the job's memory per device, latest sample
        self._gpu_t: float | None = None
        self._caught_up = False

    @property
    def meta(self) -> dict[str, Any]:
        return self.tail.meta

    @property
    def totals(self) -> dict[str, RoleTotals]:
        """Per role, what its processes used so far."""
        return self.sums.roles

    @property
    def steps(self) -> dict[str, RankSteps]:
        """Per rank ("" when not distributed), its steps so far."""
        return self.sums.steps

    @property
    def events(self) -> dict[str, int]:
        return self.sums.events

    def update(self) -> None:
        meta_read = False
        if not self._caught_up:
            self._catch_up()
        elif self._use_saved and "ended_at" not in self.meta:
            self.tail.refresh_meta()  # first: the totals it holds say which rows they sum
            meta_read = True
        if not (meta_read and self._take_saved()):
            # In parts of a bounded size: the first update of a long job reads all its history.
            while rows := self.tail.new_tuples("process_samples", PROCESS_COLUMNS, PROCESS_PART):
                self.add_process_rows(rows)
            self.sums.add_steps(self.tail.new_tuples("steps", STEP_COLUMNS))
            self.sums.add_events([kind for (kind,) in self.tail.new_tuples("events", ["kind"])])
        hosts = self.tail.new_rows("host_samples", HOST_COLUMNS)
        if hosts:
            self.host = hosts[-1]
        gpu_rows = self.tail.new_rows("gpu_samples")
        for row in gpu_rows:
            self.gpus[row["index"]] = row
        gpu_procs = self.tail.new_rows("gpu_process_samples", GPU_PROCESS_COLUMNS)
        if gpu_rows or gpu_procs:
            self._gpu_processes(gpu_procs)
        if not meta_read and "ended_at" not in self.meta:
            self.tail.refresh_meta()

    # -- internals ------------------------------------------------------------------------

    def _catch_up(self) -> None:
        """Start from the totals the writer saved, or else from the step and event history
        summed in SQL (see :mod:`.history`: a long job has far more of them than anything
        else; process rows are then read on by :meth:`update`)."""
        self._caught_up = True
        tail = self.tail
        saved = RunningTotals.from_json(tail.meta.get(TOTALS_KEY))
        if saved is not None:
            self.sums = saved
            through = saved.through["process_samples"]
            # The gauges are those of the latest sample the totals include: its rows, read
            # for the gauges only (they are in the sums already).
            latest = history.first_row_of_latest_sample(tail, "process_samples")
            if 0 < latest <= through:
                tail.seek("process_samples", latest - 1)
                self._gauges(
                    tail.new_tuples("process_samples", GAUGE_COLUMNS, through - latest + 1)
                )
            for table, rowid in saved.through.items():
                tail.seek(table, rowid)
        else:
            upto = tail.count("steps")
            self.sums.steps = history.step_history(tail, upto)
            tail.seek("steps", upto)
            upto = tail.count("events")
            self.sums.events = history.event_counts(tail, upto)
            tail.seek("events", upto)
        # Of the host and the GPUs only the latest sample is kept: read from there.
        tail.seek("host_samples", max(tail.count("host_samples") - 1, 0))
        for table in ("gpu_samples", "gpu_process_samples"):
            tail.seek(table, max(history.first_row_of_latest_sample(tail, table) - 1, 0))

    def _take_saved(self) -> bool:
        """Take the totals the writer saved, if they sum at least the rows read so far; the
        gauges then come from the latest sample they include. False: read the rows."""
        saved = self.tail.meta.get(TOTALS_KEY)
        if saved is None:
            return False
        if saved is self._saved:
            return True  # no commit of process, step or event rows since the last update
        sums = RunningTotals.from_json(saved)
        tail = self.tail
        if sums is None or any(sums.through[t] < tail.position(t) for t in TABLES):
            return False
        through = sums.through["process_samples"]
        new_sample = through > tail.position("process_samples")
        self.sums = sums
        self._saved = saved
        for table in TABLES:
            # Rows committed after the meta was read are summed by the next totals.
            tail.seek(table, sums.through[table])
        if new_sample:
            self._gauges(history.rows_of_sample(tail, "process_samples", GAUGE_COLUMNS, through))
        return True

    def add_process_rows(self, rows: list[tuple]) -> None:
        """Credit the counters; the gauges become those of the latest sample in ``rows``
        (tuples of PROCESS_COLUMNS, whose first is t, as :meth:`RecordingTail.new_tuples`
        reads them)."""
        if not rows:
            return
        self.sums.add_process_rows(rows)
        t = rows[-1][0]
        self._gauges([_GAUGE_OF_PROCESS_ROW(r) for r in rows if r[0] == t])

    def _gauges(self, latest: list[tuple]) -> None:
        """The gauges of one sample's rows, tuples of GAUGE_COLUMNS (PSS from the sums: it is
        read on a slower tier)."""
        if not latest:
            return
        now: dict[str, RoleNow] = {}
        alive = set()
        pss_of = self.sums.pss
        for _t, pid, create_time, role, rss, swap, threads in latest:
            key = (pid, create_time)
            alive.add(key)
            g = now.get(role)
            if g is None:
                g = now[role] = RoleNow()
            g.processes += 1
            g.threads += threads or 0
            g.rss += rss or 0
            g.swap += swap or 0
            # PSS is refreshed on a slower tier: a process between two readings counts with
            # its last one rather than as zero.
            pss, uss = pss_of.get(key, (None, None))
            if pss is not None:
                g.pss += pss
                g.uss += uss or 0
                g.pss_known = True
        self.now = now
        self.sample_t = latest[0][0]
        self.sums.forget_except(alive)

    def _gpu_processes(self, rows: list[dict[str, Any]]) -> None:
        t = rows[-1]["t"] if rows else None
        used: dict[int, int] = {}
        for row in rows:
            if row["t"] != t or not row["in_job"] or row["used_memory"] is None:
                continue
            used[row["gpu_index"]] = used.get(row["gpu_index"], 0) + row["used_memory"]
        # A device with no job process in the latest sample holds none of the job's memory.
        self.gpu_memory = {index: used.get(index, 0) for index in self.gpus} | used
