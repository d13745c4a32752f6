"""One recording session, from its file to its end report: what every recording path shares.

`torchdoctor run`, `attach`, `launch`, queued jobs, bench scaling's and tune's trials and
``torchdoctor.watch()`` all record through :class:`RecordingSession`:

    path = claim_file(out, name)                      # the file, created now, never shared
    session = RecordingSession(path, mode="run", command=argv, interval=0.5, env=env)
    env = session.wire_agent(env)                     # the job's agents send to our collector
    ...start the job...
    session.start_recorder(pid)                       # sample the host, the job and the GPUs
                                                      # (and watch for a slow step: auto_profile)
    session.announce(pid)                             # `top` and the exporter find the job
    ...wait for it...
    session.end(status)                               # stop, withdraw, write the end
    session.end_report(console, thresholds)           # summary and findings on stderr

:func:`record_command` is the whole sequence for a command we start and wait for. From the
moment the command runs, nothing of ours may stop us from waiting for it: each of our steps
fails alone, says so once, and the rest goes on.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torchdoctor.errors import UserError
from torchdoctor.instrument.agent.contract import ENV_PROFILE_DIR
from torchdoctor.recording import registry
from torchdoctor.recording.metadata import run_metadata
from torchdoctor.recording.paths import (
    claim_recording_file,
    create_recording_file,
    profile_folder,
)
from torchdoctor.recording.recorder import Recorder
from torchdoctor.recording.writer import RecordingWriter
from torchdoctor.run.cgroup import MemoryCgroup
from torchdoctor.run.process import ChildProcess, hold_signals, release_signals
from torchdoctor.sampling.memcg import MemoryWatch, ended_by
from torchdoctor.sampling.sampler import Sampler

NO_INSTRUMENT_ENV = "TORCHDOCTOR_NO_INSTRUMENT"


def claim_file(
    out: str | os.PathLike[str] | None,
    name: str,
    *,
    folder: str | os.PathLike[str] | None = None,
    stamp: bool = True,
    option: str = "--out",
) -> Path:
    """The session's recording file, created now: ``out`` exactly (it must be new), else a
    fresh unique ``<UTC time>-<name>.sqlite`` in ``folder`` (default: the recordings folder in
    use, :func:`torchdoctor.recording.paths.runs_dir`; ``<name>.sqlite`` unstamped).

    A name holding a newline or another control character is refused: the file would be
    awkward for every shell tool and line-based listing after it."""
    for given in (out, folder):
        if given is not None and any(_is_control(ch) for ch in os.fspath(given)):
            raise UserError(
                f"{option} {os.fspath(given)!r} holds a newline or control character: "
                "choose a name without one"
            )
    if out:
        return claim_recording_file(out, option=option)
    return create_recording_file(name, folder=folder, stamp=stamp, option=option)


def _is_control(ch: str) -> bool:
    """C0 and C1 control characters (newline, tab, escape...); not the surrogates that stand
    for a non-UTF-8 byte of a file name, which are a legitimate (if unusual) name."""
    return ch < " " or "\x7f" <= ch <= "\x9f"


def agent_module():
    """The agent of this process: the bootstrap's copy when ``torchdoctor run`` loaded one."""
    module = sys.modules.get("_torchdoctor_agent")
    if module is None:
        from torchdoctor.instrument import agent as module

        sys.modules.setdefault("_torchdoctor_agent", module)
    return module


