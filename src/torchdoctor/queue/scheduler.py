"""The per-user scheduler: started on demand, one at a time, holding no state of its own.

It decides where waiting jobs go and starts each under its own supervisor, then forgets it:
the supervisor writes how the job ended. Killed at any moment (even with SIGKILL), it loses
nothing; the next one adopts the running jobs by PID and start time. After a reboot the jobs
that were running are marked lost and the queue is paused, so nothing starts unasked.

It sleeps in select(): woken by a client or a supervisor on its socket, every second while a
job waits for GPU memory or RAM that others may free, every few seconds while jobs run (to
notice a supervisor that vanished), and otherwise not at all until it leaves after a long idle.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import selectors
import signal
import subprocess
import sys
import time
import traceback

from torchdoctor.queue.environment import free_port
from torchdoctor.queue.machine import MachineReader, MachineState
from torchdoctor.queue.model import (
    ACTIVE,
    DONE,
    FAILED,
    LOST,
    PAUSED_KEY,
    QUEUED,
    STARTING,
    Job,
)
from torchdoctor.queue.paths import QueuePaths, queue_paths
from torchdoctor.queue.placement import Usage, order, plan
from torchdoctor.queue.processes import boot_id, is_alive, start_time
from torchdoctor.queue.protocol import answer, listen, peer_uid, read_message
from torchdoctor.queue.store import QueueStore, end_fields
from torchdoctor.run.process import group_members
from torchdoctor.sampling import procfs

IDLE_EXIT_S = 900.0  # an idle scheduler leaves after this long; the next command restarts it
POLL_WAITING_S = 1.0
POLL_RUNNING_S = 5.0


class AlreadyRunning(Exception):
    """Another scheduler holds this user's lock."""


