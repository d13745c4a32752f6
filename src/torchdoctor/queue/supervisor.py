"""One job's supervisor: starts the command where the scheduler placed it, records it with
torchdoctor's recorder and writes how it ended into the queue's state.

It is the job's parent and its process group's keeper: a cancel (SIGTERM to the supervisor)
sends TERM to the whole group and KILL after the grace period; as a child subreaper it also
gets every orphan of the job, so nothing the job started outlives it. The scheduler may die
meanwhile: the supervisor does not need it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

from torchdoctor.errors import UserError
from torchdoctor.queue.environment import job_environment
from torchdoctor.queue.model import CANCELLED, DONE, FAILED, RUNNING, STARTING, Job
from torchdoctor.queue.paths import QueuePaths, queue_paths
from torchdoctor.queue.processes import become_subreaper, reap_children, start_time
from torchdoctor.queue.protocol import request
from torchdoctor.queue.store import QueueStore, end_fields
from torchdoctor.run.process import ProcessTree, TreeStopper

LEFTOVER_GRACE_S = 2.0  # for processes the job left behind when its main process ended
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def supervise(job_id: int, state_dir: str | None = None) -> int:
    """Run queued job ``job_id`` to its end; 0, or 1 when the job was not ours to run.
    ``state_dir``: the queue's state folder (default: this user's)."""
    system = state_dir is not None  # the machine-wide queue's folder, from its scheduler
    paths = QueuePaths(Path(state_dir), Path(state_dir)) if system else queue_paths()
    store = QueueStore(paths.db)
    me, my_start = os.getpid(), start_time(os.getpid())
    if not store.update(
        job_id,
        only_if=(STARTING,),
        unclaimed=True,
        supervisor_pid=me,
        supervisor_start=my_start,
    ):
        return 1  # cancelled, or taken by another supervisor
    job = store.get(job_id)
    assert job is not None
    if job.recording is None:  # a job stored without one: the queue's own folder
        job.recording = str(paths.recording(job.id, job.name))
    if job.uid is not None and job.uid != os.getuid():
        state, reason, status, used = _run_as_owner(job, store)
    elif job.uid is None and system:
        # A machine-wide job that names no submitter: nothing runs as root unasked.
        state, reason, status, used = FAILED, "it names no submitter; not run", None, {}
    else:
        become_subreaper()
        state, reason, status = _run(job, _StoreHooks(store, job))
        used = _measured_of(job.recording)
    store.update(job.id, **end_fields(state, reason, status), **used)
    with contextlib.suppress(OSError, ValueError):
        request(paths.socket, {"op": "kick"}, timeout_s=2.0)
    return 0


class _StoreHooks:
    """What the job's run tells the queue, written straight into its state (our own queue)."""

    def __init__(self, store: QueueStore, job: Job) -> None:
        self.store, self.job_id = store, job.id

    def running(self, pid: int, start: int | None, recording: str) -> bool:
        """The job runs; whether a cancel was asked meanwhile."""
        self.store.update(
            self.job_id,
            only_if=(STARTING,),
            state=RUNNING,
            job_pid=pid,
            job_start=start,
            started_at=time.time(),
            recording=recording,
        )
        fresh = self.store.get(self.job_id)
        return fresh is not None and fresh.cancel_requested

    def stop_asked(self) -> None:
        pass  # a cancel is in the state already

    def grace_s(self) -> float | None:
        fresh = self.store.get(self.job_id)
        return fresh.cancel_grace_s if fresh is not None else None

    def cancelled(self) -> bool:
        fresh = self.store.get(self.job_id)
        return fresh is not None and fresh.cancel_requested


class _PipeHooks:
    """The same, from a run as the job's owner (who may not write the machine's state): one
    JSON line each to the supervisor, which writes it."""

    def __init__(self, fd: int, job: Job) -> None:
        self._out = os.fdopen(fd, "w", buffering=1)
        self._grace = job.cancel_grace_s
        self._cancelled = False

    def send(self, **message: object) -> None:
        self._out.write(json.dumps(message) + "\n")
        self._out.flush()

    def running(self, pid: int, start: int | None, recording: str) -> bool:
        self.send(running=[pid, start, recording])
        return False  # a cancel asked meanwhile comes as a signal from the supervisor

    def stop_asked(self) -> None:
        self._cancelled = True  # only a cancel signals the supervisor, which passes it on

    def grace_s(self) -> float | None:
        return self._grace

    def cancelled(self) -> bool:
        return self._cancelled


