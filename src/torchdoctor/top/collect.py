"""One refresh of ``torchdoctor top``: reads host, GPUs and every PyTorch job into TopReadings.

The readers are the recorder's own (:mod:`torchdoctor.sampling`), so ``top`` and a recording
agree on every figure. One :class:`~torchdoctor.sampling.job.JobReader` follows each job found
by :mod:`torchdoctor.top.discover`; readers of jobs that ended are closed.
"""

from __future__ import annotations

import os
import pwd
import socket
import time
from collections import deque

from torchdoctor.recording import registry
from torchdoctor.sampling import procfs
from torchdoctor.sampling.gpus import GpuReader
from torchdoctor.sampling.host import HostReader
from torchdoctor.sampling.job import JobReader, SlowBudget
from torchdoctor.sampling.types import ProcessInfo
from torchdoctor.thresholds import Thresholds
from torchdoctor.top.discover import TorchProcessFinder
from torchdoctor.top.model import (
    ENV_OF_INTEREST,
    JobReading,
    ProcessDetail,
    ProcessHistory,
    TopReadings,
    env_of_interest,
)
from torchdoctor.top.recordings import RecordingWatcher

HISTORY = 120  # samples kept per process for the detail sparklines
# PSS comes from smaps_rollup, which costs the kernel ~5 ms for a trainer (a walk of all its
# mappings): all jobs together may spend this share of one core on it, from one bucket (a
# bucket per job let 100 jobs spend 100 start-up bursts at once: 5 % of a core for a minute).
PSS_CPU_SHARE = 0.003
# ... except at the first refresh, when every job's processes get their first PSS at once (~3
# ms each for a process that imported torch: 300 of them in 1 s); later jobs share the burst.
PSS_FIRST_S = 1.0
# Each JobReader re-checks every PID on the machine for new members of its job this often
# (in case a PID was reused) and refreshes PSS no more often than this: slower than the
# recorder's tier, since a live view reads every job on the machine.
JOB_SLOW_REFRESH_S = 15.0
REGISTRY_EVERY_S = 5.0  # stale entries are pruned this often; new ones are seen at once


class _History:
    __slots__ = ("cpu", "rss", "vram")

    def __init__(self) -> None:
        self.cpu: deque[float | None] = deque(maxlen=HISTORY)
        self.rss: deque[float | None] = deque(maxlen=HISTORY)
        self.vram: deque[float | None] = deque(maxlen=HISTORY)


