"""What the commands do: submit, cancel, pause, wait... against the state file, waking (and if
need be starting) this user's scheduler through its socket."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchdoctor.errors import UserError
from torchdoctor.queue.machine import MachineReader, MachineState
from torchdoctor.queue.model import (
    ACTIVE,
    CANCELLED,
    FAILED,
    PAUSED_KEY,
    QUEUED,
    TERMINAL,
    Job,
    check_name,
    check_priority,
)
from torchdoctor.queue.paths import QueuePaths, queue_paths
from torchdoctor.queue.processes import is_alive
from torchdoctor.queue.protocol import request
from torchdoctor.queue.store import QueueStore, end_fields
from torchdoctor.run.process import ProcessTree, TreeStopper
from torchdoctor.units import fmt_bytes

SCHEDULER_START_TIMEOUT_S = 30.0
WAIT_POLL_S = 0.1


@dataclass(slots=True)
class Request:
    """What ``torchdoctor submit`` asks for, as given (sizes already in bytes)."""

    argv: list[str]
    cwd: str
    env: dict[str, str]
    name: str
    gpus: int = 0
    gpu_ids: list[str] | None = None  # UUIDs or NVML indexes as typed
    vram: int | None = None
    vram_source: str | None = None
    cpus: int = 1
    mem: int | None = None
    mem_source: str | None = None
    priority: int = 0
    after: list[int] | None = None
    # Where the job's log and recording go (the submitter's own folders); default: the queue's.
    log_dir: str | None = None
    recording_dir: str | None = None


class Queue:
    """A queue's state acted on by one caller: this user's own queue (``paths`` default to the
    XDG folders of our environment), or, inside the machine-wide scheduler, the machine's
    queue on behalf of the user ``caller`` (the uid the kernel gave for the request)."""

    system = False
    config: Any = None  # the admin's limits (machine-wide), a QueueConfig

    def __init__(
        self,
        paths: QueuePaths | None = None,
        *,
        caller: int | None = None,
        store: QueueStore | None = None,
    ) -> None:
        self.paths = paths or queue_paths()
        self.caller = os.getuid() if caller is None else caller
        if store is None:
            self.paths.make()
            store = QueueStore(self.paths.db)
            self._own_store = True
        else:
            self._own_store = False
        self.store = store
        self._kick = self._kick_scheduler

    def close(self) -> None:
        if self._own_store:
            self.store.close()

    def __enter__(self) -> Queue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- submitting -------------------------------------------------------------------------

    def submit(self, req: Request, machine: MachineState | None = None) -> Job:
        """Check the request against the machine, store it, wake the scheduler; the job.

        A command that cannot be found is stored as failed with status 127 (126: not
        executable) and raised as a UserError carrying the job id."""
        from torchdoctor.run.process import resolve_command

        # Before anything is read or stored: the store cannot hold a priority beyond 64 bits,
        # and a name is one line of the queue's table (a request may come from another user).
        check_priority(req.priority)
        check_name(req.name)
        if machine is None:
            reader = MachineReader()
            try:
                machine = reader.read()
            finally:
                reader.close()
        gpu_ids = check_request(req, machine)
        for dep in req.after or []:
            if self.store.get(dep) is None:
                raise UserError(f"--after {dep}: there is no job {dep} in your queue")
        uid, user, gid = self.caller, *_user(self.caller)
        if self.config is not None:
            limit = self.config.limit(user)
            for kind, asked, most in (
                ("cpus", req.cpus, limit.cpus),
                ("gpus", len(gpu_ids or []) or req.gpus, limit.gpus),
            ):
                if most is not None and asked > most:
                    raise UserError(
                        f"--{kind} {asked}: {user or uid} may use at most {most} at once on this "
                        f"machine (the admin's limit in {self.config.path}); ask for at most {most}"
                    )
        job = Job(
            id=0,
            name=req.name,
            argv=list(req.argv),
            env=dict(req.env),
            cwd=req.cwd,
            submitted_at=time.time(),
            priority=req.priority,
            after=list(req.after or []),
            gpus=len(gpu_ids) if gpu_ids else req.gpus,
            gpu_ids=gpu_ids,
            vram=req.vram,
            vram_source=req.vram_source,
            cpus=req.cpus,
            mem=req.mem,
            mem_source=req.mem_source,
            uid=uid,
            user=user,
            gid=gid,
        )
        not_found: UserError | None = None
        if uid == os.getuid():  # another user's command is looked for as that user, at start
            try:
                resolve_command(job.argv, env=job.env, cwd=job.cwd)
            except UserError as exc:
                not_found = exc
                job.state, job.reason, job.exit_status = FAILED, exc.message, exc.exit_code
                job.ended_at = job.submitted_at
        job.id = self.store.add(job)
        logs = Path(req.log_dir) if req.log_dir else self.paths.log(job.id).parent
        recordings = (
            Path(req.recording_dir)
            if req.recording_dir
            else self.paths.recording(job.id, "x").parent
        )
        self.store.update(
            job.id,
            log=str(logs / f"{job.id}.log"),
            recording=str(recordings / f"{job.id}-{_file_name(job.name)}.sqlite"),
        )
        if not_found is not None:
            raise UserError(
                f"{not_found.message}; job {job.id} recorded as failed (status {not_found.exit_code})",
                exit_code=not_found.exit_code,
            )
        self.kick()
        return self.store.get(job.id) or job

    # -- acting on jobs ---------------------------------------------------------------------

    def job(self, job_id: int) -> Job:
        job = self.store.get(job_id)
        if job is None:
            raise UserError(
                f"there is no job {job_id} in {self._where} (`torchdoctor queue` lists them)"
            )
        return job

    @property
    def _where(self) -> str:
        return "the machine's queue" if self.system else "your queue"

    def own(self, job_id: int, action: str) -> Job:
        """The job, when the caller may ``action`` it: their own, or anyone's for root."""
        job = self.job(job_id)
        if self.caller != 0 and job.uid is not None and job.uid != self.caller:
            raise UserError(
                f"job {job_id} is {job.user or f'uid {job.uid}'}'s: you may {action} only "
                "your own jobs"
            )
        return job

    def cancel(self, job_id: int, grace_s: float = 10.0, wait: bool = True) -> Job:
        """Cancel a job: a waiting one never starts; a running one gets TERM on its whole
        process group, then KILL after ``grace_s``. Returns it once it has ended."""
        job = self.own(job_id, "cancel")
        if job.ended:
            raise UserError(f"job {job_id} has already ended ({job.state}); nothing to cancel")
        if job.state == QUEUED and self.store.update(
            job_id, only_if=(QUEUED,), **end_fields(CANCELLED, "cancelled before it started", None)
        ):
            self.kick()
            return self.job(job_id)
        self.store.update(job_id, only_if=ACTIVE, cancel_requested=True, cancel_grace_s=grace_s)
        job = self.job(job_id)
        if is_alive(job.supervisor_pid, job.supervisor_start):
            os.kill(job.supervisor_pid, signal.SIGTERM)  # it stops the group, then records it
        elif job.job_pid is not None and is_alive(job.job_pid, job.job_start):
            # Its supervisor is gone (killed): stop the group ourselves.
            stopper = TreeStopper(ProcessTree(job.job_pid), grace_s)
            stopper.start()
            deadline = time.monotonic() + grace_s + 5.0
            while is_alive(job.job_pid, job.job_start) and time.monotonic() < deadline:
                time.sleep(WAIT_POLL_S)
            stopper.cancel()
            self.store.update(
                job_id,
                only_if=ACTIVE,
                **end_fields(CANCELLED, "cancelled; exit status unknown", None),
            )
        if not wait:
            return self.job(job_id)
        return self.wait(job_id, timeout_s=grace_s + 30.0)

    def wait(self, job_id: int, timeout_s: float | None = None) -> Job:
        """Block until the job has ended; the job."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        kicked = False
        while True:
            job = self.job(job_id)
            if job.ended:
                return job
            if not kicked:  # someone has to move the queue along
                self.kick()
                kicked = True
            if deadline is not None and time.monotonic() > deadline:
                raise UserError(f"job {job_id} is still {job.state} after {timeout_s:g} s")
            time.sleep(WAIT_POLL_S)

    def pause(self) -> None:
        self._machine_wide("pause the whole queue")
        self.store.set_meta(**{PAUSED_KEY: "paused by `torchdoctor queue pause`"})
        self.kick()

    def resume(self) -> None:
        self._machine_wide("resume the whole queue")
        self.store.set_meta(**{PAUSED_KEY: None})
        self.kick()

    def _machine_wide(self, action: str) -> None:
        if self.system and self.caller != 0:
            raise UserError(
                f"only root may {action} on a machine-wide queue; "
                "give a job id to pause or resume one of your own jobs"
            )

    def hold(self, job_id: int) -> Job:
        """Keep a waiting job from starting until :meth:`release`."""
        job = self.own(job_id, "pause")
        if not self.store.update(job_id, only_if=(QUEUED,), held=True, reason="paused"):
            raise UserError(f"job {job_id} is {job.state}: only a waiting job can be paused")
        self.kick()
        return self.job(job_id)

    def release(self, job_id: int) -> Job:
        job = self.own(job_id, "resume")
        if not self.store.update(job_id, only_if=(QUEUED,), held=False, reason=None):
            raise UserError(f"job {job_id} is {job.state}: only a paused waiting job resumes")
        self.kick()
        return self.job(job_id)

    def set_priority(self, job_id: int, priority: int) -> Job:
        """A waiting job's place among its owner's jobs (higher starts first)."""
        check_priority(priority)
        job = self.own(job_id, "change the priority of")
        if not self.store.update(job_id, only_if=(QUEUED,), priority=priority):
            raise UserError(
                f"job {job_id} is {job.state}: only a waiting job's priority can change"
            )
        self.kick()
        return self.job(job_id)

    def restart(self, job_id: int) -> Job:
        """Queue an ended job again: the same command, folder, environment and needs, as a
        new job (the old one and its log stay as they were)."""
        old = self.own(job_id, "restart")
        if not old.ended:
            raise UserError(f"job {job_id} is {old.state}: only an ended job can be restarted")
        job = dataclasses.replace(
            old,
            id=0,
            state=QUEUED,
            submitted_at=time.time(),
            after=[],
            held=False,
            restarted_from=old.id,
            **{f: None for f in _RUN_FIELDS},
            **{f: [] for f in ("assigned_gpus", "assigned_cpus")},
            cancel_requested=False,
        )
        job.id = self.store.add(job)
        logs = Path(old.log).parent if old.log else self.paths.log(job.id).parent
        recordings = (
            Path(old.recording).parent
            if old.recording
            else self.paths.recording(job.id, "x").parent
        )
        self.store.update(
            job.id,
            log=str(logs / f"{job.id}.log"),
            recording=str(recordings / f"{job.id}-{_file_name(job.name)}.sqlite"),
        )
        self.kick()
        return self.job(job.id)

    def clean(
        self, older_than_s: float | None = None, states: tuple[str, ...] = TERMINAL
    ) -> list[int]:
        """Forget ended jobs (in ``states``, ended more than ``older_than_s`` ago): the
        caller's own (root: everyone's). Their logs and recordings stay. The ids removed."""
        now = time.time()
        gone = [
            job.id
            for job in self.store.jobs(tuple(s for s in states if s in TERMINAL))
            if (self.caller == 0 or job.uid in (None, self.caller))
            and (older_than_s is None or (job.ended_at or now) <= now - older_than_s)
        ]
        self.store.delete(gone)
        return gone

    def last_finished(self, argv: list[str]) -> Job | None:
        """The caller's last successful run of this command (what ``auto`` sizes from)."""
        return self.store.last_finished(argv, uid=self.caller if self.system else None)

    @property
    def paused(self) -> str | None:
        return self.store.meta(PAUSED_KEY)

    def jobs(self) -> list[Job]:
        """Every job; a queue with work left gets its scheduler back if it was gone."""
        jobs = self.store.jobs()
        if any(not j.ended for j in jobs):
            self.kick()
        return jobs

    # -- the scheduler ----------------------------------------------------------------------

    def kick(self) -> None:
        self._kick()

    def _kick_scheduler(self) -> int:
        """Wake the scheduler (starting it when none runs); its PID."""
        try:
            return int(request(self.paths.socket, {"op": "kick"})["pid"])
        except (OSError, ValueError, KeyError):
            pass
        deadline = time.monotonic() + SCHEDULER_START_TIMEOUT_S
        while True:
            said = self._start_scheduler()
            try:
                return int(request(self.paths.socket, {"op": "kick"})["pid"])
            except (OSError, ValueError, KeyError):
                if said.startswith("error: "):
                    raise UserError(said[len("error: ") :]) from None
                if time.monotonic() > deadline:
                    raise UserError(
                        f"the queue's scheduler did not start; see {self.paths.scheduler_log}"
                    ) from None
                time.sleep(0.05)  # "busy": another one is binding its socket right now

    def _start_scheduler(self) -> str:
        read, write = os.pipe()
        try:
            with open(self.paths.scheduler_log, "ab") as log:
                starter = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "torchdoctor.queue.scheduler",
                        str(write),
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    pass_fds=(write,),
                    start_new_session=True,
                )
            os.close(write)
            write = -1
            chunks = []
            while chunk := os.read(read, 4096):
                chunks.append(chunk)
            starter.wait()
            return b"".join(chunks).decode("utf-8", "replace")
        finally:
            os.close(read)
            if write >= 0:
                os.close(write)