def _run(job: Job, hooks) -> tuple[str, str | None, int | None]:
    from torchdoctor.run.process import resolve_command
    from torchdoctor.run.session import record_command

    env = job_environment(job)
    try:
        os.chdir(job.cwd)
    except OSError as exc:
        return FAILED, f"cannot enter its folder {job.cwd}: {exc.strerror}", 1
    try:
        executable = resolve_command(job.argv, env=env, cwd=job.cwd)
    except UserError as exc:
        return FAILED, exc.message, exc.exit_code
    for path in (job.log, job.recording):
        if path is not None:
            try:
                Path(path).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                if path == job.log:  # opened here, as whoever runs the job: never as root
                    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
            except OSError as exc:
                return FAILED, f"cannot write {path}: {exc.strerror}", 1
    # The job inherits our mask: set before it starts, so its first thread is already pinned.
    if job.assigned_cpus:
        os.sched_setaffinity(0, job.assigned_cpus)
    recording = Path(job.recording)
    stopper: list[TreeStopper] = []

    def started(pid: int) -> None:
        stopper.append(TreeStopper(ProcessTree(pid, orphans=True), job.cancel_grace_s))
        if hooks.running(pid, start_time(pid), str(recording)):
            stopper[0].start()

    def signalled(signum: int, forwarded: bool) -> None:
        if signum in _STOP_SIGNALS and stopper:
            grace = hooks.grace_s()
            if grace is not None:
                stopper[0].grace_s = grace
            hooks.stop_asked()
            stopper[0].start()

    memory_cgroup = _memory_cgroup(job)
    try:
        status = record_command(
            executable,
            job.argv,
            recording,
            0.5,
            instrument=True,
            env=env,
            mode="queue",
            log=job.log,
            new_group=True,
            on_started=started,
            on_signal=signalled,
            memory_cgroup=memory_cgroup,
        )
    except UserError as exc:  # could not be started after all
        if memory_cgroup is not None:
            with contextlib.suppress(OSError):
                memory_cgroup.remove()
        return FAILED, exc.message, exc.exit_code
    if stopper:
        _stop_leftovers(stopper[0])
    if memory_cgroup is not None:
        with contextlib.suppress(OSError):
            memory_cgroup.remove()
    if hooks.cancelled():
        return CANCELLED, f"cancelled; exit status {status}", status
    if status == 0:
        return DONE, None, 0
    return FAILED, _oom_killed(recording) or _how_it_ended(status), status


def _memory_cgroup(job: Job):
    """The job's ``--mem`` as the limit of a memory cgroup of its own, where cgroups can be made
    here (root); otherwise it stays a figure the scheduler plans with, as it was."""
    from torchdoctor.run.cgroup import MemoryCgroup

    if not job.mem:
        return None
    try:
        return MemoryCgroup.create(f"job-{job.id}-{os.getpid()}", job.mem)
    except OSError as exc:
        print(
            f"torchdoctor: --mem is not enforced for job {job.id} (no memory cgroup: {exc})",
            file=sys.stderr,
        )
        return None


def _oom_killed(recording: Path) -> str | None:
    """'killed by the OOM killer ...' when the recording says a process of the job was."""
    try:
        from torchdoctor.recording import open_recording
        from torchdoctor.units import fmt_bytes

        with open_recording(recording) as rec:
            end = rec.meta.get("memory_end") or {}
    except Exception:  # noqa: BLE001 - the plain exit status is said instead
        return None
    if not end.get("oom_kills"):
        return None
    limit = (end.get("cgroup") or {}).get("limit")
    victims = end.get("victims") or []
    who = f"pid {victims[-1]['pid']} ({victims[-1]['name']})" if victims else "a process"
    at = f" at its {fmt_bytes(limit)} memory limit" if limit else ""
    return f"OOM-killed: the kernel killed {who}{at} (see torchdoctor diagnose)"


def _stop_leftovers(stopper: TreeStopper) -> None:
    """What the job left running when its main process ended: its group, and orphans that
    were re-parented to us. They were started by the job, so they are the queue's to stop."""
    if stopper.tree.members():
        if not stopper.started:
            stopper.grace_s = min(stopper.grace_s, LEFTOVER_GRACE_S)
            stopper.start()
        deadline = time.monotonic() + stopper.grace_s + 2.0
        while stopper.tree.members() and time.monotonic() < deadline:
            reap_children()
            time.sleep(0.05)
    stopper.cancel()
    reap_children()