class RecordingSession:
    """The recording of one job: its writer, recorder, agent wiring and registry entry.

    ``gpus`` is a GPU reader shared by several sessions (tune's trials; not closed here);
    without one the session opens its own, unless ``sample_gpus`` is false. ``writer`` makes
    the writer from the path and the metadata (tune's trials watch their steps through a
    subclass). ``host_pid`` is whose affinity and cgroup the host info describes (default: us).
    ``say`` gets the lines the session says while the job runs (the automatic profiler
    window's); default: torchdoctor's stderr.
    """

    def __init__(
        self,
        path: Path,
        *,
        mode: str,
        command: list[str],
        interval: float,
        env: dict[str, str],
        instrumented: bool = True,
        root_pid: int | None = None,
        host_pid: int | None = None,
        gpus: Any = None,
        sample_gpus: bool = True,
        meta: dict[str, Any] | None = None,
        writer: Callable[[Path, dict], RecordingWriter] = RecordingWriter,
        keep: str = "compact",
        say: Callable[[str], None] | None = None,
    ) -> None:
        from torchdoctor.sampling.hostinfo import read_host_info

        self.path = path
        self.mode = mode
        self.say = say or _to_stderr
        self.interval = interval
        self.instrumented = instrumented
        self._own_gpus = gpus is None and sample_gpus
        if self._own_gpus:
            from torchdoctor.sampling.gpus import GpuReader

            gpus = GpuReader()
        self.gpus = gpus
        full = run_metadata(
            mode=mode,
            command=command,
            root_pid=root_pid,
            interval_s=interval,
            env=env,
            host_info=read_host_info(pid=host_pid),
            gpu_status=gpus.status if gpus is not None else None,
            instrumented=instrumented,
        )
        full.update(meta or {})
        if writer is RecordingWriter and keep == "compact":
            # Older samples folded as written (recording.compaction): a week of a node stays
            # a file one can copy. Other writers (tune's trials) are short and keep all.
            from torchdoctor.recording.compaction import CompactionPolicy

            self.writer = RecordingWriter(path, full, compaction=CompactionPolicy())
        else:
            self.writer = writer(path, full)
        self.recorder: Recorder | None = None
        self.memory: MemoryWatch | None = None
        self.collector = None
        self.outputs = None
        self.announced: int | None = None
        self._agent = None
        self._sink = None
        self._armed_here = False
        self._ended = False
        self.auto_profile = None  # run.auto_profile.AutoProfile, while it watches
        self._auto_profile_env: dict[str, str] | None = None  # the job's, once wired

    # -- the job's agents -------------------------------------------------------------------

    def wire_agent(self, env: dict[str, str], *, warn=None) -> dict[str, str]:
        """The environment the job starts with: its agents send to our collector when the
        session is instrumented, the agent stays off otherwise (an outer `torchdoctor run`
        may have left its bootstrap on PYTHONPATH). ``warn`` is the collector's."""
        if not self.instrumented:
            return {**env, NO_INSTRUMENT_ENV: "1"}
        try:
            from torchdoctor.instrument.collector import Collector
        except ImportError:
            return env
        self.collector = Collector(self.writer, warn=warn)
        wired = self.collector.child_env(env)
        if wired is not env:
            # Where a profiler window's traces go, and where `torchdoctor profile` asks for
            # one (instrument/agent/profile.py): beside the recording.
            wired = {**wired, ENV_PROFILE_DIR: str(profile_folder(self.path))}
            self._auto_profile_env = wired
        return wired

    @property
    def agent_error(self) -> str | None:
        """Why the job's agents cannot reach us (None when they can or none was wired)."""
        if self.collector is None or self.collector.listening:
            return None
        return self.collector.error or "not listening"

    def wire_agent_here(self) -> None:
        """Instrument this very process (``watch()``): the agent writes into our writer."""
        from torchdoctor.instrument.wire import WriterSink

        self._agent = agent_module().AGENT
        self._sink = WriterSink(self.writer)
        self._armed_here = self._agent.start_session(self._sink)

    def start_outputs(self, start: Callable[[], Any]) -> None:
        """Start what serves the recording while it grows (a metrics endpoint, a TensorBoard
        writer); what ``start()`` returns is closed, after a last flush, at the end."""
        self.outputs = _safely(start)

    # -- sampling and the registry ----------------------------------------------------------

    def start_recorder(self, pid: int, *, memory_cgroup: MemoryCgroup | None = None) -> None:
        """Sample the host, the job rooted at ``pid`` and the GPUs until :meth:`end`, and
        follow the job's memory cgroup (its limit, the OOM killer's kills). ``memory_cgroup``:
        the job is placed in it first (the queue's ``--mem``)."""
        from torchdoctor.sampling.host import HostReader
        from torchdoctor.sampling.job import JobReader

        if memory_cgroup is not None:
            # posix_spawn has returned after the exec: the job has allocated next to nothing
            # outside its cgroup yet.
            _safely(lambda: memory_cgroup.add(pid))
        self.memory = _safely(lambda: MemoryWatch(pid))
        self.writer.set_meta({"root_pid": pid})
        job = JobReader(pid)
        memory, interval = self.memory, self.interval

        def follow_memory() -> None:
            memory.refresh()
            if memory.near_limit and job.slow_budget is not None:
                # Close to its memory limit, who holds what is the question the end will ask:
                # each process's private memory is read at every sample from now on (a
                # worker's copy-on-access can fill the rest of the limit in a second).
                job.slow_budget = None
                job.slow_refresh_s = min(job.slow_refresh_s, interval)

        sampler = Sampler(HostReader(pid=pid), job, self.gpus)
        self.recorder = Recorder(sampler, self.writer, interval, follow_memory if memory else None)
        self.recorder.start()
        if self._auto_profile_env is not None:
            _safely(self._start_auto_profile)

    def _start_auto_profile(self) -> None:
        """Watch for a slow step with the GPU waiting (run/auto_profile.py): a job whose agents
        read the profile folder, unless it is off; why not is kept in the metadata."""
        from torchdoctor.config import ENV_THRESHOLDS
        from torchdoctor.run.auto_profile import META_KEY, AutoProfile, off_reason
        from torchdoctor.thresholds import load_thresholds

        env = self._auto_profile_env or {}
        try:
            reason = off_reason(env, self.mode)
            if reason is None and not (self.gpus is not None and self.gpus.status.available):
                # No device to be idle: a step bound by the CPU is the host rules' to name.
                reason = "no GPU"
            thresholds = load_thresholds(env.get(ENV_THRESHOLDS)) if reason is None else None
        except UserError as exc:  # a setting the job's environment or a file got wrong
            reason = exc.message
            self.say(f"torchdoctor: automatic profiling off: {reason}")
        if reason is not None or thresholds is None:
            self.writer.set_meta({META_KEY: {"state": "off", "reason": reason}})
            return
        self.auto_profile = AutoProfile(
            self.path, thresholds, say=self.say, set_meta=self.writer.set_meta
        )
        self.auto_profile.start()

    def job_alive(self) -> bool:
        """Whether the recorded job's root process still runs (it is not ours to wait for)."""
        return self.recorder is not None and self.recorder.sampler.job.root_alive()

    def announce(self, pid: int) -> bool:
        """Tell `top` and the host exporter that ``pid`` is recorded here, until :meth:`end`."""
        if registry.announce(pid, self.path):
            self.announced = pid
        return self.announced is not None

    def withdraw(self) -> None:
        if self.announced is not None:
            registry.withdraw(self.announced)
            self.announced = None

    # -- the end ----------------------------------------------------------------------------

    def end(self, exit_status: int | None, *, final_sample: bool = False, **fields: Any) -> Path:
        """Stop sampling, unwire the agents, withdraw, write the end (``exit_status`` and any
        ``fields``); once. Each step fails alone and says so: the recording ends regardless."""
        if self._ended:
            return self.path
        self._ended = True
        if self.auto_profile is not None:
            # First: its reading connection must be gone before the writer folds the WAL.
            _safely(self.auto_profile.stop)
        if self._agent is not None:
            agent, self._agent = self._agent, None
            _safely(lambda: agent.end_session(self._sink, self._armed_here))
            _safely(self._sink.finish)  # traces of profiler windows being read in
        if self.recorder is not None:
            _safely(lambda: self.recorder.stop(final_sample=final_sample))
        if self.collector is not None:
            _safely(lambda: self.collector.close(timeout=2.0))
        if self.outputs is not None:
            _safely(self.writer.flush)
            _safely(self.outputs.close)
        _safely(self.withdraw)
        end = {"ended_at": time.time(), "exit_status": exit_status, **fields}
        if exit_status is not None:
            end["exit_signal"] = ended_by(exit_status)
        if self.memory is not None:
            # How the job ended, with its memory: the OOM killer's kills in its cgroups while
            # it ran, the last cgroup reading, the kernel's lines naming the victim.
            finished = _safely(self.memory.finish)
            if finished is not None:
                end["memory_end"] = finished.as_dict()
        _safely(lambda: self.writer.close(end))
        if self._own_gpus and self.gpus is not None:
            _safely(self.gpus.close)
        return self.path

    def end_report(self, console, thresholds_path: str | None) -> None:
        """The summary, then the findings, on ``console``; never changes the exit status."""
        from torchdoctor.run.end_report import print_end_report

        print_end_report(self.path, console, thresholds_path)


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
    start_outputs: Callable[[], Any] | None = None,
    meta: dict[str, Any] | None = None,
    memory_cgroup: MemoryCgroup | None = None,
    keep: str = "compact",
    say: Callable[[str], None] | None = None,
) -> int:
    """Start the command, sample it until it exits, close the recording; its exit status.

    ``env`` is the command's environment (default: ours). ``log`` and ``new_group`` are
    :func:`torchdoctor.run.process.spawn`'s. ``on_started(pid)`` is told the command's PID once
    it runs; ``on_signal`` is :meth:`ChildProcess.wait`'s. ``start_outputs`` is
    :meth:`RecordingSession.start_outputs`'. A failing hook is reported and does not stop the
    recording. ``meta`` is added to the recording's metadata (``launch`` keeps its plan there).
    ``memory_cgroup``: the command is placed in it as soon as it runs (the queue's ``--mem``).
    ``keep``: "compact" folds older samples as written (recording.compaction), "full" keeps
    every one. ``say`` is the session's (what it says while the job runs).
    """
    held = hold_signals()  # before any thread starts, so no thread swallows a Ctrl-C
    try:
        env = dict(os.environ if env is None else env)
        session = RecordingSession(
            path,
            mode=mode,
            command=argv,
            interval=interval,
            env=env,
            instrumented=instrument,
            meta=meta,
            keep=keep,
            say=say,
        )
        env = session.wire_agent(env)
        if start_outputs is not None:
            session.start_outputs(start_outputs)
        try:
            child = ChildProcess(executable, argv, env, log=log, new_group=new_group)
        except BaseException:
            session.end(None, start_error=True)
            path.unlink(missing_ok=True)
            raise
        # From here on the job runs: nothing of ours may stop us from waiting for it and
        # returning its status. Each step fails alone, says so once, and the rest goes on.
        _safely(lambda: session.start_recorder(child.pid, memory_cgroup=memory_cgroup))
        _safely(lambda: session.announce(child.pid))
        if on_started is not None:
            _safely(lambda: on_started(child.pid))
        status = child.wait(on_signal)
        session.end(status)
        return status
    finally:
        release_signals(held)


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


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
