"""One recorded job as Prometheus sees it: counters that only go forward, the latest gauges.

Fed with the rows a :class:`~torchdoctor.recording.tail.RecordingTail` returns, so the
per-job endpoint of ``torchdoctor run --prometheus`` and the host-wide exporter compute the
same numbers from the same file.

Counters stay monotonic when processes come and go. Each process's cumulative CPU seconds and
I/O bytes are followed per (PID, start time); what a process added since its previous sample
is credited to the role it had then. A DataLoader worker that exits therefore keeps what it
used in the job's total (Prometheus would read a drop as a counter reset), and a process that
changes role (classified again once its children appear) moves no past usage between roles.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchdoctor.exporters import history
from torchdoctor.exporters.history import RankSteps
from torchdoctor.recording.tail import RecordingTail

# Read as tuples in this order (JobState unpacks them by position: reorder both together).
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
# Process rows read at once at most: a week of a 20-process job is 24 million.
PROCESS_PART = 50_000
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
class RoleTotals:
    """Cumulative usage of every process that ever had this role in the job."""

    cpu_user_s: float = 0.0
    cpu_system_s: float = 0.0
    read_bytes: int = 0
    write_bytes: int = 0
    io_known: bool = False  # some process of the role had readable /proc/<pid>/io


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

    def __init__(self, tail: RecordingTail) -> None:
        self.tail = tail
        self.run_id = tail.run_id
        self.totals: dict[str, RoleTotals] = {}
        self.now: dict[str, RoleNow] = {}
        self.sample_t: float | None = None
        self.steps: dict[str, RankSteps] = {}
        self.events: dict[str, int] = {}
        self.host: dict[str, Any] | None = None  # the latest host sample (flattened row)
        self.gpus: dict[int, dict[str, Any]] = {}  # latest sample per device index
        self.gpu_memory: dict[int, int] = {}  # the job's memory per device, latest sample
        self._last: dict[tuple[int, float], tuple[Any, ...]] = {}
        self._pss: dict[tuple[int, float], tuple[int | None, int | None]] = {}
        self._gpu_t: float | None = None
        self._caught_up = False

    @property
    def meta(self) -> dict[str, Any]:
        return self.tail.meta

    def update(self) -> None:
        if not self._caught_up:
            self._catch_up()
        # In parts of a bounded size: the first update of a long job reads all its history.
        while rows := self.tail.new_tuples("process_samples", PROCESS_COLUMNS, PROCESS_PART):
            self.add_process_rows(rows)
        self._steps(self.tail.new_tuples("steps", STEP_COLUMNS))
        for row in self.tail.new_rows("events", ["kind"]):
            self.events[row["kind"]] = self.events.get(row["kind"], 0) + 1
        hosts = self.tail.new_rows("host_samples", HOST_COLUMNS)
        if hosts:
            self.host = hosts[-1]
        gpu_rows = self.tail.new_rows("gpu_samples")
        for row in gpu_rows:
            self.gpus[row["index"]] = row
        gpu_procs = self.tail.new_rows("gpu_process_samples", GPU_PROCESS_COLUMNS)
        if gpu_rows or gpu_procs:
            self._gpu_processes(gpu_procs)
        if "ended_at" not in self.meta:
            self.tail.refresh_meta()

    # -- internals ------------------------------------------------------------------------

    def _catch_up(self) -> None:
        """Start from the step and event history summed in SQL (see :mod:`.history`): a
        long job has far more of them than anything else. The process rows, credited per
        process and role, are read on by :meth:`update` as every later scrape reads them."""
        self._caught_up = True
        tail = self.tail
        upto = tail.count("steps")
        self.steps = history.step_history(tail, upto)
        tail.seek("steps", upto)
        upto = tail.count("events")
        self.events = history.event_counts(tail, upto)
        tail.seek("events", upto)
        # Of the host and the GPUs only the latest sample is kept: read from there.
        tail.seek("host_samples", max(tail.count("host_samples") - 1, 0))
        for table in ("gpu_samples", "gpu_process_samples"):
            tail.seek(table, max(history.first_row_of_latest_sample(tail, table) - 1, 0))

    def add_process_rows(self, rows: list[tuple]) -> None:
        """Credit the counters; the gauges become those of the latest sample in ``rows``
        (tuples of PROCESS_COLUMNS, as :meth:`RecordingTail.new_tuples` reads them)."""
        if not rows:
            return
        last = self._last
        totals = self.totals
        pss_of = self._pss
        # Written out field by field, on tuples (in the order of PROCESS_COLUMNS, whose first
        # is t: tensorboard.py cuts samples by it): the first scrape credits the whole history
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
        # The gauges describe the latest sample: the rows sharing the largest time.
        t = rows[-1][0]
        now: dict[str, RoleNow] = {}
        alive = set()
        for _t, pid, create_time, role, _u, _s, rss, _p, _u2, swap, threads, *_ in (
            r for r in rows if r[0] == t
        ):
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
            pss, uss = self._pss.get(key, (None, None))
            if pss is not None:
                g.pss += pss
                g.uss += uss or 0
                g.pss_known = True
        self.now = now
        self.sample_t = t
        # Forget what ended processes carry per process (their usage stays in the totals).
        for key in [k for k in self._pss if k not in alive]:
            del self._pss[key]
        if len(last) > 4 * max(len(alive), 64):
            for key in [k for k in last if k not in alive]:
                del last[key]

    def _steps(self, rows: list[tuple]) -> None:
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
            # step_wait_s and step_samples, written out (see add_process_rows).
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

    def _gpu_processes(self, rows: list[dict[str, Any]]) -> None:
        t = rows[-1]["t"] if rows else None
        used: dict[int, int] = {}
        for row in rows:
            if row["t"] != t or not row["in_job"] or row["used_memory"] is None:
                continue
            used[row["gpu_index"]] = used.get(row["gpu_index"], 0) + row["used_memory"]
        # A device with no job process in the latest sample holds none of the job's memory.
        self.gpu_memory = {index: used.get(index, 0) for index in self.gpus} | used