class Scheduler:
    """``system``: the machine-wide scheduler (root), serving every user on its socket."""

    def __init__(self, paths: QueuePaths, *, system: bool = False) -> None:
        self.system = system
        if system:
            from torchdoctor.queue.system import make_system_paths

            make_system_paths(paths)
        else:
            paths.make()
        self.paths = paths
        self._lock = os.open(paths.lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock)
            raise AlreadyRunning from None
        self.store = QueueStore(paths.db)
        os.chmod(paths.db, 0o600)
        self.boot = boot_id()
        # Machine-wide, anyone may connect: who they are is the kernel's peer credential.
        self.server = listen(paths.socket, mode=0o666 if system else 0o600)
        self.store.set_meta(
            scheduler_pid=str(os.getpid()), scheduler_start=str(start_time(os.getpid()))
        )
        self._machine: MachineReader | None = None
        self._children: dict[int, subprocess.Popen] = {}  # job id -> its supervisor
        self._waiting_on_resources = False
        self._adopt()

    # -- the loop ---------------------------------------------------------------------------

    def serve(self, idle_exit_s: float = IDLE_EXIT_S) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self.server, selectors.EVENT_READ)
        idle_since = time.monotonic()
        self._pass()
        while True:
            busy = bool(self.store.jobs((QUEUED, *ACTIVE))) or bool(self._children)
            if busy:
                idle_since = time.monotonic()
                timeout = POLL_WAITING_S if self._waiting_on_resources else POLL_RUNNING_S
            elif idle_exit_s == float("inf"):
                timeout = None  # machine-wide: it serves until stopped
            else:
                timeout = idle_exit_s - (time.monotonic() - idle_since)
                if timeout <= 0:
                    return
            for _key, _ in selector.select(timeout):
                self._accept()
            self._pass()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except BlockingIOError:
                return
            with conn:
                conn.settimeout(2.0)
                try:
                    uid = peer_uid(conn)
                    if not self.system:
                        if uid != os.getuid():
                            continue  # another user: not a word
                        if read_message(conn) is not None:
                            answer(conn, {"ok": True, "pid": os.getpid()})
                        continue
                    try:
                        message = read_message(conn, strict=True)
                    except ValueError as exc:
                        answer(conn, {"ok": False, "error": str(exc)})
                        continue
                    answer(conn, self._serve(uid, message))
                except OSError:
                    continue

    def _serve(self, uid: int, message: object) -> dict:
        """One user's request to the machine-wide queue, run as that user's :class:`Queue`."""
        from torchdoctor.queue.client import Queue
        from torchdoctor.queue.system import serve_request

        queue = Queue(self.paths, caller=uid, store=self.store)
        queue.system = True
        queue._kick = lambda: None  # we are the scheduler: the pass after this request runs
        queue.config = self._config()
        try:
            return serve_request(queue, message)
        except Exception as exc:  # noqa: BLE001 - one bad request must not take the queue down
            traceback.print_exc()
            return {"ok": False, "error": f"internal error: {type(exc).__name__}: {exc}"}

    def _config(self):
        from torchdoctor.queue.system import QueueConfig, load_config

        if not self.system:
            return QueueConfig(busy_outside=None)  # a per-user queue: as before
        return load_config()

    def _pass(self) -> None:
        try:
            self._check_active()
            self._schedule()
        except Exception:  # noqa: BLE001 - one bad pass must not take the queue down
            traceback.print_exc()

    # -- jobs that run ----------------------------------------------------------------------

    def _adopt(self) -> None:
        """After a reboot: the jobs that ran are lost, and nothing queued starts unasked."""
        rebooted = False
        for job in self.store.jobs(ACTIVE):
            if job.boot_id != self.boot:
                rebooted = True
                self.store.update(
                    job.id,
                    only_if=ACTIVE,
                    **end_fields(LOST, "the machine restarted while it ran", None),
                )
        if rebooted and self.store.jobs((QUEUED,)):
            who = "root's " if self.system else ""
            self.store.set_meta(
                **{
                    PAUSED_KEY: f"the machine restarted; {who}`torchdoctor queue resume` starts "
                    "jobs again"
                }
            )

    def _check_active(self) -> None:
        for job in self.store.jobs(ACTIVE):
            if is_alive(job.supervisor_pid, job.supervisor_start):
                continue
            child = self._children.get(job.id)
            if job.supervisor_pid is None:
                if child is not None and child.poll() is None:
                    continue  # our supervisor is starting
                if child is not None:
                    self.store.update(
                        job.id,
                        only_if=(STARTING,),
                        unclaimed=True,
                        **end_fields(
                            FAILED,
                            f"its supervisor could not start (see {self.paths.scheduler_log})",
                            None,
                        ),
                    )
                else:  # placed by a scheduler that died before starting it: place it again
                    self.store.update(
                        job.id,
                        only_if=(STARTING,),
                        unclaimed=True,
                        state=QUEUED,
                        assigned_gpus=[],
                        assigned_cpus=[],
                        master_port=None,
                    )
                continue
            if is_alive(job.job_pid, job.job_start):
                continue  # its supervisor is gone but the job runs on: watch it
            self.store.update(
                job.id,
                only_if=ACTIVE,
                **end_fields(
                    LOST, "its supervisor was stopped before it could record the exit status", None
                ),
            )
        for job_id, child in list(self._children.items()):
            if child.poll() is not None:
                del self._children[job_id]

    # -- placing waiting jobs ---------------------------------------------------------------

    def _schedule(self) -> None:
        self._waiting_on_resources = False
        queued = self.store.jobs((QUEUED,))
        if not queued:
            return
        eligible = []
        for job in order(queued, self.store.jobs(ACTIVE), self.store.last_starts()):
            blocked = self._dependencies(job)
            if blocked is None:
                eligible.append(job)
            else:
                self._set_reason(job, blocked)
        paused = self.store.meta(PAUSED_KEY)
        if paused is not None:
            for job in eligible:
                self._set_reason(job, f"queue paused: {paused}")
            return
        held = [job for job in eligible if job.held]
        for job in held:
            self._set_reason(job, "paused by its owner: `torchdoctor queue resume ID` releases it")
        eligible = [job for job in eligible if not job.held]
        if not eligible:
            return
        machine = self._read_machine()
        running = self.store.jobs(ACTIVE)
        usage = measure_usage(running, machine)
        by_id = {job.id: job for job in eligible}
        try:
            config = self._config()
        except Exception as exc:  # noqa: BLE001 - a broken config must not stop the queue
            print(f"torchdoctor: {getattr(exc, 'message', exc)}; no per-user limits", flush=True)
            from torchdoctor.queue.system import QueueConfig

            config = QueueConfig(busy_outside=None)
        for decision in plan(
            machine,
            running,
            usage,
            eligible,
            limits=config.limit,
            last_start=self.store.last_starts(),
            busy_outside=config.busy_outside,
        ):
            job = by_id[decision.job_id]
            if decision.start:
                self._start(job, decision.gpus or [], decision.cpus or [], running)
            else:
                self._waiting_on_resources = True
                self._set_reason(job, decision.reason)

    def _dependencies(self, job: Job) -> str | None:
        """Why the job cannot start yet because of ``--after``; None when it may. A dependency
        that did not succeed fails the job here and now."""
        for dep_id in job.after:
            dep = self.store.get(dep_id)
            if dep is None or (dep.ended and dep.state != DONE):
                how = "does not exist" if dep is None else f"ended {dep.state}"
                if dep is not None and dep.exit_status is not None:
                    how += f" (exit status {dep.exit_status})"
                self.store.update(
                    job.id,
                    only_if=(QUEUED,),
                    **end_fields(FAILED, f"not started: job {dep_id} it runs after {how}", None),
                )
                return "failed"
            if not dep.ended:
                return f"waiting for job {dep_id} to finish"
        return None

    def _set_reason(self, job: Job, reason: str | None) -> None:
        if job.reason != reason:
            self.store.update(job.id, only_if=(QUEUED,), reason=reason)

    def _read_machine(self) -> MachineState:
        if self._machine is None:
            self._machine = MachineReader()
        return self._machine.read()

    def _start(self, job: Job, gpus: list[str], cpus: list[int], running: list[Job]) -> None:
        port = None
        if "MASTER_PORT" not in job.env:
            port = free_port({j.master_port for j in running if j.master_port is not None})
        placed = self.store.update(
            job.id,
            only_if=(QUEUED,),
            state=STARTING,
            assigned_gpus=gpus,
            assigned_cpus=cpus,
            master_port=port,
            boot_id=self.boot,
            reason=None,
            supervisor_pid=None,
            supervisor_start=None,
        )
        if not placed:
            return  # cancelled meanwhile
        job.state, job.assigned_gpus, job.assigned_cpus, job.master_port = (
            STARTING,
            gpus,
            cpus,
            port,
        )
        running.append(job)
        with open(self.paths.scheduler_log, "ab") as log:
            self._children[job.id] = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "torchdoctor.queue.supervisor",
                    str(job.id),
                    *([str(self.paths.state_dir)] if self.system else []),
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a signal to the scheduler's group is not the job's
                close_fds=True,
            )

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.server.close()
        if self._machine is not None:
            self._machine.close()
        self.store.close()
        os.close(self._lock)