# What a run leaves in a job: a restarted job starts without it.
_RUN_FIELDS = (
    "reason", "started_at", "ended_at", "exit_status", "master_port", "boot_id",
    "supervisor_pid", "supervisor_start", "job_pid", "job_start", "recording", "log",
    "used_vram", "used_rss", "used_cores",
)  # fmt: skip


def _user(uid: int) -> tuple[str | None, int | None]:
    """The user's name and primary group, from the password database."""
    import pwd

    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        return None, None
    return entry.pw_name, entry.pw_gid


def check_request(req: Request, machine: MachineState) -> list[str] | None:
    """Refuse what this machine can never give; the UUIDs of GPUs asked for by name."""
    if req.cpus < 1:
        raise UserError("--cpus must be at least 1")
    if req.cpus > machine.max_cores:
        raise UserError(
            f"--cpus {req.cpus}: you may use {machine.max_cores} core(s) here "
            f"(CPUs {_cpus(machine.cpus)}); ask for at most {machine.max_cores}"
        )
    if req.mem is not None and req.mem > machine.mem_total:
        raise UserError(
            f"--mem {fmt_bytes(req.mem)}: this machine has {fmt_bytes(machine.mem_total)} of RAM"
        )
    gpu_ids = None
    if req.gpu_ids:
        gpu_ids = [_find_gpu(name, machine) for name in req.gpu_ids]
        if len(set(gpu_ids)) != len(gpu_ids):
            raise UserError("--gpu names the same GPU twice")
        wanted = [machine.gpu(u) for u in gpu_ids]
    elif req.gpus:
        if req.gpus > len(machine.gpus):
            raise UserError(f"--gpus {req.gpus}: {_gpus_here(machine)}")
        wanted = sorted(machine.gpus, key=lambda g: -g.total)[: req.gpus]
    else:
        wanted = []
    if req.vram is not None and not wanted:
        raise UserError("--vram needs GPUs: add --gpus N or --gpu ID")
    for g in wanted:
        if g is not None and req.vram is not None and req.vram > g.total:
            raise UserError(
                f"--vram {fmt_bytes(req.vram)} can never fit: GPU {g.index} ({g.name}) has "
                f"{fmt_bytes(g.total)} in all"
            )
    return gpu_ids


