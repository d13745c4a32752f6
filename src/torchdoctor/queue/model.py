"""A queued job as the state store keeps it: what was asked, what it got, how it ended."""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass, field

from torchdoctor.errors import UserError

QUEUED = "queued"
STARTING = "starting"  # resources given, supervisor starting the command
RUNNING = "running"
DONE = "done"  # exit status 0
FAILED = "failed"
CANCELLED = "cancelled"
LOST = "lost"  # it was running when its supervisor vanished (e.g. a reboot): status unknown

ACTIVE = (STARTING, RUNNING)
TERMINAL = (DONE, FAILED, CANCELLED, LOST)

PAUSED_KEY = "paused"  # queue-wide setting: why the queue is paused, when it is
ASKED = "asked"  # where a figure of a job came from, when the user gave it

# The store keeps a priority in an SQLite INTEGER: a signed 64-bit number.
PRIORITY_MIN, PRIORITY_MAX = -(2**63), 2**63 - 1
# A job's id is its SQLite rowid: from 1 up to the same INTEGER's largest value.
JOB_ID_MAX = 2**63 - 1


def check_priority(priority: int) -> int:
    """``priority``, or a UserError giving the range the queue can store."""
    if not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise UserError(
            f"priority {priority}: give a whole number from {PRIORITY_MIN} to {PRIORITY_MAX}"
        )
    return priority


def check_name(name: str) -> str:
    """``name``, or a UserError when it holds a newline or another control character (it is
    one cell of `torchdoctor queue`'s table and part of the recording's file name)."""
    if any(unicodedata.category(c) in ("Cc", "Zl", "Zp") for c in name):
        raise UserError(
            f"job name {name!r}: give one without newlines or control characters (--name NAME)"
        )
    return name


@dataclass(slots=True)
class Job:
    id: int
    name: str
    argv: list[str]
    env: dict[str, str]
    cwd: str
    submitted_at: float
    state: str = QUEUED
    priority: int = 0
    after: list[int] = field(default_factory=list)
    gpus: int = 0  # how many GPUs
    gpu_ids: list[str] | None = None  # the UUIDs asked for by name, when they were
    vram: int | None = None  # bytes per GPU; None with GPUs: the whole GPUs, shared with no one
    vram_source: str | None = None
    cpus: int = 1
    mem: int | None = None  # bytes of RAM; None: not reserved
    mem_source: str | None = None
    reason: str | None = None  # why it waits, or how it ended
    started_at: float | None = None
    ended_at: float | None = None
    exit_status: int | None = None
    assigned_gpus: list[str] = field(default_factory=list)  # UUIDs
    assigned_cpus: list[int] = field(default_factory=list)
    master_port: int | None = None
    boot_id: str | None = None
    supervisor_pid: int | None = None
    supervisor_start: int | None = None  # start time in clock ticks: with the PID, its identity
    job_pid: int | None = None  # also the job's process group
    job_start: int | None = None
    cancel_requested: bool = False
    cancel_grace_s: float = 10.0
    recording: str | None = None
    log: str | None = None
    used_vram: int | None = None  # measured peak per GPU, bytes
    used_rss: int | None = None  # measured peak of the job's processes, bytes
    used_cores: float | None = None  # mean CPU use, cores
    # Who submitted it (the peer credential of the request on a machine-wide queue; our own
    # uid on a per-user queue): it runs as this user and only they (and root) may act on it.
    uid: int | None = None
    user: str | None = None
    gid: int | None = None
    held: bool = False  # `queue pause ID`: a waiting job that does not start until resumed
    restarted_from: int | None = None  # `queue restart ID`: the ended job this one repeats

    @property
    def active(self) -> bool:
        return self.state in ACTIVE

    @property
    def ended(self) -> bool:
        return self.state in TERMINAL
