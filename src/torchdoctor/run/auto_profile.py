"""The automatic profiler window: once per run, when the step is slow with the GPU waiting and
nothing on the host explains it, a short window is asked of the job's agents.

This is the case where ``gpu-underused`` finds no host-side cause: the time goes inside the
step, and only a profile says where. The recorder watches the recording as it grows (a
:class:`~torchdoctor.recording.tail.RecordingTail`: one indexed read of each table's new rows
a second, never the whole file) and, when every condition holds, asks for
:data:`WINDOW_STEPS` steps through the channel ``torchdoctor profile`` uses
(:func:`torchdoctor.run.profile_request.request_window`): the agents arm the window at a step
a few seconds ahead, and it ends in the recording as any other window (its steps, the warm-up
and the closing one, leave every step statistic).

The conditions, over the last ``thresholds.sustained_s`` seconds (the window every rule judges
"sustained" over):

- past start-up: ``auto_profile_min_steps`` steps after the first two, and
  ``auto_profile_min_s`` seconds recorded;
- a GPU assigned to the job (where a process of the job holds memory, else the only GPU of a
  job whose steps use CUDA: the diagnosis' ``job_gpus``) busy below ``gpu_busy_alert_pct``,
  sustained (``sustained_fraction`` of its samples);
- the host does not explain it: the steps wait on the DataLoader less than
  ``data_wait_alert_pct`` of their time, no sample swaps above ``swap_alert_bytes_per_s``, and
  other programs do not hold the CPUs (the machine busy above ``cpu_load_alert_pct`` while the
  job's own share stays below ``cpu_load_best_pct``: the ``cpu-contention`` rule's test).

A CPU-only job never asks: there is no device to be idle, and a step bound by the CPU is named
by the host rules already (``cpu-saturated``, ``thread-oversubscription``, ``dataloader-bound``).
A manual window (``--profile-steps``, or ``torchdoctor profile`` before the conditions held)
takes its place: one window per run is what the user meant.

What it did is kept in the recording's metadata (``auto_profile``): ``state`` ``off`` (with
``reason``), ``watching`` (the conditions never held), or ``asked`` (with the steps, and the
GPU busy and data wait shares it saw); ``gpu-underused`` reads it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from torchdoctor.diagnosis.series import sustained_span
from torchdoctor.recording.paths import profile_folder
from torchdoctor.recording.tail import RecordingTail
from torchdoctor.run.profile_request import PACE_FROM_STEP, REQUEST_FILE, request_window
from torchdoctor.sampling.types import usable_cpus_of
from torchdoctor.thresholds import Thresholds

WINDOW_STEPS = 5  # active steps: enough for a median step, short enough to cost nothing
POLL_S = 1.0  # the writer commits once a second: looking more often finds nothing new
# Recording modes of a user's job. Tune's trials and bench scaling's measure throughput over
# a few steps of their own: a window inside one would be a trial of the profiler.
MODES = ("run", "launch", "queue")
META_KEY = "auto_profile"
OPT_OUT = "--no-auto-profile"
MIN_RECENT_STEPS = 3  # a data-wait share rests on a few steps even when steps are long

StepRow = tuple[float, float, float]  # (t_end, wall_s, data_wait_s)


@dataclass(frozen=True, slots=True)
class Seen:
    """What the trigger saw when it asked for a window (kept in the recording's metadata)."""

    gpu: int
    gpu_busy_pct: float
    data_wait_pct: float
    steps: int
    recorded_s: float


@dataclass(slots=True)
class Recent:
    """The part of the recording the conditions are judged on: the last ``span_s`` seconds of
    each series, the steps counted past start-up, and the GPUs the job holds."""

    span_s: float
    host: deque[tuple[float, float | None, float]]  # (t, cpu busy %, swap in + out B/s)
    job_cores: dict[float, float]  # t -> CPUs' worth used by the job's processes
    gpu: dict[int, deque[tuple[float, float]]]  # index -> (t, utilization %)
    steps: deque[StepRow]
    steady_steps: dict[int, int]  # pid -> steps recorded past the first two
    job_gpus: set[int]  # where a process of the job holds memory
    cuda_steps: bool = False  # a step reported CUDA memory reserved

    @classmethod
    def over(cls, span_s: float) -> Recent:
        return cls(span_s, deque(), {}, {}, deque(), {}, set())

    def add_host(self, rows: list[tuple]) -> None:
        for t, busy, swap_in, swap_out in rows:
            self.host.append((t, busy, float(swap_in or 0.0) + float(swap_out or 0.0)))

    def add_processes(self, rows: list[tuple]) -> None:
        for t, cpu_percent in rows:
            if cpu_percent is not None:
                self.job_cores[t] = self.job_cores.get(t, 0.0) + cpu_percent / 100

    def add_gpus(self, rows: list[tuple]) -> None:
        for t, index, utilization in rows:
            if utilization is not None:
                self.gpu.setdefault(int(index), deque()).append((t, float(utilization)))

    def add_gpu_processes(self, rows: list[tuple]) -> None:
        for index, in_job, used in rows:
            if in_job and (used or 0) > 0:
                self.job_gpus.add(int(index))

    def add_steps(self, rows: list[tuple]) -> None:
        for pid, step, t_end, wall, wait, profiled, reserved in rows:
            if (reserved or 0) > 0:
                self.cuda_steps = True
            # Start-up steps and those a window touched say nothing of the steady step.
            if step is None or step < PACE_FROM_STEP or profiled or wall is None:
                continue
            self.steady_steps[pid] = self.steady_steps.get(pid, 0) + 1
            self.steps.append((t_end, float(wall), min(float(wait or 0.0), float(wall))))

    def prune(self) -> None:
        """Keep the last ``span_s`` seconds before the newest reading, and at least the last
        few steps. By time, not by arrival: the compaction appends folded minutes that carry
        their old times (and a week-long job that never asks must not grow the deques)."""
        times = [r[0] for r in self.host]
        times += [r[0] for series in self.gpu.values() for r in series]
        times += [r[0] for r in self.steps]
        if not times:
            return
        since = max(times) - self.span_s
        self.host = deque(r for r in self.host if r[0] >= since)
        self.job_cores = {t: v for t, v in self.job_cores.items() if t >= since}
        self.gpu = {i: deque(r for r in series if r[0] >= since) for i, series in self.gpu.items()}
        steps = sorted(self.steps)
        recent = [r for r in steps if r[0] >= since]
        self.steps = deque(recent if len(recent) >= MIN_RECENT_STEPS else steps[-MIN_RECENT_STEPS:])

    def assigned_gpus(self) -> list[int]:
        """The diagnosis' ``job_gpus``: where the job holds memory, else the only GPU when its
        steps use CUDA."""
        if self.job_gpus:
            return sorted(i for i in self.job_gpus if i in self.gpu)
        if self.cuda_steps and len(self.gpu) == 1:
            return list(self.gpu)
        return []


def judge(
    recent: Recent, thresholds: Thresholds, usable_cpus: float, recorded_s: float
) -> Seen | None:
    """What the trigger saw, when every condition holds; None while one does not."""
    steps = max(recent.steady_steps.values(), default=0)
    if steps < thresholds.auto_profile_min_steps or recorded_s < thresholds.auto_profile_min_s:
        return None
    waiting = None
    for index in recent.assigned_gpus():
        span = sustained_span(
            list(recent.gpu[index]), thresholds.gpu_busy_alert_pct, thresholds, above=False
        )
        if span is not None:
            waiting = (index, span.mean)
            break
    if waiting is None:
        return None  # no GPU of the job, or it is busy enough: nothing waits
    wall = sum(s[1] for s in recent.steps)
    if not recent.steps or wall <= 0:
        return None
    data_wait_pct = 100.0 * sum(s[2] for s in recent.steps) / wall
    if data_wait_pct >= thresholds.data_wait_alert_pct:
        return None  # dataloader-bound names it
    if any(swap > thresholds.swap_alert_bytes_per_s for _, _, swap in recent.host):
        return None  # swap-thrash may name it: a swapping host explains a slow step
    if _others_hold_the_cpus(recent, thresholds, usable_cpus):
        return None  # cpu-contention names it
    index, busy = waiting
    return Seen(index, round(busy, 1), round(data_wait_pct, 1), steps, round(recorded_s, 1))


def _others_hold_the_cpus(recent: Recent, thresholds: Thresholds, usable_cpus: float) -> bool:
    """The ``cpu-contention`` rule's test on the recent samples: the machine busy above the
    CPU alert while the job's own share of its usable CPUs stays below the best range."""
    busy = [b for _, b, _ in recent.host if b is not None]
    if not busy or sum(busy) / len(busy) < thresholds.cpu_load_alert_pct:
        return False
    cores = list(recent.job_cores.values())
    job_share = 100.0 * (sum(cores) / len(cores)) / usable_cpus if cores else 0.0
    return job_share < thresholds.cpu_load_best_pct


class AutoProfile:
    """The watch over one recording, on a thread of the recorder process, until it asks for
    its window, a window is asked by hand, or :meth:`stop`.

    ``say`` gets the one line said when the window is asked (torchdoctor's stderr, never the
    job's output); ``set_meta`` records what happened (the writer's ``set_meta``).
    """

    def __init__(
        self,
        recording: Path,
        thresholds: Thresholds,
        *,
        say: Callable[[str], None],
        set_meta: Callable[[dict[str, Any]], None],
        poll_s: float = POLL_S,
    ) -> None:
        self.recording = recording
        self.thresholds = thresholds
        self.say = say
        self.set_meta = set_meta
        self.poll_s = poll_s
        self.request_file = profile_folder(recording) / REQUEST_FILE
        self.recent = Recent.over(thresholds.sustained_s)
        self.asked: tuple[int, int] | None = None
        self._started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="torchdoctor-auto-profile", daemon=True
        )

    def start(self) -> None:
        self.set_meta({META_KEY: {"state": "watching"}})
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop watching; the tail's connection is closed before the writer folds its WAL."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            tail = RecordingTail(self.recording)
        except Exception as exc:  # noqa: BLE001 - never the job's problem: say it once, stop
            self.say(f"torchdoctor: automatic profiling off: cannot read the recording ({exc})")
            return
        try:
            usable = usable_cpus_of(tail.meta.get("host")) or 1.0
            while not self._stop.wait(self.poll_s):
                if self.request_file.exists():
                    return  # `torchdoctor profile` asked first: its window is this run's
                seen = self._look(tail, usable)
                if seen is not None:
                    self._ask(seen)
                    return
        except Exception as exc:  # noqa: BLE001
            self.say(f"torchdoctor: automatic profiling off ({type(exc).__name__}: {exc})")
        finally:
            tail.close()

    def _look(self, tail: RecordingTail, usable: float) -> Seen | None:
        recent = self.recent
        recent.add_steps(
            tail.new_tuples(
                "steps",
                ["pid", "step", "t_end", "wall_s", "data_wait_s", "profiled", "cuda_reserved"],
            )
        )
        recent.add_host(
            tail.new_tuples("host_samples", ["t", "cpu_busy", "swap_in_per_s", "swap_out_per_s"])
        )
        recent.add_processes(tail.new_tuples("process_samples", ["t", "cpu_percent"]))
        recent.add_gpus(tail.new_tuples("gpu_samples", ["t", "index", "utilization_gpu"]))
        recent.add_gpu_processes(
            tail.new_tuples("gpu_process_samples", ["gpu_index", "in_job", "used_memory"])
        )
        recent.prune()
        return judge(recent, self.thresholds, usable, time.monotonic() - self._started)

    def _ask(self, seen: Seen) -> None:
        request = request_window(self.recording, WINDOW_STEPS)
        self.asked = (request.first_step, request.last_step)
        self.set_meta(
            {
                META_KEY: {
                    "state": "asked",
                    "first_step": request.first_step,
                    "last_step": request.last_step,
                    "asked_at": time.time(),
                    **asdict(seen),
                }
            }
        )
        self.say(
            "torchdoctor: step slow with the GPU waiting and no host-side cause: profiling "
            f"steps {request.first_step}-{request.last_step} (opt out: {OPT_OUT})"
        )


def off_reason(env: Mapping[str, str], mode: str) -> str | None:
    """Why a session with the job environment ``env`` takes no automatic window (None: it
    may): a mode that is not a user's job, the user's opt-out, a window asked by hand."""
    from torchdoctor import config
    from torchdoctor.instrument.agent.contract import ENV_PROFILE_STEPS

    if mode not in MODES:
        return f"{mode} records a measurement of its own"
    if env.get(ENV_PROFILE_STEPS):
        return "a window was asked (--profile-steps)"
    on, where = config.auto_profile(env)
    if not on:
        if where == f"${config.ENV_AUTO_PROFILE}":
            where = f"{OPT_OUT} or ${config.ENV_AUTO_PROFILE}=0"  # the flag sets the variable
        return f"switched off ({where})"
    return None