def _find_gpu(name: str, machine: MachineState) -> str:
    for g in machine.gpus:
        if name in (g.uuid, str(g.index)) or (len(name) >= 8 and g.uuid.startswith(name)):
            return g.uuid
    raise UserError(f"--gpu {name}: no such GPU; {_gpus_here(machine)}")


def _gpus_here(machine: MachineState) -> str:
    if not machine.gpus:
        return f"this machine has no GPU ({machine.gpu_reason or 'NVML sees none'})"
    listed = ", ".join(
        f"{g.index} ({g.uuid}, {g.name}, {fmt_bytes(g.total)})" for g in machine.gpus
    )
    return f"this machine has {len(machine.gpus)} GPU(s): {listed}"


def _cpus(cpus: list[int]) -> str:
    from torchdoctor.units import fmt_cpu_list

    return fmt_cpu_list(cpus)


def _file_name(name: str) -> str:
    import re

    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("._") or "job"


def last_run_of(argv: list[str], paths: QueuePaths | None = None) -> Job | None:
    """The queue's last successful run of exactly this command (its recording, measured
    peaks), or None. For other parts of torchdoctor that size a job from its history."""
    paths = paths or queue_paths()
    if not Path(paths.db).exists():
        return None
    store = QueueStore(paths.db)
    try:
        return store.last_finished(argv)
    finally:
        store.close()