def _how_it_ended(status: int) -> str:
    if status > 128:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(status - 128).name} (status {status})"
    return f"exited with status {status}"


def _measured_of(recording: str | None) -> dict[str, float | int | None]:
    return _measured(Path(recording)) if recording else {}


def _run_as_owner(job: Job, store: QueueStore) -> tuple[str, str | None, int | None, dict]:
    """Run the job (and its recorder) in a child that has become its submitter: their uid,
    groups and umask, before it enters their folder or opens their files, so a path they name
    reaches only what they could reach themselves. We stay root only to keep the state."""
    _preload()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the job's owner from here on
        code = 70
        try:
            os.close(read)
            _become(job)
            become_subreaper()
            hooks = _PipeHooks(write, job)
            state, reason, status = _run(job, hooks)
            hooks.send(end=[state, reason, status], used=_measured_of(job.recording))
            code = 0
        except BaseException:  # noqa: BLE001 - said in the scheduler's log, seen as failed
            traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)
    os.close(write)
    child = pid

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signum)

    for signum in _STOP_SIGNALS:
        signal.signal(signum, forward)
    ended: list = [FAILED, "its run as its owner stopped before the job ended", None]
    used: dict = {}
    with os.fdopen(read) as lines:
        for line in lines:
            message = json.loads(line)
            if "running" in message:
                job_pid, job_start, recording = message["running"]
                store.update(
                    job.id,
                    only_if=(STARTING,),
                    state=RUNNING,
                    job_pid=job_pid,
                    job_start=job_start,
                    started_at=time.time(),
                    recording=recording,
                )
                fresh = store.get(job.id)
                if fresh is not None and fresh.cancel_requested:
                    forward(signal.SIGTERM, None)
            elif "end" in message:
                ended, used = message["end"], message.get("used", {})
    how = "unknown"
    while True:
        try:
            how = str(os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]))
            break
        except ChildProcessError:
            break
        except InterruptedError:
            continue
    if ended[2] is None and ended[0] == FAILED:
        ended[1] += f" (status {how}; see the scheduler's log)"
    return ended[0], ended[1], ended[2], used


def _become(job: Job) -> None:
    """Drop to the job's owner: supplementary groups, group, then user (last: after it,
    nothing else may change), and a private umask."""
    import pwd

    entry = pwd.getpwuid(job.uid)
    gid = entry.pw_gid
    os.setgroups(os.getgrouplist(entry.pw_name, gid))
    os.setgid(gid)
    os.setuid(job.uid)
    if os.getuid() != job.uid or os.geteuid() != job.uid:
        raise PermissionError(f"could not become uid {job.uid}")
    os.umask(0o077)


def _preload() -> None:
    """Import what the job's run needs before it drops root: its owner may not be able to read
    the interpreter's own files (a venv under /root), and must not need to."""
    import email.parser  # noqa: F401 - importlib.metadata's, for the recording's versions
    import importlib.metadata  # noqa: F401

    import psutil  # noqa: F401 - the host's and the job's readers import it when first used

    import torchdoctor.instrument.collector  # noqa: F401
    import torchdoctor.recording.summary  # noqa: F401
    import torchdoctor.run.session  # noqa: F401
    import torchdoctor.sampling.host  # noqa: F401
    import torchdoctor.sampling.job  # noqa: F401
    from torchdoctor.recording import open_recording  # noqa: F401
    from torchdoctor.sampling.gpus import GpuReader

    with contextlib.suppress(Exception):
        GpuReader().close()  # loads the NVML bindings


def _measured(path: Path) -> dict[str, float | int | None]:
    """Peak VRAM (per GPU), peak RSS and mean cores, from the job's recording."""
    try:
        from torchdoctor.recording import open_recording
        from torchdoctor.recording.summary import summarize

        with open_recording(path) as rec:
            summary = summarize(rec)
    except Exception as exc:  # noqa: BLE001 - the job's end is recorded regardless
        print(f"torchdoctor: cannot read the job's recording {path}: {exc}", file=sys.stderr)
        return {}
    peaks = [g.job_memory_peak for g in summary.gpus if g.job_memory_peak is not None]
    cpu = summary.job_cpu_pct.mean
    return {
        "used_vram": max(peaks) if peaks else None,
        "used_rss": int(summary.job_rss.peak) if summary.job_rss.peak is not None else None,
        "used_cores": cpu / 100 if cpu is not None else None,
    }


def main() -> None:
    sys.exit(supervise(int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None))


if __name__ == "__main__":
    main()