def measure_usage(running: list[Job], machine: MachineState) -> dict[int, Usage]:
    """What each running job holds now: its processes' GPU memory (by process group), and its
    RSS when it declared a RAM need."""
    usage: dict[int, Usage] = {}
    groups = {job.job_pid: job.id for job in running if job.job_pid is not None}
    for job in running:
        usage[job.id] = Usage()
    for gpu in machine.gpus:
        for pid, used in gpu.processes.items():
            try:
                group = os.getpgid(pid)
            except OSError:
                continue
            job_id = groups.get(group)
            if job_id is not None:
                held = usage[job_id].vram
                held[gpu.uuid] = held.get(gpu.uuid, 0) + used
    for job in running:
        if job.mem is not None and job.job_pid is not None:
            usage[job.id].rss = sum(_rss(pid) for pid in group_members(job.job_pid))
    return usage


def _rss(pid: int) -> int:
    try:
        return procfs.parse_pid_stat(procfs.read_path(f"/proc/{pid}/stat")).rss_pages * (
            procfs.PAGE_SIZE
        )
    except (OSError, ValueError, IndexError):
        return 0


def serve_system() -> None:
    """``torchdoctor queue serve --system``: the machine-wide scheduler, in the foreground (a
    systemd service, or a test), until SIGTERM."""
    from torchdoctor.errors import UserError
    from torchdoctor.queue.system import system_paths

    if os.getuid() != 0:
        raise UserError(
            "the machine-wide scheduler starts jobs as their submitters: it must run as root"
        )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        scheduler = Scheduler(system_paths(), system=True)
    except AlreadyRunning:
        raise UserError("a machine-wide scheduler already serves this state folder") from None
    print(f"torchdoctor: machine-wide queue on {scheduler.paths.socket}", flush=True)
    try:
        scheduler.serve(float("inf"))
    finally:
        scheduler.close()


def main() -> None:
    """``python -m torchdoctor.queue.scheduler [READY_FD]``: become a daemon,
    then say on READY_FD whether this scheduler serves (``ok``), another one already does
    (``busy``), or why none can (``error: ...``)."""
    ready = int(sys.argv[1]) if len(sys.argv) > 1 else None
    if os.fork() > 0:  # the starter reaps this one at once; the scheduler is nobody's child
        os._exit(0)
    os.setsid()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    paths = queue_paths()

    def say(text: str) -> None:
        nonlocal ready
        if ready is not None:
            with contextlib.suppress(OSError):
                os.write(ready, text.encode())
                os.close(ready)
            ready = None

    try:
        scheduler = Scheduler(paths)
    except AlreadyRunning:
        say("busy")
        return
    except Exception as exc:  # noqa: BLE001 - told to the client as one line
        say(f"error: {getattr(exc, 'message', None) or exc}")
        raise SystemExit(1) from None
    say("ok")
    try:
        idle = float(os.environ.get("TORCHDOCTOR_QUEUE_IDLE_EXIT_S", IDLE_EXIT_S))
        scheduler.serve(idle)
    finally:
        scheduler.close()


if __name__ == "__main__":
    main()
