"""One job's supervisor: starts the command where the scheduler placed it, records it with
torchdoctor's recorder and writes how it ended into the queue's state.

It is the job's parent and its process group's keeper: a cancel (SIGTERM to the supervisor)
sends TERM to the whole group and KILL after the grace period; as a child subreaper it also
gets every orphan of the job, so nothing the job started outlives it. The scheduler may die
meanwhile: the supervisor does not need it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path

from torchdoctor.errors import UserError
from torchdoctor.queue.environment import job_environment
from torchdoctor.queue.model import CANCELLED, DONE, FAILED, RUNNING, STARTING, Job
from torchdoctor.queue.paths import queue_paths
from torchdoctor.queue.processes import become_subreaper, reap_children, start_time
from torchdoctor.queue.protocol import request
from torchdoctor.queue.store import QueueStore, end_fields
from torchdoctor.run.process import ProcessTree, TreeStopper

LEFTOVER_GRACE_S = 2.0  # for processes the job left behind when its main process ended
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def supervise(job_id: int) -> int:
    """Run queued job ``job_id`` to its end; 0, or 1 when the job was not ours to run."""
    paths = queue_paths()
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
    become_subreaper()
    state, reason, status = _run(job, store, paths)
    _finish(job, store, state, reason, status)
    with contextlib.suppress(OSError, ValueError):
        request(paths.socket, {"op": "kick"}, timeout_s=2.0)
    return 0


def _run(job: Job, store: QueueStore, paths) -> tuple[str, str | None, int | None]:
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
    # The job inherits our mask: set before it starts, so its first thread is already pinned.
    if job.assigned_cpus:
        os.sched_setaffinity(0, job.assigned_cpus)
    recording = Path(job.recording) if job.recording else paths.recording(job.id, job.name)
    stopper: list[TreeStopper] = []

    def started(pid: int) -> None:
        stopper.append(TreeStopper(ProcessTree(pid, orphans=True), job.cancel_grace_s))
        store.update(
            job.id,
            only_if=(STARTING,),
            state=RUNNING,
            job_pid=pid,
            job_start=start_time(pid),
            started_at=time.time(),
            recording=str(recording),
        )
        fresh = store.get(job.id)
        if fresh is not None and fresh.cancel_requested:
            stopper[0].start()

    def signalled(signum: int, forwarded: bool) -> None:
        if signum in _STOP_SIGNALS and stopper:
            fresh = store.get(job.id)
            if fresh is not None:
                stopper[0].grace_s = fresh.cancel_grace_s
            stopper[0].start()

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
        )
    except UserError as exc:  # could not be started after all
        return FAILED, exc.message, exc.exit_code
    if stopper:
        _stop_leftovers(stopper[0])
    fresh = store.get(job.id)
    if fresh is not None and fresh.cancel_requested:
        return CANCELLED, f"cancelled; exit status {status}", status
    if status == 0:
        return DONE, None, 0
    return FAILED, _how_it_ended(status), status


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


def _finish(
    job: Job, store: QueueStore, state: str, reason: str | None, status: int | None
) -> None:
    used = {}
    fresh = store.get(job.id)
    if fresh is not None and fresh.recording:
        used = _measured(Path(fresh.recording))
    store.update(job.id, **end_fields(state, reason, status), **used)


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
    sys.exit(supervise(int(sys.argv[1])))


if __name__ == "__main__":
    main()
