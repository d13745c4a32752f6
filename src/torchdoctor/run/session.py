"""Recording a command from its start to its end: what `torchdoctor run` and every queued job do.

The command is started, sampled until it exits, and its recording closed; the caller gets the
command's own exit status. From the moment the command runs, nothing of ours may stop us from
waiting for it: each of our steps fails alone, says so once, and the rest goes on.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torchdoctor.recording import registry
from torchdoctor.recording.metadata import run_metadata
from torchdoctor.recording.recorder import Recorder
from torchdoctor.recording.writer import RecordingWriter
from torchdoctor.run.cgroup import MemoryCgroup
from torchdoctor.run.process import ChildProcess, hold_signals, release_signals
from torchdoctor.sampling.memcg import MemoryWatch, ended_by
from torchdoctor.sampling.sampler import Sampler


def record_command(
    executable: str,
    argv: list[str],
    path: Path,
    interval: float,
    *,
    instrument: bool,
    env: dict[str, str] | None = None,
    mode: str = "run",
    log: os.PathLike[str] | str | None = None,
    new_group: bool = False,
    on_started: Callable[[int], None] | None = None,
    on_signal: Callable[[int, bool], None] | None = None,
    on_ended: Callable[[int], None] | None = None,
    start_outputs: Callable[[], Any] | None = None,
    meta: dict[str, Any] | None = None,
    memory_cgroup: MemoryCgroup | None = None,
) -> int:
    """Start the command, sample it until it exits, close the recording; its exit status.

    ``env`` is the command's environment (default: ours). ``log`` and ``new_group`` are
    :func:`torchdoctor.run.process.spawn`'s. ``on_started(pid)`` is told the command's PID once
    it runs and ``on_ended(pid)`` once it has ended; ``on_signal`` is :meth:`ChildProcess.wait`'s.
    ``start_outputs()`` starts what serves the recording while it grows (a metrics endpoint,
    a TensorBoard writer); what it returns is closed, after a last flush, when the command
    ends. A failing hook is reported and does not stop the recording. ``meta`` is added to
    the recording's metadata (``launch`` keeps its plan there). ``memory_cgroup``: the
    command is placed in it as soon as it runs (the queue's ``--mem``).

    How the command ended is recorded with its memory: the kills the OOM killer made in its
    cgroups while it ran, the last cgroup reading and the kernel's log lines naming the victim
    (``memory_end`` in the metadata, with ``exit_signal``).
    """
    from torchdoctor.sampling.gpus import GpuReader
    from torchdoctor.sampling.hostinfo import read_host_info

    held = hold_signals()  # before any thread starts, so no thread swallows a Ctrl-C
    try:
        gpus = GpuReader()
        env = dict(os.environ if env is None else env)
        writer = _create_writer(
            path, argv, interval, env, read_host_info(), gpus.status, instrument, mode
        )
        if meta:
            writer.set_meta(meta)
        collector = _start_collector(writer) if instrument else None
        if collector is not None:
            env = collector.child_env(env)
        elif not instrument:
            # An outer `torchdoctor run` may have left its bootstrap on PYTHONPATH.
            env["TORCHDOCTOR_NO_INSTRUMENT"] = "1"
        served = _safely(start_outputs) if start_outputs is not None else None
        try:
            child = ChildProcess(executable, argv, env, log=log, new_group=new_group)
        except BaseException:
            if served is not None:
                _safely(served.close)
            writer.close({"ended_at": time.time(), "exit_status": None, "start_error": True})
            path.unlink(missing_ok=True)
            raise
        # From here on the job runs: nothing of ours may stop us from waiting for it and
        # returning its status. Each step fails alone, says so once, and the rest goes on.
        if memory_cgroup is not None:
            # posix_spawn has returned after the exec: the job has allocated next to nothing
            # outside its cgroup yet.
            _safely(lambda: memory_cgroup.add(child.pid))
        memory = _safely(lambda: MemoryWatch(child.pid))
        recorder = _safely(lambda: _start_recorder(child.pid, gpus, writer, interval, memory))
        # `top` and the host exporter find every recorded job, whichever command started it.
        announced = _safely(lambda: registry.announce(child.pid, path))
        if on_started is not None:
            _safely(lambda: on_started(child.pid))
        status = child.wait(on_signal)
        if recorder is not None:
            _safely(recorder.stop)
        if collector is not None:
            _safely(lambda: collector.close(timeout=2.0))
        if served is not None:
            _safely(writer.flush)
            _safely(served.close)
        if announced:
            _safely(lambda: registry.withdraw(child.pid))
        if on_ended is not None:
            _safely(lambda: on_ended(child.pid))
        end: dict[str, Any] = {"ended_at": time.time(), "exit_status": status}
        end["exit_signal"] = ended_by(status)
        if memory is not None:
            finished = _safely(memory.finish)
            if finished is not None:
                end["memory_end"] = finished.as_dict()
        _safely(lambda: writer.close(end))
        _safely(gpus.close)
        return status
    finally:
        release_signals(held)


def _start_recorder(
    pid: int,
    gpus: Any,
    writer: RecordingWriter,
    interval: float,
    memory: MemoryWatch | None,
) -> Recorder:
    from torchdoctor.sampling.host import HostReader
    from torchdoctor.sampling.job import JobReader

    writer.set_meta({"root_pid": pid})
    job = JobReader(pid)

    def follow_memory() -> None:
        memory.refresh()
        if memory.near_limit and job.slow_budget is not None:
            # Close to its memory limit, who holds what is the question the end will ask:
            # each process's private memory is read every half second from now on.
            job.slow_budget = None
            job.slow_refresh_s = min(job.slow_refresh_s, max(interval, 0.5))

    sampler = Sampler(HostReader(pid=pid), job, gpus)
    recorder = Recorder(sampler, writer, interval, follow_memory if memory else None)
    recorder.start()
    return recorder


def _safely(action: Callable[[], Any]) -> Any:
    """Run one of our own steps; a failure is reported once and never reaches the job."""
    try:
        return action()
    except Exception as exc:  # noqa: BLE001
        print(
            f"torchdoctor: internal error, recording may be incomplete ({type(exc).__name__}: {exc})",
            file=sys.stderr,
        )
        return None


def _create_writer(
    path, argv, interval, env, host_info, gpu_status, instrument, mode
) -> RecordingWriter:
    meta = run_metadata(
        mode=mode,
        command=argv,
        root_pid=None,
        interval_s=interval,
        env=env,
        host_info=host_info,
        gpu_status=gpu_status,
        instrumented=instrument,
    )
    return RecordingWriter(path, meta)


def _start_collector(writer: RecordingWriter):
    try:
        from torchdoctor.instrument.collector import Collector
    except ImportError:
        return None
    return Collector(writer)
