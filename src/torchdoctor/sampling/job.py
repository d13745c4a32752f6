"""The job: a process tree found again at every read, sampled per process from /proc.

Discovery. Linux has no cheap "descendants of PID" call: ``/proc/<pid>/task/<tid>/children``
needs CONFIG_PROC_CHILDREN and one read per *thread* (a torch trainer runs dozens), so the
tree is found from PPIDs. The last PID the kernel handed out (the 5th field of /proc/loadavg)
tells whether any process was created since the previous read; only then (or when a member
ended, whose PID may come back) is /proc listed, and only the PIDs allocated since (PIDs are
handed out cyclically) or never classified get their ``stat`` read. PIDs known to be outside the job are remembered, so a steady job costs one
small read for discovery. The memory is dropped every minute as a safety net.

Membership is sticky: a process found in the tree stays part of the job until it exits,
even if its parent dies and it is reparented outside the tree (an orphaned DataLoader worker
still eats the job's CPU and memory).

Identity. A process is keyed by (PID, start time). Its /proc files are opened once and
re-read through the same descriptors, which fail once that process is gone even if the PID
has been reused, so rates never mix two processes. Zombies count as gone.
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import time

from torchdoctor.sampling import procfs, roles
from torchdoctor.sampling.types import ProcessInfo, ProcessSample

_ENV_NAMES = ("RANK", "LOCAL_RANK")
_DEAD_STATES = ("Z", "X", "x")
_FULL_RESCAN_S = 60.0
_SLOW_BURST_S = 0.05
_NOT_YET = "not read yet: PSS/USS are refreshed on a slower tier"
# A carried PSS/USS reading stands for the process only while its RSS stays near what it was
# when they were read; past this change they are withheld until the next refresh.
_STALE_SHARE = 0.25
_STALE_MIN_BYTES = 16 << 20


class _Proc:
    """Everything kept about one live process between reads."""

    __slots__ = (
        "pid",
        "starttime",
        "create_time",
        "ppid",
        "comm",
        "name",
        "cmdline",
        "traits",
        "rank",
        "local_rank",
        "role",
        "stat_fd",
        "status_fd",
        "io_fd",
        "sched_fd",
        "sched_error",
        "kept",
        "io_error",
        "prev_mono",
        "prev_cpu",
        "prev_vol",
        "prev_invol",
        "prev_read",
        "prev_write",
        "pss",
        "pss_rss",
        "uss",
        "smaps_error",
        "shm_files",
        "shm_error",
        "slow_due",
        "stat",
    )

    def close(self) -> None:
        for name in ("stat_fd", "status_fd", "io_fd", "sched_fd"):
            fd = getattr(self, name)
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
                setattr(self, name, None)


class SlowBudget:
    """The CPU the slow tier (PSS/USS from smaps_rollup) may spend: a bucket of CPU seconds
    refilled at ``share`` of one core (None: no cap), holding at most ``burst`` seconds so
    that a new job gets its first readings without waiting; ``tokens``: what it holds at
    first, when that is more (a start that reads every job on the machine once), until
    :meth:`trim`.

    One bucket may be shared by several readers: ``top`` follows every job on the machine and
    gives them one, so that their slow reads together, start-up burst included, stay within
    it (a burst per reader let a hundred jobs spend a hundred bursts at once)."""

    __slots__ = ("share", "burst", "tokens", "_mono")

    def __init__(
        self, share: float | None, burst: float | None = None, tokens: float | None = None
    ) -> None:
        self.share = share
        self.burst = _SLOW_BURST_S if burst is None else burst
        self.tokens = self.burst if tokens is None else tokens
        self._mono = time.monotonic()

    def refill(self, mono: float) -> None:
        """Add what the share earned since the last refill (any reader's)."""
        if mono > self._mono:
            if self.share is not None and self.tokens < self.burst:
                self.tokens = min(self.burst, self.tokens + self.share * (mono - self._mono))
            self._mono = mono

    def trim(self) -> None:
        """Drop what it holds above the burst: a start's allowance is not carried on."""
        self.tokens = min(self.tokens, self.burst)

    def left(self) -> bool:
        return self.share is None or self.tokens > 0

    def spend(self, cpu_s: float) -> None:
        if self.share is not None:
            self.tokens -= cpu_s


class JobReader:
    """The processes of the tree rooted at ``root_pid``.

    ``read()`` returns (samples of every live process, ProcessInfo of processes seen for the
    first time, PIDs gone since the previous read). A process that execs is described again
    (same PID and create time; new command line, role and rank): the last description wins. Per-process rates (CPU %, context
    switches, I/O) are ``None`` in a process's first sample.

    PSS/USS come from smaps_rollup, for which the kernel walks the page tables of every
    mapping: about 5 ms of CPU for a process that imported torch. They are refreshed at most
    every ``slow_refresh_s`` per process (the longest-waiting first) and carried over in
    between, and all refreshes together may use at most ``slow_budget`` of one core (0.001 =
    0.1 %), so a large job gets its PSS less often instead of a busy sampler. ``None`` lifts
    the cap. ``slow_pool``: a :class:`SlowBudget` shared with other readers, drawn from
    instead of a budget of this reader's own (``slow_budget`` then sets the pool's share).

    ``read(table)``: a :class:`~torchdoctor.sampling.procfs.ProcTable` shared by the readers
    of one refresh, for what every reader would otherwise read about the machine itself.
    """

    def __init__(
        self,
        root_pid: int,
        *,
        slow_refresh_s: float = 5.0,
        include_root: bool = True,
        slow_budget: float | None = 0.001,
        slow_pool: SlowBudget | None = None,
    ) -> None:
        self.root_pid = root_pid
        self.slow_refresh_s = slow_refresh_s
        self.include_root = include_root
        self._slow = slow_pool if slow_pool is not None else SlowBudget(slow_budget)
        self._procs: dict[int, _Proc] = {}
        self._outside: set[int] = set()  # PIDs known not to belong to the job
        self._outside_reset = time.monotonic() + _FULL_RESCAN_S
        self._loadavg_fd: int | None = None
        self._last_pid: int | None = None
        self._roles_dirty = True
        self._reinfo: set[int] = set()
        with contextlib.suppress(OSError):
            self._loadavg_fd = procfs.open_ro("/proc/loadavg")
        # Three descriptors per process are kept open; stay well inside the process's limit
        # (the recorder needs its own) and read the rest by path.
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft == resource.RLIM_INFINITY:
            soft = 1 << 20
        self._fd_budget = max(0, min(soft // 2, soft - 256))
        self._fds_kept = 0
        self._root_start: int | None = None
        self._root_fd: int | None = None
        try:
            self._root_fd = procfs.open_ro(f"/proc/{root_pid}/stat")
            st = procfs.parse_pid_stat(procfs.pread_single(self._root_fd, 1024))
            if st.state not in _DEAD_STATES:
                self._root_start = st.starttime
        except (OSError, ValueError, IndexError):
            self._close_root()

    # -- public ------------------------------------------------------------------------------

    @property
    def slow_budget(self) -> float | None:
        """The share of one core the slow tier may use (None: no cap)."""
        return self._slow.share

    @slow_budget.setter
    def slow_budget(self, share: float | None) -> None:
        self._slow.share = share

    def slow_waiting_since(self) -> float:
        """When the slow tier's longest-waiting process became due (monotonic; -1 for a
        process never read, or a reader that has read nothing yet): readers sharing a
        :class:`SlowBudget` read in this order, so that none is starved."""
        return min((p.slow_due for p in self._procs.values()), default=-1.0)

    @property
    def pids(self) -> set[int]:
        """PIDs of the job's live processes as of the last read (the root included when
        ``include_root``)."""
        return {pid for pid, p in self._procs.items() if self.include_root or not self._is_root(p)}

    def root_alive(self) -> bool:
        """Whether the root process still runs (a zombie root, exited but not yet reaped by
        its parent, counts as ended)."""
        if self._root_fd is None:
            return False
        try:
            st = procfs.parse_pid_stat(procfs.pread_single(self._root_fd, 1024))
        except (OSError, ValueError, IndexError):
            self._close_root()
            return False
        if st.state in _DEAD_STATES:
            self._close_root()
            return False
        return True

    def close(self) -> None:
        """Release the descriptors kept open between reads."""
        for p in self._procs.values():
            self._drop(p)
        self._procs.clear()
        self._close_root()
        if self._loadavg_fd is not None:
            os.close(self._loadavg_fd)
            self._loadavg_fd = None

    def read(
        self, table: procfs.ProcTable | None = None
    ) -> tuple[list[ProcessSample], list[ProcessInfo], list[int]]:
        t = time.time()
        mono = time.monotonic()
        procs = self._procs
        ended: list[int] = []
        # 1. Known processes: one stat read each tells whether they still run (the descriptor
        # fails once its process is gone, even if its PID was handed out again).
        for pid in list(procs):
            p = procs[pid]
            try:
                if p.kept:
                    st = procfs.parse_pid_stat(procfs.pread_single(p.stat_fd, 1024))
                else:
                    st = procfs.parse_pid_stat(procfs.read_path(f"/proc/{pid}/stat", 1024))
                    if st.starttime != p.starttime:
                        st = None  # the PID now belongs to another process
            except (OSError, ValueError, IndexError):
                st = None
            if st is None or st.state in _DEAD_STATES:
                self._drop(p)
                del procs[pid]
                ended.append(pid)
                if st is not None:
                    self._outside.add(pid)  # a zombie keeps its PID listed; do not rediscover it
                self._roles_dirty = True
                continue
            if st.ppid != p.stat.ppid:
                self._roles_dirty = True
            p.stat = st
            if st.comm != p.comm:
                self._exec_changed(p, st)

        if table is None:
            table = procfs.ProcTable(loadavg_fd=self._loadavg_fd)
        last_pid = table.last_pid
        listing: frozenset[int] | None = None
        if (
            last_pid is None
            or last_pid != self._last_pid
            or ended
            or mono >= self._outside_reset
            or not procs
        ):
            listing = table.pids

        # 2. New members: unclassified PIDs whose parent is in the job.
        new: list[_Proc] = []
        if listing is not None:
            new = self._discover(listing, table, mono, self._last_pid, last_pid)
            if new:
                self._roles_dirty = True
        self._last_pid = last_pid

        # 3. Fast fields, slow tier, roles.
        samples: list[ProcessSample] = []
        infos: list[ProcessInfo] = []
        gone_now = self._refresh_slow(mono)
        if self._roles_dirty:
            self._assign_roles()
            self._roles_dirty = False
        new_set = {p.pid for p in new}
        # Processes that exec'd are described again (new command line, role, rank).
        reinfo, self._reinfo = self._reinfo, set()
        shm_seen: set[tuple[int, int]] = set()  # /dev/shm files counted in this sample
        for pid, p in procs.items():
            if pid in gone_now:
                continue
            s = self._sample(p, t, mono)
            if s is None:
                gone_now.append(pid)
                continue
            if not self.include_root and self._is_root(p):
                continue
            _count_dev_shm(s, p, shm_seen)
            samples.append(s)
            if pid in new_set or pid in reinfo:
                infos.append(
                    ProcessInfo(
                        pid=p.pid,
                        ppid=p.ppid,
                        create_time=p.create_time,
                        name=p.name,
                        cmdline=p.cmdline,
                        role=p.role,
                        # Workers inherit their trainer's environment, RANK included.
                        rank=p.rank if p.role == roles.TRAINER else None,
                        local_rank=p.local_rank if p.role == roles.TRAINER else None,
                    )
                )
        for pid in gone_now:
            self._roles_dirty = True
            self._drop(procs.pop(pid))
            if pid not in new_set:
                ended.append(pid)
        if not self.include_root:
            ended = [pid for pid in ended if pid != self.root_pid]
        return samples, infos, ended

    # -- internals ---------------------------------------------------------------------------

    def _close_root(self) -> None:
        if self._root_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._root_fd)
            self._root_fd = None

    def _is_root(self, p: _Proc) -> bool:
        return p.pid == self.root_pid and p.starttime == self._root_start

    def _discover(
        self,
        listing: frozenset[int],
        table: procfs.ProcTable,
        mono: float,
        prev_last: int | None,
        last: int | None,
    ) -> list[_Proc]:
        procs = self._procs
        outside = self._outside
        if mono >= self._outside_reset:
            outside.clear()
            self._outside_reset = mono + _FULL_RESCAN_S
        else:
            outside &= listing
            if prev_last is not None and last is not None and outside:
                # PIDs handed out since the previous read may be reused ones: check them again.
                outside.difference_update(procfs.handed_out(outside, prev_last, last))
        unknown = listing - procs.keys() - outside
        if not unknown:
            return []
        found: dict[int, procfs.PidStat] = {}
        for pid in unknown:
            st = table.stat(pid)
            if st is None:
                continue  # gone already (or never readable): nothing to remember
            is_root = pid == self.root_pid and st.starttime == self._root_start
            if st.state in _DEAD_STATES or (pid == self.root_pid and not is_root):
                outside.add(pid)
                continue
            found[pid] = st
        # Attach candidates whose parent is in the job, until nothing changes (a new child of
        # a new child is attached in a later pass).
        added: list[_Proc] = []
        changed = True
        while changed and found:
            changed = False
            for pid in sorted(found):
                st = found[pid]
                if pid == self.root_pid or st.ppid in procs:
                    del found[pid]
                    p = self._new_proc(pid, st)
                    if p is None:
                        continue
                    procs[pid] = p
                    added.append(p)
                    changed = True
        outside.update(found)
        return added

    def _new_proc(self, pid: int, st: procfs.PidStat) -> _Proc | None:
        p = _Proc()
        p.pid = pid
        p.starttime = st.starttime
        p.create_time = procfs.started_at(st.starttime)
        p.ppid = st.ppid
        p.stat = st
        p.stat_fd = p.status_fd = p.io_fd = p.sched_fd = None
        p.sched_error = None
        p.kept = False
        p.io_error = None
        p.role = roles.OTHER
        p.prev_mono = None
        p.prev_cpu = p.prev_vol = p.prev_invol = p.prev_read = p.prev_write = None
        p.pss = p.uss = None
        p.pss_rss = 0
        p.shm_files = None
        p.shm_error = None
        p.smaps_error = None
        p.slow_due = -1.0
        if self._fds_kept + 3 <= self._fd_budget:
            try:
                p.stat_fd = procfs.open_ro(f"/proc/{pid}/stat")
                # The descriptor pins the process it was opened on: make sure that is still
                # the one classified above and not a successor with a reused PID.
                again = procfs.parse_pid_stat(procfs.pread_single(p.stat_fd, 1024))
                if again.starttime != st.starttime or again.state in _DEAD_STATES:
                    p.close()
                    return None
                p.status_fd = procfs.open_ro(f"/proc/{pid}/status")
            except OSError as e:
                p.close()
                if e.errno not in (errno.EMFILE, errno.ENFILE):
                    return None
                # Out of descriptors (the process holds more than the budget assumed): keep
                # no more open, give one process's back so reading by path has room, and
                # follow this process by path like those beyond the budget.
                self._release_one()
                self._fd_budget = self._fds_kept
                self._exec_changed(p, st)
                return p
            except (ValueError, IndexError):
                p.close()
                return None
            try:
                p.io_fd = procfs.open_ro(f"/proc/{pid}/io")
            except OSError as e:
                p.io_error = f"/proc/{pid}/io: {e.strerror or e}"
            p.kept = True
            self._fds_kept += 3
        self._exec_changed(p, st)
        return p

    def _release_one(self) -> None:
        for q in self._procs.values():
            if q.kept:
                self._drop(q)
                q.kept = False
                return

    def _drop(self, p: _Proc) -> None:
        if p.kept:
            self._fds_kept -= 3
        p.close()

    def _schedstat(self, p: _Proc) -> bytes:
        """/proc/<pid>/schedstat of a model process, through a descriptor kept beside the
        others where it has them (an open, read and close each sample cost more than the
        read: +44 µs a snapshot), else by path. Only a job's few model processes read it,
        so it stays outside the descriptor budget."""
        if p.kept and p.sched_fd is None:
            with contextlib.suppress(OSError):
                p.sched_fd = procfs.open_ro(f"/proc/{p.pid}/schedstat")
        return self._read(p, p.sched_fd, "schedstat", 128)

    def _read(self, p: _Proc, fd: int | None, name: str, size: int) -> bytes:
        """One /proc/<pid> file: through the kept descriptor, or by path for processes
        beyond the descriptor budget."""
        if fd is not None:
            return procfs.pread_single(fd, size)
        return procfs.read_path(f"/proc/{p.pid}/{name}", size)

    def _exec_changed(self, p: _Proc, st: procfs.PidStat) -> None:
        """(Re)read what changes only at exec: command line, name, RANK.

        A process first seen between fork and exec (a shell starting a trainer) shows its
        parent's command line; it is described again once it runs its own program.
        """
        if hasattr(p, "cmdline"):
            self._reinfo.add(p.pid)
            self._roles_dirty = True
        p.comm = st.comm
        try:
            p.cmdline = procfs.parse_cmdline(procfs.read_path(f"/proc/{p.pid}/cmdline"))
        except OSError:
            p.cmdline = []
        p.name = st.comm
        if len(st.comm) >= 15 and p.cmdline:
            # comm is cut at 15 characters; the program name in argv[0] is the full one.
            full = os.path.basename(p.cmdline[0])
            if full.startswith(st.comm):
                p.name = full
        p.traits = roles.Traits(p.cmdline)
        p.rank = p.local_rank = None
        if p.traits.python:
            try:
                env = procfs.parse_environ(procfs.read_path(f"/proc/{p.pid}/environ"), _ENV_NAMES)
            except OSError:
                env = {}
            p.rank = _int_or_none(env.get("RANK"))
            p.local_rank = _int_or_none(env.get("LOCAL_RANK"))

    def _assign_roles(self) -> None:
        procs = self._procs
        children: dict[int, list[_Proc]] = {}
        for p in procs.values():
            children.setdefault(p.stat.ppid, []).append(p)
        done: set[int] = set()

        def visit(p: _Proc) -> None:
            parent = procs.get(p.stat.ppid)
            if parent is not None and parent.pid not in done and parent is not p:
                done.add(p.pid)  # guards against a PPID cycle, which the kernel never makes
                visit(parent)
            kids = children.get(p.pid, ())
            if parent is None and not self._is_root(p):
                # Orphaned (reparented outside the job): keep the role it had.
                done.add(p.pid)
                return
            p.role = roles.classify(
                p.traits,
                p.cmdline,
                parent.role if parent is not None else None,
                parent.traits if parent is not None else None,
                parent.cmdline if parent is not None else None,
                bool(kids),
                any(roles.is_worker_like(k.traits, k.cmdline, p.cmdline) for k in kids),
            )
            done.add(p.pid)

        for p in list(procs.values()):
            if p.pid not in done:
                visit(p)

    def _refresh_slow(self, mono: float) -> list[int]:
        """Re-read PSS/USS of the processes due, within the CPU budget; returns the PIDs
        found gone on the way."""
        gone: list[int] = []
        slow = self._slow
        slow.refill(mono)
        due = [p for p in self._procs.values() if mono >= p.slow_due]
        if not due:
            return gone
        due.sort(key=lambda p: p.slow_due)  # never read first, then the longest waiting
        for p in due:
            if not slow.left():
                break
            cpu0 = time.thread_time()
            try:
                p.pss, p.uss = procfs.parse_smaps_rollup(
                    procfs.read_path(f"/proc/{p.pid}/smaps_rollup", 2048)
                )
                p.pss_rss = p.stat.rss_pages * procfs.PAGE_SIZE
                p.smaps_error = None
            except ProcessLookupError:
                gone.append(p.pid)
                continue
            except OSError as e:
                p.pss = p.uss = None
                p.smaps_error = f"/proc/{p.pid}/smaps_rollup: {e.strerror or e}"
            # The /dev/shm files it holds: with PSS, on the slow tier (a directory listing and
            # the maps file, too costly for every sample; shared memory changes with batches).
            try:
                p.shm_files = procfs.dev_shm_files(p.pid)
                p.shm_error = None
            except ProcessLookupError:
                gone.append(p.pid)
                continue
            except OSError as e:
                p.shm_files = None
                p.shm_error = f"/proc/{p.pid}/fd: {e.strerror or e}"
            # exec does not always change the name (python exec'ing python): compare the
            # command line too, now and then.
            with contextlib.suppress(OSError):
                cmdline = procfs.parse_cmdline(procfs.read_path(f"/proc/{p.pid}/cmdline"))
                if cmdline and cmdline != p.cmdline:
                    self._exec_changed(p, p.stat)
            p.slow_due = mono + self.slow_refresh_s
            slow.spend(time.thread_time() - cpu0)
        return gone

    def _sample(self, p: _Proc, t: float, mono: float) -> ProcessSample | None:
        st = p.stat
        unavailable: dict[str, str] = {}
        try:
            status = self._read(p, p.status_fd, "status", 4096)
            swap, vol, invol = procfs.parse_pid_status(status)
        except (OSError, ValueError):
            return None  # gone (or unreadable): no sample rather than a half-made one
        shmem = procfs.parse_rss_shmem(status)
        if shmem is None:
            unavailable["shmem"] = "no RssShmem in /proc/<pid>/status (Linux < 4.5)"
        read_b = write_b = None
        if p.io_error is None:
            try:
                read_b, write_b = procfs.parse_pid_io(self._read(p, p.io_fd, "io", 512))
            except (ProcessLookupError, FileNotFoundError):
                return None
            except (OSError, ValueError) as e:
                p.io_error = f"/proc/{p.pid}/io: {getattr(e, 'strerror', None) or e}"
                if p.io_fd is not None:
                    os.close(p.io_fd)
                    p.io_fd = None
        if p.io_error is not None:
            for name in ("read_bytes_per_s", "write_bytes_per_s", "read_bytes", "write_bytes"):
                unavailable[name] = p.io_error
        rss = st.rss_pages * procfs.PAGE_SIZE
        pss, uss = p.pss, p.uss
        if p.smaps_error is not None:
            unavailable["pss"] = unavailable["uss"] = p.smaps_error
        elif pss is None:
            unavailable["pss"] = unavailable["uss"] = _NOT_YET
        elif abs(rss - p.pss_rss) > max(_STALE_SHARE * p.pss_rss, _STALE_MIN_BYTES):
            # A process that grew (a trainer importing torch) would show its start-up PSS for
            # up to a refresh period: withhold it, and refresh it first when the budget allows.
            pss = uss = None
            unavailable["pss"] = unavailable["uss"] = (
                "stale: RSS changed since the last PSS reading (slower tier)"
            )
            p.slow_due = min(p.slow_due, mono)
        if swap is None:
            unavailable["swap"] = "no VmSwap in /proc/<pid>/status"
        run_delay = None
        if p.role in roles.COMPUTE and p.sched_error is None:
            try:
                run_delay = procfs.parse_schedstat(self._schedstat(p))
            except (OSError, ValueError) as e:
                # Not tried again for this process: a kernel without schedstat (no
                # CONFIG_SCHED_INFO) has none at any sample; a process that ended is dropped
                # by its next stat read.
                p.sched_error = f"/proc/{p.pid}/schedstat: {getattr(e, 'strerror', None) or e}"
        if p.sched_error is not None:
            unavailable["run_delay_s"] = p.sched_error

        cpu_ticks = st.utime + st.stime
        cpu_pct = vol_s = invol_s = read_s = write_s = None
        if p.prev_mono is not None:
            dt = mono - p.prev_mono
            if dt > 0:
                cpu_pct = max(0.0, (cpu_ticks - p.prev_cpu) / procfs.CLK_TCK / dt * 100.0)
                if vol is not None and p.prev_vol is not None:
                    vol_s = max(0.0, (vol - p.prev_vol) / dt)
                if invol is not None and p.prev_invol is not None:
                    invol_s = max(0.0, (invol - p.prev_invol) / dt)
                if read_b is not None and p.prev_read is not None:
                    read_s = max(0.0, (read_b - p.prev_read) / dt)
                if write_b is not None and p.prev_write is not None:
                    write_s = max(0.0, (write_b - p.prev_write) / dt)
        p.prev_mono = mono
        p.prev_cpu = cpu_ticks
        p.prev_vol, p.prev_invol, p.prev_read, p.prev_write = vol, invol, read_b, write_b
        p.ppid = st.ppid
        return ProcessSample(
            t=t,
            pid=p.pid,
            ppid=st.ppid,
            create_time=p.create_time,
            name=p.name,
            role=p.role,
            rank=p.rank if p.role == roles.TRAINER else None,
            cpu_percent=cpu_pct,
            cpu_user_s=st.utime / procfs.CLK_TCK,
            cpu_system_s=st.stime / procfs.CLK_TCK,
            rss=rss,
            pss=pss,
            uss=uss,
            swap=swap,
            threads=st.threads,
            ctx_voluntary_per_s=vol_s,
            ctx_involuntary_per_s=invol_s,
            read_bytes_per_s=read_s,
            write_bytes_per_s=write_s,
            read_bytes=read_b,
            write_bytes=write_b,
            unavailable=unavailable,
            shmem=shmem,
            run_delay_s=run_delay,
        )


def _count_dev_shm(s: ProcessSample, p: _Proc, seen: set[tuple[int, int]]) -> None:
    """The process's /dev/shm bytes, less the files another process of the job was already
    counted for in this sample (a worker and its trainer both hold a batch's file)."""
    if p.shm_files is None:
        s.unavailable["dev_shm"] = p.shm_error or "not read yet: read on the slower tier"
        return
    fresh = p.shm_files.keys() - seen
    s.dev_shm = sum(p.shm_files[k] for k in fresh)
    seen |= fresh


def _int_or_none(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return None
