"""Turns the agent's messages (JSON objects, see :mod:`torchdoctor.instrument.agent`) into the
records of :mod:`torchdoctor.recording.records`.

Every message names the order of its step values, so a recorder reads a job whose agent comes
from another torchdoctor version; unknown step fields are ignored, missing ones default.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from dataclasses import dataclass, field
from typing import Any

from torchdoctor.instrument.agent.contract import unpack_steps
from torchdoctor.recording.records import (
    PROFILE_STATES,
    DataLoaderRecord,
    JobEvent,
    ProfileSyncSite,
    ProfileWindow,
    SettingRecord,
    StepRecord,
)

_STEP_NAMES = {f.name for f in dataclasses.fields(StepRecord)}
# Integer-nanosecond wire fields -> the record's seconds fields.
_NS_FIELDS = {
    "t_end_ns": "t_end",
    "wall_ns": "wall_s",
    "data_wait_ns": "data_wait_s",
    "forward_ns": "forward_s",
    "backward_ns": "backward_s",
    "optimizer_ns": "optimizer_s",
    "comm_ns": "comm_s",
    "comm_overlap_ns": "comm_overlap_s",
    "backward_compute_ns": "backward_compute_s",
}
_LOADER_NAMES = {f.name for f in dataclasses.fields(DataLoaderRecord)}


@dataclass(slots=True)
class Batch:
    """The records of one message."""

    steps: list[StepRecord] = field(default_factory=list)
    dataloaders: list[DataLoaderRecord] = field(default_factory=list)
    settings: list[SettingRecord] = field(default_factory=list)
    events: list[JobEvent] = field(default_factory=list)


def decode(message: dict[str, Any]) -> Batch:
    """Records of one agent message; raises ValueError/KeyError/TypeError on a malformed one."""
    if not isinstance(message, dict):
        raise ValueError("an agent message is a JSON object")
    pid = int(message["pid"])
    rank = message.get("rank")
    names = list(message.get("step_fields") or ())
    batch = Batch()
    for values in unpack_steps(message):
        row = {}
        # Rows may be shorter than the names (no CUDA figures): those fields keep defaults.
        for name, value in zip(names, values, strict=False):
            if name in _NS_FIELDS:
                row[_NS_FIELDS[name]] = None if value is None else value / 1e9
            elif name in _STEP_NAMES:
                row[name] = value
        if "t_start" not in row:
            row["t_start"] = row["t_end"] - row["wall_s"]
        batch.steps.append(StepRecord(pid=pid, rank=rank, **row))
    for record in message.get("dataloaders") or ():
        row = {k: v for k, v in record.items() if k in _LOADER_NAMES}
        row.update(pid=pid, rank=rank)
        batch.dataloaders.append(DataLoaderRecord(**row))
    for t, key, value in message.get("settings") or ():
        batch.settings.append(SettingRecord(pid=pid, rank=rank, t=t, key=key, value=value))
    for t, kind, detail in message.get("events") or ():
        batch.events.append(JobEvent(pid=pid, rank=rank, t=t, kind=kind, detail=detail))
    return batch


PROFILE_EVENT = "profile-window"  # the agent's window ends (instrument/agent/profile.py)
# How long the end of a recording waits for the traces still being read into it.
INGEST_WAIT_S = 120.0


def profile_window(event: JobEvent) -> tuple[ProfileWindow, list[ProfileSyncSite]]:
    """The window and sync sites a ``profile-window`` event carries (id 0: not yet written);
    raises ValueError/KeyError/TypeError on a malformed one."""
    detail = json.loads(event.detail)
    if not isinstance(detail, dict):
        raise ValueError("a profile-window event's detail is an object")

    def number(key: str, kind: type) -> Any:
        value = detail.get(key)
        return None if value is None else kind(value)

    state = str(detail.get("state"))
    if state not in PROFILE_STATES:
        raise ValueError(f"unknown profile window state {state!r}")
    window = ProfileWindow(
        id=0,
        rank=event.rank,
        pid=event.pid,
        first_step=number("first_step", int),
        last_step=number("last_step", int),
        warmup_step=number("warmup_step", int),
        started_at=number("started_at", float),
        ended_at=number("ended_at", float),
        trace_path=number("trace_path", str),
        trace_bytes=number("trace_bytes", int),
        state=state,
        reason=number("reason", str),
    )
    sites = [
        ProfileSyncSite(0, str(op), str(file), int(line), str(function), int(count), float(s))
        for op, file, line, function, count, s in detail.get("sites") or ()
    ]
    return window, sites


class WriterSink:
    """Hands decoded records to a RecordingWriter (or anything with the same add_* methods).

    A profiler window's end (a ``profile-window`` event) is written into the recording's
    window tables too and, when its trace was written, read into the recording by
    ``torchdoctor.recording.profiles.ingest_window`` where that module exists: on a thread of
    its own, so that the agents' messages keep being received; :meth:`finish` waits for it."""

    def __init__(self, writer) -> None:
        self.writer = writer
        self.messages = 0
        self.errors = 0
        self.ingest_threads: list[threading.Thread] = []
        self.ingest_errors: list[str] = []

    def __call__(self, message: dict[str, Any]) -> None:
        try:
            batch = decode(message)
        except (ValueError, KeyError, TypeError):
            self.errors += 1
            return
        self.messages += 1
        if batch.steps:
            self.writer.add_steps(batch.steps)
        if batch.dataloaders:
            self.writer.add_dataloaders(batch.dataloaders)
        if batch.settings:
            self.writer.add_settings(batch.settings)
        if batch.events:
            self.writer.add_events(batch.events)
            for event in batch.events:
                if event.kind == PROFILE_EVENT:
                    self._profile_window(event)

    def _profile_window(self, event: JobEvent) -> None:
        add = getattr(self.writer, "add_profile_window", None)
        if add is None:
            return  # a writer without the window tables (tune's trial watcher)
        try:
            window, sites = profile_window(event)
        except (ValueError, KeyError, TypeError):
            self.errors += 1
            return
        window_id = add(window, sites)
        if window_id and window.trace_path is not None and window.state in ("done", "cut"):
            self._ingest(window_id, window.trace_path)

    def _ingest(self, window_id: int, trace_path: str) -> None:
        try:
            from torchdoctor.recording import profiles  # part B: the trace's tables
        except ImportError:
            return
        ingest = getattr(profiles, "ingest_window", None)
        if ingest is None:
            return

        def run() -> None:
            try:
                ingest(self.writer, window_id, trace_path)
            except Exception as exc:  # noqa: BLE001 - a trace unread, the recording goes on
                self.ingest_errors.append(f"window {window_id}: {type(exc).__name__}: {exc}")

        thread = threading.Thread(target=run, name=f"torchdoctor-profile-{window_id}")
        thread.daemon = True
        self.ingest_threads.append(thread)
        thread.start()

    def finish(self, timeout: float = INGEST_WAIT_S) -> None:
        """Wait (at most ``timeout`` s in all) for the traces being read into the recording."""
        import time

        deadline = time.monotonic() + timeout
        for thread in self.ingest_threads:
            thread.join(max(0.0, deadline - time.monotonic()))
