"""Turns the agent's messages (JSON objects, see :mod:`torchdoctor.instrument.agent`) into the
records of :mod:`torchdoctor.recording.records`.

Every message names the order of its step values, so a recorder reads a job whose agent comes
from another torchdoctor version; unknown step fields are ignored, missing ones default.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from torchdoctor.instrument.agent.contract import unpack_steps
from torchdoctor.recording.records import DataLoaderRecord, JobEvent, SettingRecord, StepRecord

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


class WriterSink:
    """Hands decoded records to a RecordingWriter (or anything with the same add_* methods)."""

    def __init__(self, writer) -> None:
        self.writer = writer
        self.messages = 0
        self.errors = 0

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
