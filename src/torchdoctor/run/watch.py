"""``torchdoctor.watch()``: record and instrument the current process, no CLI needed.

    import torchdoctor

    with torchdoctor.watch("run.sqlite") as w:
        train()
    print(w.path)

It samples the host, this process and its children (DataLoader workers) and the GPUs like
``torchdoctor run`` does, instruments torch in-process (steps, data wait, settings) and writes
the same recording. Under ``torchdoctor run`` it adds a second recording of the same steps.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from pathlib import Path
from types import TracebackType

from torchdoctor.instrument.wire import WriterSink
from torchdoctor.recording.paths import SUFFIX, runs_dir, safe_name

DEFAULT_INTERVAL_S = 0.5


def agent_module():
    """The agent of this process: the bootstrap's copy when ``torchdoctor run`` loaded one."""
    module = sys.modules.get("_torchdoctor_agent")
    if module is None:
        from torchdoctor.instrument import agent as module

        sys.modules.setdefault("_torchdoctor_agent", module)
    return module


def default_name() -> str:
    """``python-<script>``, as ``torchdoctor run`` names the recordings of a script."""
    script = Path(sys.argv[0]).stem if sys.argv and sys.argv[0] else "python"
    return f"python-{script}"


def default_path(now: float | None = None) -> Path:
    """``<recordings folder>/<UTC time>-python-<script>.sqlite``: the name a recording started
    now would get (the file itself is created, uniquely, when the recording starts)."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    return runs_dir() / f"{stamp}-{safe_name(default_name())}{SUFFIX}"


def rank_path(path: Path) -> Path:
    """One file per rank in a distributed job: ``run.sqlite`` -> ``run.rank1.sqlite``."""
    rank = os.environ.get("RANK")
    world = os.environ.get("WORLD_SIZE")
    if rank is None or world in (None, "1"):
        return path
    return path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


class Watch:
    """A recording of the current process; start/stop explicitly or use it as a context."""

    def __init__(
        self,
        out: str | os.PathLike[str] | None = None,
        *,
        interval: float = DEFAULT_INTERVAL_S,
        instrument: bool = True,
        gpus: bool = True,
        name: str | None = None,
    ) -> None:
        """``name``: the name part of a default file name (``python-<script>`` unless given)."""
        from torchdoctor.recording.recorder import MAX_INTERVAL_S, MIN_INTERVAL_S

        if not MIN_INTERVAL_S <= interval <= MAX_INTERVAL_S:
            from torchdoctor.errors import UserError

            raise UserError(
                f"interval {interval} s is out of range: use {MIN_INTERVAL_S}-{MAX_INTERVAL_S} s"
            )
        # Without ``out`` the file is named when it is created (start): a unique name.
        self._named = out is not None
        self._name = name or default_name()
        self.path = rank_path(Path(out) if out is not None else default_path())
        self.interval = interval
        self.instrument = instrument
        self.gpus = gpus
        self._writer = None
        self._recorder = None
        self._gpu_reader = None
        self._sink = None
        self._armed_here = False
        self._agent = None

    @property
    def running(self) -> bool:
        return self._writer is not None

    def start(self) -> Watch:
        if self._writer is not None:
            return self
        from torchdoctor.recording import (
            RecordingWriter,
            claim_recording_file,
            create_recording_file,
        )
        from torchdoctor.recording.metadata import run_metadata
        from torchdoctor.recording.recorder import Recorder
        from torchdoctor.sampling.host import HostReader
        from torchdoctor.sampling.hostinfo import read_host_info
        from torchdoctor.sampling.job import JobReader
        from torchdoctor.sampling.sampler import Sampler

        if self._named:
            claim_recording_file(self.path, option="the out argument")
        else:
            rank = rank_path(Path("x")).stem[1:]  # ".rankN" in a distributed job, else ""
            self.path = create_recording_file(self._name + rank, option="the out argument")
        gpus = None
        if self.gpus:
            from torchdoctor.sampling.gpus import GpuReader

            gpus = GpuReader()
        meta = run_metadata(
            mode="watch",
            command=list(sys.argv),
            root_pid=os.getpid(),
            interval_s=self.interval,
            env=dict(os.environ),
            host_info=read_host_info(),
            gpu_status=gpus.status if gpus is not None else None,
            instrumented=self.instrument,
        )
        self._writer = RecordingWriter(self.path, meta)
        self._gpu_reader = gpus
        if self.instrument:
            self._agent = agent_module().AGENT
            self._sink = WriterSink(self._writer)
            self._armed_here = self._agent.start_session(self._sink)
        sampler = Sampler(HostReader(), JobReader(os.getpid()), gpus)
        self._recorder = Recorder(sampler, self._writer, self.interval)
        self._recorder.start()
        # A fit that dies without telling its callback (HF Trainer has no on_exception) still
        # leaves a finished recording: exit status unknown.
        atexit.register(self._stop_at_exit)
        return self

    def _stop_at_exit(self) -> None:
        self.stop(exit_status=None)

    def stop(self, exit_status: int | None = 0) -> Path:
        """Finish the recording (idempotent); ``exit_status`` None when training failed."""
        writer, self._writer = self._writer, None
        if writer is None:
            return self.path
        atexit.unregister(self._stop_at_exit)
        try:
            if self._agent is not None:
                self._agent.end_session(self._sink, self._armed_here)
                self._agent = None
            if self._recorder is not None:
                self._recorder.stop(final_sample=True)
        finally:
            writer.close({"ended_at": time.time(), "exit_status": exit_status})
            if self._gpu_reader is not None:
                self._gpu_reader.close()
        return self.path

    def __enter__(self) -> Watch:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop(exit_status=0 if exc_type is None else 1)


def watch(
    out: str | os.PathLike[str] | None = None,
    *,
    interval: float = DEFAULT_INTERVAL_S,
    instrument: bool = True,
    gpus: bool = True,
) -> Watch:
    """Record this process (and its children) into ``out``; use as a context manager.

    ``out`` defaults to ``./torchdoctor-runs/<UTC time>-python-<script>.sqlite``; in a
    distributed job every rank writes its own file (``.rankN`` before the suffix).
    ``instrument=False`` samples only; ``gpus=False`` skips NVML.
    """
    return Watch(out, interval=interval, instrument=instrument, gpus=gpus)
