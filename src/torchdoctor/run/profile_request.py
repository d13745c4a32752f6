"""`torchdoctor profile JOB --steps N`: ask a running job's agents for a profiler window.

The channel back to the agents is a file: ``request.json`` in the recording's profile folder
(:func:`torchdoctor.recording.paths.profile_folder`, the folder the agents were told in
``TORCHDOCTOR_PROFILE_DIR``), written once, atomically (a temporary file renamed into place).
Every agent of the job looks at it at each flush (every half second, one ``stat``) and arms a
window at the steps it names; a file survives a recorder that is busy or slow, and every rank
of the job reads the same steps, so the ranks' windows line up. The first step is the
furthest step any process has recorded plus a lead of :data:`LEAD_S` seconds of steps: the
time the steps take to reach the recording (the agent's flush, the writer's commit) and the
agents to read the request.

The window then ends in the recording's ``profile_windows`` table like one of
``run --profile-steps`` (instrument/agent/profile.py).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from torchdoctor.errors import UserError
from torchdoctor.recording import registry
from torchdoctor.recording.paths import profile_folder
from torchdoctor.recording.reader import open_recording
from torchdoctor.recording.records import ProfileWindow

REQUEST_FILE = "request.json"  # instrument/agent/profile.py reads it (REQUEST_FILE there)
LEAD_S = 3.0  # flush (0.5 s) + commit (1 s) + the agents' next look (0.5 s), and a margin
MIN_LEAD_STEPS = 5
# The pace is read from steps past the first two (start-up: lazy initialisation, first batch).
PACE_FROM_STEP = 2
PACE_STEPS = 3
MAX_STEPS = 50  # the agent's MAX_ACTIVE_STEPS


@dataclass(frozen=True, slots=True)
class ProfileRequest:
    id: str
    recording: Path
    first_step: int
    last_step: int
    step_s: float  # the recent mean step time (the pace) it was planned with
    path: Path  # the request file


def job_recording(job: str) -> Path:
    """The recording of a job being recorded now: a recording path (``last`` resolved by the
    caller), or the PID of the job's root process as ``top`` lists it."""
    if job.isdigit():
        for entry in registry.active():
            if entry.pid == int(job):
                return Path(entry.recording_path)
        raise UserError(f"no job with PID {job} is being recorded (see `torchdoctor top`)")
    path = Path(job)
    for entry in registry.active():
        if _same_file(Path(entry.recording_path), path):
            return path
    raise UserError(
        f"{job!r} is not the recording of a running job (`torchdoctor top` lists them): a "
        "window can only be asked of a job recorded by run, launch or the queue while it runs"
    )


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.samefile(b)
    except OSError:
        return False


def plan_window(recording: Path, steps: int, wait_s: float = 30.0) -> tuple[int, float]:
    """(first step, recent step time) for a window of ``steps`` steps of the job recorded in
    ``recording``: the same step for every process. Waits up to ``wait_s`` for the job to
    record a few steps past its first (whose time, start-up included, says nothing of the
    pace)."""
    if not 1 <= steps <= MAX_STEPS:
        raise UserError(f"--steps must be between 1 and {MAX_STEPS}, not {steps}")
    deadline = time.monotonic() + wait_s
    while True:
        with open_recording(recording) as rec:
            if rec.meta.get("instrumented") is False:
                raise UserError(f"{str(recording)!r} was recorded without the instrumentation")
            latest = rec.query("SELECT pid, MAX(step) AS step FROM steps GROUP BY pid")
            recent = rec.query(
                "SELECT wall_s FROM steps WHERE step >= ? ORDER BY rowid DESC LIMIT 50",
                (PACE_FROM_STEP,),
            )
        walls = [float(r["wall_s"]) for r in recent if r["wall_s"] is not None]
        if len(walls) >= PACE_STEPS:
            break
        if time.monotonic() >= deadline:
            raise UserError(
                f"the job recorded in {str(recording)!r} has not recorded {PACE_STEPS} steps "
                f"past its first {PACE_FROM_STEP} in {wait_s:.0f} s: ask again once it trains"
            )
        time.sleep(0.5)
    # The pace is the mean: on a busy machine steps alternate fast and preempted, and a
    # median of the fast ones puts the window seconds later than LEAD_S (a short job could end
    # before it).
    step_s = statistics.fmean(walls)
    lead = max(MIN_LEAD_STEPS, math.ceil(LEAD_S / max(step_s, 1e-4)))
    return max(int(r["step"]) for r in latest) + lead, step_s


def request_window(recording: Path, steps: int) -> ProfileRequest:
    """Write the request for a window of ``steps`` steps of the job recorded in ``recording``."""
    first, step_s = plan_window(recording, steps)
    folder = profile_folder(recording)
    folder.mkdir(exist_ok=True)
    request = {
        "id": uuid.uuid4().hex,
        "first_step": first,
        "last_step": first + steps - 1,
        "requested_at": time.time(),
    }
    path = folder / REQUEST_FILE
    temporary = folder / f".{REQUEST_FILE}.{os.getpid()}"
    temporary.write_text(json.dumps(request))
    os.replace(temporary, path)  # the agents never read half a request
    return ProfileRequest(request["id"], recording, first, first + steps - 1, step_s, path)


def wait_for_windows(
    request: ProfileRequest, timeout: float, poll_s: float = 0.5, grace_s: float = 5.0
) -> list[ProfileWindow]:
    """The windows the request armed, once every process that stepped past the window has
    ended its own; a process still short of it gets ``grace_s`` after the first window (it
    may have stopped). Whatever there is after ``timeout`` seconds ([] when none)."""
    deadline = time.monotonic() + timeout
    first_seen: float | None = None
    while True:
        with open_recording(request.recording) as rec:
            windows = [w for w in rec.profile_windows() if w.first_step == request.first_step]
            latest = rec.query("SELECT pid, MAX(step) AS step FROM steps GROUP BY pid")
        now = time.monotonic()
        if windows:
            first_seen = now if first_seen is None else first_seen
            ended = {w.pid for w in windows}
            stepping = {int(r["pid"]) for r in latest}
            if stepping <= ended or now - first_seen >= grace_s:
                return windows
        if now >= deadline:
            return windows
        time.sleep(poll_s)