class TopCollector:
    """Reads everything ``top`` shows. Call :meth:`read` once per refresh.

    ``gpu_reader`` defaults to a :class:`GpuReader` of the real ``pynvml``.
    """

    def __init__(
        self,
        thresholds: Thresholds,
        *,
        interval_s: float = 1.0,
        gpu_reader: GpuReader | None = None,
    ) -> None:
        self.interval_s = interval_s
        self.host = HostReader()
        self.gpu = gpu_reader if gpu_reader is not None else GpuReader()
        self.finder = TorchProcessFinder()
        self._slow = SlowBudget(PSS_CPU_SHARE, tokens=PSS_FIRST_S)  # every job's readers
        self.recordings = RecordingWatcher(thresholds)
        self._jobs: dict[int, JobReader] = {}  # by root PID
        self._history: dict[int, _History] = {}
        self._infos: dict[int, ProcessInfo] = {}  # every live job process, by PID
        self._registry: list[registry.RegistryEntry] = []
        self._registry_due = 0.0
        self._registry_mtime: int | None = None
        self._hostname = socket.gethostname()
        self._uid = os.getuid()

    def close(self) -> None:
        for reader in self._jobs.values():
            reader.close()
        self._jobs.clear()
        self.gpu.close()
        self.host.close()
        self.recordings.close()

    def read(self, detail_pid: int | None = None) -> TopReadings:
        t = time.time()
        host = self.host.read()
        table = procfs.ProcTable()  # what every reader of this refresh reads about /proc
        found = self.finder.scan(table)
        notes: list[str] = []

        jobs: list[JobReading] = []
        roots = set(found.roots)
        for root in list(self._jobs):
            if root not in roots or not self._jobs[root].root_alive():
                self._jobs.pop(root).close()
        for root in found.roots:
            if root not in self._jobs:
                try:
                    reader = JobReader(
                        root, slow_refresh_s=JOB_SLOW_REFRESH_S, slow_pool=self._slow
                    )
                except OSError:
                    continue  # gone between the scan and now
                self._jobs[root] = reader
        infos = self._infos
        # The readers share the PSS budget: the one whose process has waited longest for its
        # PSS reads first, so that no job's PSS waits behind others' for ever.
        order = sorted(self._jobs.items(), key=lambda item: item[1].slow_waiting_since())
        read = {root: reader.read(table) for root, reader in order}
        self._slow.trim()  # the start's allowance is for the first refresh's readings only
        for root in sorted(read):
            samples, new_infos, ended = read[root]
            for info in new_infos:
                infos[info.pid] = info
            for pid in ended:
                infos.pop(pid, None)
            if samples:
                jobs.append(
                    JobReading(
                        root_pid=root,
                        processes=samples,
                        info={p.pid: infos[p.pid] for p in samples if p.pid in infos},
                    )
                )

        all_pids = {p.pid for job in jobs for p in job.processes}
        gpus, gpu_procs = self.gpu.read(all_pids)
        if self.gpu.status.available and gpus:
            # NVML lists every process holding GPU memory, so one absent from the lists holds
            # none: a measured zero (as the recorder's Sampler does).
            vram: dict[int, int] = {}
            for gp in gpu_procs:
                if gp.local_pid is not None and gp.used_memory is not None:
                    vram[gp.local_pid] = vram.get(gp.local_pid, 0) + gp.used_memory
            # ... unless some PIDs could not be mapped (own PID namespace): then a process
            # missing from the map may be one of those, and its VRAM is unknown, not zero.
            absent = None if any(gp.local_pid is None for gp in gpu_procs) else 0
            for job in jobs:
                for p in job.processes:
                    p.gpu_memory = vram.get(p.pid, absent)

        names = {
            gp.local_pid: _comm(gp.local_pid)
            for gp in gpu_procs
            if gp.local_pid is not None and gp.local_pid not in all_pids
        }
        self._attach_recordings(jobs, found.ppid, notes)
        self._update_history(jobs)
        if found.unreadable and self._uid != 0:
            notes.append(
                f"{found.unreadable} processes of other users cannot be inspected for PyTorch "
                "(run as root to see every job)"
            )
        detail = self._detail(detail_pid, all_pids) if detail_pid is not None else None
        return TopReadings(
            t=t,
            interval_s=self.interval_s,
            hostname=self._hostname,
            host=host,
            usable_cpus=len(self.host.allowed_cpus),
            gpu_status=self.gpu.status,
            gpus=gpus,
            gpu_processes=gpu_procs,
            jobs=jobs,
            # Only an open detail shows history: copy that one, not every process's.
            history={
                pid: ProcessHistory(list(h.cpu), list(h.rss), list(h.vram))
                for pid, h in self._history.items()
                if pid == detail_pid
            },
            detail=detail,
            notes=notes,
            process_names={pid: name for pid, name in names.items() if name is not None},
        )

    # -- internals ------------------------------------------------------------------------

    def _attach_recordings(
        self, jobs: list[JobReading], ppid: dict[int, int], notes: list[str]
    ) -> None:
        try:
            entries = self._registry_entries()
        except OSError as exc:
            notes.append(f"recordings of `torchdoctor run` not shown: {exc}")
            return
        by_pid = {e.pid: e for e in entries}
        recorded: list[tuple[JobReading, registry.RegistryEntry]] = []
        for job in jobs:
            entry = None
            for p in job.processes:
                entry = by_pid.get(p.pid)
                if entry is not None:
                    break
            if entry is None:
                # ``torchdoctor run`` may have registered itself, the parent of the job's root.
                parent = ppid.get(job.root_pid)
                for _ in range(4):
                    if parent is None or parent <= 1:
                        break
                    entry = by_pid.get(parent)
                    if entry is not None:
                        break
                    parent = ppid.get(parent)
            if entry is not None:
                recorded.append((job, entry))
        # Every recording followed shares the diagnosis' CPU budget: counted before the first
        # status (counting them one by one gave the first ones most of the budget).
        followed = len({entry.recording_path for _, entry in recorded})
        for job, entry in recorded:
            job.recording = self.recordings.status(entry.recording_path, followed=followed)
        self.recordings.forget_except({entry.recording_path for _, entry in recorded})

    def _registry_entries(self) -> list[registry.RegistryEntry]:
        """registry.active(), re-read when an entry was added or removed, else every few s."""
        try:
            mtime = os.stat(registry.registry_dir()).st_mtime_ns
        except FileNotFoundError:
            mtime = None
        now = time.monotonic()
        if mtime != self._registry_mtime or now >= self._registry_due:
            self._registry = registry.active()
            self._registry_due = now + REGISTRY_EVERY_S
            # Pruning changes the folder: take its time after active().
            try:
                self._registry_mtime = os.stat(registry.registry_dir()).st_mtime_ns
            except FileNotFoundError:
                self._registry_mtime = None
        return self._registry

    def _update_history(self, jobs: list[JobReading]) -> None:
        live = set()
        for job in jobs:
            for p in job.processes:
                live.add(p.pid)
                h = self._history.get(p.pid)
                if h is None:
                    h = self._history[p.pid] = _History()
                h.cpu.append(p.cpu_percent)
                h.rss.append(float(p.rss))
                h.vram.append(float(p.gpu_memory) if p.gpu_memory is not None else None)
        for pid in self._history.keys() - live:
            del self._history[pid]

    def _detail(self, pid: int, job_pids: set[int]) -> ProcessDetail | None:
        if pid not in job_pids:
            return None
        return read_process_detail(pid, self._uid)


