"""TensorBoard scalars from a recording: during the run (``run --tensorboard DIR``) or after
it (``export FILE --format tensorboard``), the same series either way.

The writer is tensorboardX (the ``tensorboard`` extra): 0.65 MB plus protobuf, against some
90 MB for the tensorboard package with its server, grpcio and pillow; it writes the standard
event files TensorBoard reads. Each recording becomes one run: ``DIR/<run id>/``.

Events go through tensorboardX's synchronous ``EventsWriter`` (the file writer its
``SummaryWriter`` drives from a thread of its own), on our own thread: a write that fails (a full
disk) raises here, where it becomes one line (:class:`TensorBoardStopped`). Through
``SummaryWriter`` it killed tensorboardX's thread with a traceback, and the next writes waited
for ever on the queue that thread no longer read (export hung; run's end said 'internal
error'). Free space is checked before each pass, so that a pass that cannot fit is not begun.

Series (tags):
- per step, indexed by the n-th step of the rank: ``step/time_seconds``,
  ``step/data_wait_ratio`` and ``step/samples_per_second`` (``rank<R>/step/...`` for the
  ranks of a distributed job);
- per sample, indexed by milliseconds since the recording started (the event's wall time is
  the sample's): ``job/cpu_cores``, ``job/pss_bytes`` (and per role ``job/pss_bytes/<role>``),
  ``job/processes``, ``gpu<i>/utilization_ratio``, ``gpu<i>/memory_used_bytes``,
  ``gpu<i>/memory_total_bytes``, ``gpu<i>/power_watts``, ``host/iowait_ratio``,
  ``host/swap_used_bytes``, ``host/swap_in_bytes_per_second``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import threading
from pathlib import Path
from typing import Any

from torchdoctor.errors import UserError
from torchdoctor.exporters.jobstate import PROCESS_COLUMNS, STEP_COLUMNS, JobState
from torchdoctor.recording.steps import step_samples, step_wait_s
from torchdoctor.recording.tail import RecordingTail
from torchdoctor.terminal import make_console

FLUSH_EVERY_S = 5.0  # the live writer's cadence: TensorBoard sees new points within this
_HOST_COLUMNS = ["t", "cpu_iowait", "swap_used", "swap_in_per_s"]
_GPU_COLUMNS = ["t", "index", "utilization_gpu", "memory_used", "memory_total", "power_w"]
_MISSING = (
    "TensorBoard output needs tensorboardX: `pip install 'torchdoctor[tensorboard]'` "
    "(or `pip install tensorboardX`)"
)


# Free space a pass needs: this, plus _POINT_BYTES a point (a scalar event is 40-90 bytes
# with its tag and framing; the margin keeps a little for the file system's own needs).
_MIN_FREE_BYTES = 256 * 1024
_POINT_BYTES = 128


class TensorBoardStopped(UserError):
    """The TensorBoard output cannot go on (its disk is full, or a write failed)."""


def _event_classes():
    """tensorboardX's EventsWriter and its Event and Summary messages, imported without torch.

    tensorboardX imports torch when it can, only to accept tensors; we hand it floats. In
    the recorder that import would cost 1.5 s of CPU and ~200 MB of memory, so it is kept
    out (only when torch is not loaded already).
    """
    masked = "torch" not in sys.modules
    if masked:
        sys.modules["torch"] = None  # type: ignore[assignment]  # import torch -> ImportError
    try:
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.proto.summary_pb2 import Summary
    except ImportError:
        raise UserError(_MISSING) from None
    finally:
        if masked:
            del sys.modules["torch"]
    return EventsWriter, Event, Summary


def check_available() -> None:
    """Raise the one-line UserError when the writer is not installed."""
    _event_classes()


class ScalarWriter:
    """Writes the scalars of one recording into ``folder/<run id>/``, incrementally."""

    def __init__(self, recording: str | Path, folder: str | Path) -> None:
        events_writer, self._event, self._summary = _event_classes()
        self._tail = RecordingTail(recording)
        self._state = JobState(self._tail)
        self.logdir = Path(folder) / self._tail.run_id
        # Folders this writer made, innermost first: removed again by discard().
        self.made = [p for p in (self.logdir, *self.logdir.parents) if not p.exists()]
        try:
            self.logdir.mkdir(parents=True, exist_ok=True)
            written_before = any(self.logdir.glob("*tfevents*"))
        except OSError as exc:
            raise UserError(
                f"cannot create {str(self.logdir)!r}: {exc.strerror}; choose another folder"
            ) from None
        if written_before:
            # A second event file in the same run would show every point twice.
            raise UserError(
                f"{str(self.logdir)!r} already holds TensorBoard events of this recording; "
                "choose another folder or remove it"
            )
        self._pending: list[tuple[str, float, int, float]] = []  # (tag, value, step, time)
        self.failed = False
        try:
            self._check_space(0)
            try:
                self._writer = events_writer(str(self.logdir / "events"))
            except OSError as exc:
                raise self._stopped(exc) from None
        except TensorBoardStopped:
            self.discard()
            self._tail.close()
            raise
        self._t0 = self._tail.meta.get("started_at")
        self._rank_steps: dict[str, int] = {}
        self._prev_cpu: tuple[float, float] | None = None  # (t, total CPU seconds)
        self.points = 0

    def write(self) -> int:
        """Write what was recorded since the previous call and flush; the points written."""
        before = self.points
        tail = self._tail
        self._steps(tail.new_rows("steps", STEP_COLUMNS))
        self._processes(tail.new_tuples("process_samples", PROCESS_COLUMNS))
        for row in tail.new_rows("gpu_samples", _GPU_COLUMNS):
            i, t = row["index"], row["t"]
            util = row["utilization_gpu"]
            self._add(f"gpu{i}/utilization_ratio", None if util is None else util / 100, t)
            self._add(f"gpu{i}/memory_used_bytes", row["memory_used"], t)
            self._add(f"gpu{i}/memory_total_bytes", row["memory_total"], t)
            self._add(f"gpu{i}/power_watts", row["power_w"], t)
        for row in tail.new_rows("host_samples", _HOST_COLUMNS):
            t = row["t"]
            iowait = row["cpu_iowait"]
            self._add("host/iowait_ratio", None if iowait is None else iowait / 100, t)
            self._add("host/swap_used_bytes", row["swap_used"], t)
            self._add("host/swap_in_bytes_per_second", row["swap_in_per_s"], t)
        pending, self._pending = self._pending, []
        if self.failed:
            raise self._stopped(None)
        self._check_space(len(pending))
        event, summary = self._event, self._summary
        try:
            for tag, value, step, t in pending:
                point = summary(value=[summary.Value(tag=tag, simple_value=value)])
                self._writer.write_event(event(summary=point, step=step, wall_time=t))
            self._writer.flush()
        except OSError as exc:
            raise self._stopped(exc) from None
        return self.points - before

    def close(self) -> None:
        """Close the event file (raises TensorBoardStopped if its last flush fails, unless a
        failure was said already) and the recording."""
        try:
            if self.failed:
                with contextlib.suppress(OSError):
                    self._writer.close()
            else:
                try:
                    self._writer.close()
                except OSError as exc:
                    raise self._stopped(exc) from None
        finally:
            self._tail.close()

    def discard(self) -> None:
        """Remove what this writer wrote: its event file, and the folders it made if empty."""
        # The only event file there: __init__ refused a run folder that held one already.
        for written in self.logdir.glob("*tfevents*"):
            with contextlib.suppress(OSError):
                written.unlink()
        for folder in self.made:
            with contextlib.suppress(OSError):
                folder.rmdir()

    def _check_space(self, points: int) -> None:
        """Refuse a pass the disk cannot hold: a full disk is said before a write fails."""
        try:
            stat = os.statvfs(self.logdir)
        except OSError:
            return  # not knowable here: the writes will tell
        free = stat.f_bavail * stat.f_frsize
        if free < _MIN_FREE_BYTES + points * _POINT_BYTES:
            raise self._stopped(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))

    def _stopped(self, exc: OSError | None) -> TensorBoardStopped:
        self.failed = True
        if exc is None:
            why = "an earlier write failed"
        elif exc.errno in (errno.ENOSPC, errno.EDQUOT):
            why = "no space left on the device"
        else:
            why = exc.strerror or str(exc)
        return TensorBoardStopped(f"tensorboard output stopped: {why} in {str(self.logdir)!r}")

    # -- internals ------------------------------------------------------------------------

    def _time_step(self, t: float) -> int:
        if self._t0 is None:
            self._t0 = t
        return max(0, round((t - self._t0) * 1000))

    def _add(self, tag: str, value: float | None, t: float, step: int | None = None) -> None:
        if value is None:
            return
        self._pending.append((tag, float(value), self._time_step(t) if step is None else step, t))
        self.points += 1

    def _steps(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            rank = "" if row["rank"] is None else str(row["rank"])
            n = self._rank_steps.get(rank, 0)
            self._rank_steps[rank] = n + 1
            prefix = f"rank{rank}/step" if rank else "step"
            wall, t = row["wall_s"], row["t_end"]
            self._add(f"{prefix}/time_seconds", wall, t, n)
            if wall and wall > 0:
                self._add(f"{prefix}/data_wait_ratio", step_wait_s(row) / wall, t, n)
                samples = step_samples(row)
                if samples is not None:
                    self._add(f"{prefix}/samples_per_second", samples / wall, t, n)

    def _processes(self, rows: list[tuple]) -> None:
        state = self._state
        start = 0
        for i in range(1, len(rows) + 1):
            if i < len(rows) and rows[i][0] == rows[start][0]:  # t, PROCESS_COLUMNS' first
                continue
            # One sample of the job (its rows share a time): the same aggregates as the
            # Prometheus series, then its points.
            state.add_process_rows(rows[start:i])
            start = i
            t = state.sample_t
            cpu = sum(r.cpu_user_s + r.cpu_system_s for r in state.totals.values())
            if self._prev_cpu is not None and t > self._prev_cpu[0]:
                self._add("job/cpu_cores", (cpu - self._prev_cpu[1]) / (t - self._prev_cpu[0]), t)
            self._prev_cpu = (t, cpu)
            self._add("job/processes", sum(g.processes for g in state.now.values()), t)
            known = [(role, g.pss) for role, g in sorted(state.now.items()) if g.pss_known]
            if known:
                self._add("job/pss_bytes", sum(pss for _, pss in known), t)
                for role, pss in known:
                    self._add(f"job/pss_bytes/{role}", pss, t)


def export_tensorboard(recording: str | Path, folder: str | Path) -> Path:
    """Write the scalars of a finished (or running) recording; the run's log folder."""
    writer = ScalarWriter(recording, folder)
    try:
        try:
            writer.write()
        finally:
            writer.close()
    except TensorBoardStopped:
        writer.discard()  # a partial export is none: nothing left behind, as other formats
        raise
    return writer.logdir


