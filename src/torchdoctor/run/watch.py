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

from torchdoctor.recording.paths import SUFFIX, runs_dir, safe_name
from torchdoctor.run.session import RecordingSession, claim_file

DEFAULT_INTERVAL_S = 0.5


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
        self._session: RecordingSession | None = None

    @property
    def running(self) -> bool:
        return self._session is not None

    def start(self) -> Watch:
        if self._session is not None:
            return self
        if self._named:
            self.path = claim_file(self.path, "", option="the out argument")
        else:
            rank = rank_path(Path("x")).stem[1:]  # ".rankN" in a distributed job, else ""
            self.path = claim_file(None, self._name + rank, option="the out argument")
        session = RecordingSession(
            self.path,
            mode="watch",
            command=list(sys.argv),
            interval=self.interval,
            env=dict(os.environ),
            instrumented=self.instrument,
            root_pid=os.getpid(),
            sample_gpus=self.gpus,
        )
        self._session = session
        if self.instrument:
            session.wire_agent_here()
        session.start_recorder(os.getpid())
        # `top` and the host exporter find this job like any recorded one (under `torchdoctor
        # run` the outer recorder's entry for this process stays).
        session.announce(os.getpid())
        # A fit that dies without telling its callback (HF Trainer has no on_exception) still
        # leaves a finished recording: exit status unknown.
        atexit.register(self._stop_at_exit)
        return self

    def _stop_at_exit(self) -> None:
        self.stop(exit_status=None)

    def stop(self, exit_status: int | None = 0) -> Path:
        """Finish the recording (idempotent); ``exit_status`` None when training failed."""
        session, self._session = self._session, None
        if session is None:
            return self.path
        atexit.unregister(self._stop_at_exit)
        return session.end(exit_status, final_sample=True)

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