def _comm(pid: int) -> str | None:
    name = procfs.read_text(f"/proc/{pid}/comm")
    return name or None


def read_process_detail(pid: int, uid: int | None = None) -> ProcessDetail | None:
    """Command line, owner and environment of interest of one process (None if it is gone)."""
    uid = os.getuid() if uid is None else uid
    try:
        cmdline = procfs.parse_cmdline(procfs.read_path(f"/proc/{pid}/cmdline"))
        st = procfs.parse_pid_stat(procfs.read_path(f"/proc/{pid}/stat", 1024))
        owner = os.stat(f"/proc/{pid}").st_uid
    except (OSError, ValueError, IndexError):
        return None
    try:
        username = pwd.getpwuid(owner).pw_name
    except KeyError:
        username = str(owner)
    env: dict[str, str] | None = None
    env_unavailable = None
    try:
        raw = procfs.read_path(f"/proc/{pid}/environ", 16384)
        names = tuple(
            {*ENV_OF_INTEREST}
            | {
                item.split(b"=", 1)[0].decode("utf-8", "replace")
                for item in raw.split(b"\0")
                if b"=" in item
            }
        )
        env = env_of_interest(procfs.parse_environ(raw, names))
    except PermissionError:
        env_unavailable = "environment not readable: the process belongs to another user"
    except OSError as exc:
        env_unavailable = f"environment not readable: {exc.strerror or exc}"
    try:
        affinity: list[int] | None = sorted(os.sched_getaffinity(pid))
    except OSError:
        affinity = None
    return ProcessDetail(
        pid=pid,
        cmdline=cmdline,
        username=username,
        own=uid == 0 or owner == uid,
        state=st.state,
        create_time=procfs.started_at(st.starttime),
        env=env,
        env_unavailable=env_unavailable,
        cpu_affinity=affinity,
    )