class LiveScalars:
    """Writes a recording's scalars every :data:`FLUSH_EVERY_S` while the job runs."""

    def __init__(self, recording: str | Path, folder: str | Path) -> None:
        self._recording = Path(recording)
        self._folder = Path(folder)
        self._writer: ScalarWriter | None = None
        self._stop = threading.Event()
        self.error: str | None = None
        self._thread = threading.Thread(target=self._loop, name="torchdoctor-tensorboard",
                                        daemon=True)  # fmt: skip

    def start(self) -> None:
        """Open the event file now, so that a folder that cannot be written is said at once
        (raises UserError), then write in the background."""
        self._writer = ScalarWriter(self._recording, self._folder)
        self._thread.start()

    def _pass(self) -> None:
        if self._writer is None:
            self._writer = ScalarWriter(self._recording, self._folder)
        self._writer.write()

    def _loop(self) -> None:
        while not self._stop.wait(FLUSH_EVERY_S):
            try:
                self._pass()
            except Exception as exc:  # noqa: BLE001 - the job must outlive any writer bug
                self._say_stopped(exc)
                return

    def _say_stopped(self, exc: Exception) -> None:
        """One line, once: the job and its recording go on without the scalars."""
        if self.error is not None:
            return
        if isinstance(exc, TensorBoardStopped):
            self.error = exc.message
        else:
            self.error = f"tensorboard output stopped ({type(exc).__name__}: {exc})"
        make_console(stderr=True, soft_wrap=True).print(
            f"torchdoctor: {self.error}; the job keeps running and its recording goes on"
        )

    def close(self) -> None:
        """Stop, write what the recording holds now, and close the event file."""
        self._stop.set()
        self._thread.join(10.0)
        try:
            if self.error is None and not self._thread.is_alive():
                self._pass()
            if self._writer is not None and not self._thread.is_alive():
                self._writer.close()
        except Exception as exc:  # noqa: BLE001 - run's end report and status come after this
            self._say_stopped(exc)
