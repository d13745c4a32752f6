"""One trial: the user's unmodified command, run once with given settings, recorded the way
`torchdoctor run` records it, measured, and cleaned up to the last process.

Each trial runs in its own process group with stdin from /dev/null and its output in a log
file beside its recording. A terminal's Ctrl-C therefore reaches only the tuner, which stops
the trial's whole tree itself (TERM, then KILL) and reaps it: nothing outlives a trial.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from torchdoctor.errors import UserError
from torchdoctor.instrument.agent import ENV_OVERRIDES, ENV_STOP_AFTER_STEPS, STOPPED_EXIT_STATUS
from torchdoctor.recording import RecordingWriter, open_recording
from torchdoctor.run.process import ChildProcess, ProcessTree, stop_tree, wait_for_signal
from torchdoctor.run.session import RecordingSession, claim_file
from torchdoctor.tune.measure import (
    ObservedJob,
    memory_peak,
    observed_job,
    snapshot_memory,
    step_window,
    trial_warmup,
)
from torchdoctor.tune.result import FAILED, INTERRUPTED, OK, REJECTED, Measurement
from torchdoctor.tune.space import Config
from torchdoctor.units import fmt_bytes

# Runs of the original settings start the script exactly as written (no overrides at all), so
# a loader the first DataLoader does not represent (a validation loader) keeps its own values.
UNCHANGED_PURPOSES = ("original", "verify-original")
POLL_S = 0.1
TEARDOWN_S = 2.0  # stopping a trial and reading its recording: kept inside the budget
KILL_GRACE_S = 3.0
EXIT_GRACE_S = 60.0  # from the job's "stopped after steps" to its exit: a busy machine is slow
MIN_MEASURED_STEPS = 5
CALIBRATION_MIN_STEPS = 10
CALIBRATION_MAX_STEPS = 2000


class TrialWriter(RecordingWriter):
    """A RecordingWriter that also watches the trial as it runs: steps arriving from the
    job's agents, and memory and swap from each snapshot against the budget."""

    def __init__(self, path: Path, meta: dict, memory_budget: int | None) -> None:
        super().__init__(path, meta)
        self.memory_budget = memory_budget
        self.steps_seen = 0
        self.first_step_at: float | None = None  # monotonic arrival times
        self.last_step_at: float | None = None
        self.warm_at: float | None = None  # arrival of the step that ends the warm-up
        self.warmup = 0
        self.violation: str | None = None
        self.stopping_at: float | None = None  # arrival of the job's "stopped-after-steps"

    def add_steps(self, records) -> None:
        records = list(records)
        super().add_steps(records)
        if not records:
            return
        now = time.monotonic()
        self.steps_seen += len(records)
        if self.first_step_at is None:
            self.first_step_at = now
        self.last_step_at = now
        if self.warm_at is None and self.steps_seen >= self.warmup:
            self.warm_at = now

    def add_events(self, records) -> None:
        records = list(records)
        super().add_events(records)
        if self.stopping_at is None and any(r.kind == "stopped-after-steps" for r in records):
            self.stopping_at = time.monotonic()

    def write_snapshot(self, snap) -> None:
        super().write_snapshot(snap)
        if self.violation is not None:
            return
        used = snapshot_memory(snap.processes)
        if self.memory_budget is not None and used > self.memory_budget:
            self.violation = (
                f"memory {fmt_bytes(used)} above the budget {fmt_bytes(self.memory_budget)} "
                "(half of the RAM available when tune started)"
            )
        elif snap.host is not None and (snap.host.swap_out_per_s or 0) > 0:
            self.violation = f"the host swapped out {snap.host.swap_out_per_s / 1e6:.1f} MB/s"


@dataclass(slots=True)
class TrialLimits:
    """When a trial is stopped by the tuner."""

    startup_s: float = 300.0  # until its first step
    stall_s: float = 60.0  # between steps: longer means it hangs
    cap_s: float | None = None  # whole trial; a slow configuration is measured on what it did


@dataclass
class TrialRunner:
    """Runs trials of one command; callable as the search's ``measure`` function.

    ``measured_steps`` None: the first trial calibrates it, running until its measured
    window lasts ``window_s`` (at least 10 steps), so that later trials of a faster or
    slower job last about as long.
    """

    executable: str
    argv: list[str]
    folder: Path
    env: dict[str, str]
    memory_budget: int | None = None
    measured_steps: int | None = None
    window_s: float = 5.0
    limits: TrialLimits = field(default_factory=TrialLimits)
    interval_s: float = 0.5
    signals_held: bool = False
    on_trial: Callable[[Measurement], None] | None = None
    on_start: Callable[[int, Config, str], None] | None = None
    observed: ObservedJob | None = None  # what the first trial's job reported
    interrupted: bool = False
    stop_signal: int | None = None  # SIGINT, SIGTERM or SIGHUP, when one interrupted a trial
    threads_set_in_script: bool = False  # seen in a trial that overrode the threads
    _index: int = 0
    _gpus: object = None

    def close(self) -> None:
        if self._gpus is not None:
            with contextlib.suppress(Exception):
                self._gpus.close()
            self._gpus = None

    def __call__(self, config: Config, purpose: str, deadline: float | None) -> Measurement:
        index = self._index
        self._index += 1
        if self.on_start is not None:
            self.on_start(index, config, purpose)
        if self.interrupted:
            m = Measurement(index, config, purpose, INTERRUPTED, reason="interrupted")
        else:
            m = self._run(index, config, purpose, deadline)
        if self.on_trial is not None:
            self.on_trial(m)
        return m

    # -- one trial ----------------------------------------------------------------------------

    def _env(self, config: Config, purpose: str) -> dict[str, str]:
        env = dict(self.env)
        for key in (ENV_OVERRIDES, ENV_STOP_AFTER_STEPS):
            env.pop(key, None)
        if purpose not in UNCHANGED_PURPOSES:
            env[ENV_OVERRIDES] = json.dumps(config.overrides())
            env["OMP_NUM_THREADS"] = str(config.num_threads)
        steps = self.measured_steps or CALIBRATION_MAX_STEPS
        env[ENV_STOP_AFTER_STEPS] = str(trial_warmup(config) + steps)
        return env

    def _run(self, index: int, config: Config, purpose: str, deadline: float | None):
        if self._gpus is None:
            from torchdoctor.sampling.gpus import GpuReader

            self._gpus = GpuReader()
        # Two tunes given the same --out-dir folder must not share a trial's file.
        path = claim_file(
            None, f"trial-{index:02d}", folder=self.folder, stamp=False, option="--out-dir"
        )
        log = path.with_suffix(".log")
        env = self._env(config, purpose)
        session = RecordingSession(
            path,
            mode="tune-trial",
            command=self.argv,
            interval=self.interval_s,
            env=env,
            gpus=self._gpus,
            meta={"tune": {"index": index, "purpose": purpose, "config": config.as_dict()}},
            writer=lambda p, meta: TrialWriter(p, meta, self.memory_budget),
        )
        writer = session.writer
        writer.warmup = trial_warmup(config)
        env = session.wire_agent(env, warn=lambda message: None)
        if session.agent_error is not None:
            session.end(None)
            raise UserError(
                f"cannot listen for the job's instrumentation ({session.agent_error}); "
                "tune needs it to count steps: check that TMPDIR or /tmp is writable"
            )
        started = time.monotonic()
        try:
            child = TrialProcess(self.executable, self.argv, env, log)
        except BaseException:
            session.end(None, start_error=True)
            raise
        session.start_recorder(child.pid)
        session.announce(child.pid)  # `top` and the exporter show the trial while it runs
        outcome = None
        try:
            outcome = self._watch(child, writer, started, deadline)
        finally:
            if outcome is None:  # an exception (KeyboardInterrupt in a notebook) got us here
                self.interrupted = True
            child.stop()
            session.end(child.returncode)
        duration = time.monotonic() - started
        return self._measure(
            index, config, purpose, outcome, child, writer, started, path, log, duration
        )

    def _watch(self, child: TrialProcess, writer: TrialWriter, started: float, deadline):
        """Wait for the trial to end or for a reason to stop it: (status, reason)."""
        calibrating = self.measured_steps is None
        while True:
            if self._wait_signal():
                self.interrupted = True
                return INTERRUPTED, "interrupted"
            if child.poll() is not None:
                return None, ""
            now = time.monotonic()
            if writer.violation is not None:
                return REJECTED, writer.violation
            if deadline is not None and now >= deadline - TEARDOWN_S:
                return INTERRUPTED, "budget reached"
            if writer.last_step_at is None:
                if now - started > self.limits.startup_s:
                    return FAILED, f"hung: no training step within {self.limits.startup_s:.0f} s"
                continue
            if writer.stopping_at is not None:
                # Every step asked for is taken and the job is exiting, which on a busy machine
                # can take longer than a step ever did: no hang, and the steps are measured.
                if now - writer.stopping_at > EXIT_GRACE_S:
                    return OK, f"still running {EXIT_GRACE_S:.0f} s after its last step"
                continue
            if now - writer.last_step_at > self.limits.stall_s:
                return FAILED, f"hung: no training step for {self.limits.stall_s:.0f} s"
            if self.limits.cap_s is not None and now - started > self.limits.cap_s:
                return OK, f"cut at the trial time cap ({self.limits.cap_s:.0f} s)"
            if (
                calibrating
                and writer.warm_at is not None
                and writer.steps_seen - writer.warmup >= CALIBRATION_MIN_STEPS
                and now - writer.warm_at >= self.window_s
            ):
                return OK, ""

    def _wait_signal(self) -> bool:
        if self.signals_held:
            signum = wait_for_signal(POLL_S)
            if signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                self.stop_signal = self.stop_signal or signum
                return True
            return False
        time.sleep(POLL_S)
        return False

    def _measure(
        self, index, config, purpose, outcome, child, writer, started, path, log, duration
    ):
        status, reason = outcome if outcome is not None else (INTERRUPTED, "interrupted")
        m = Measurement(
            index,
            config,
            purpose,
            FAILED,
            duration_s=duration,
            recording=str(path),
            log=str(log),
        )
        with open_recording(path) as rec:
            # Column arrays and SQL aggregates: a trial of the original job can be long.
            steps = rec.frame("steps")
            step_count = len(steps)
            warmup = trial_warmup(config)
            window = step_window(steps, warmup)
            observed = observed_job(rec)
            m.peak_memory = memory_peak(rec)
            (swapped,) = next(rec.iter_query("SELECT MAX(swap_out_per_s) FROM host_samples"))
        if purpose == "original" and observed.config is not None:
            m.config = observed.config  # the script's own settings, as it reported them
        if status != INTERRUPTED:
            if self.observed is None:
                self.observed = observed
            self.threads_set_in_script |= observed.threads_set_in_script
        if writer.first_step_at is not None:
            m.first_step_s = writer.first_step_at - started
        if window is not None:
            m.throughput = window.steps_per_s
            m.samples_per_s = window.samples_per_s
            m.steps = window.steps
            m.warmup_steps = warmup
            m.spread = window.spread
            m.data_wait_share = window.data_wait_share
            m.step_s = window.step_s
        if status is None:  # the command ended by itself
            code = child.returncode
            if code == STOPPED_EXIT_STATUS or code == 0:
                status = OK
                if code == 0:
                    reason = f"the command ended by itself after {step_count} steps"
            else:
                status, reason = FAILED, _failure(code, log)
        budget = self.memory_budget
        if status == OK:
            if m.peak_memory is not None and budget is not None and m.peak_memory > budget:
                status = REJECTED
                reason = f"memory {fmt_bytes(m.peak_memory)} above the budget {fmt_bytes(budget)}"
            if status == OK and swapped:
                status = REJECTED
                reason = f"the host swapped out {swapped / 1e6:.1f} MB/s"
        if status == OK and (window is None or window.steps < MIN_MEASURED_STEPS):
            status = FAILED
            reason = f"too few steps to measure: {step_count} steps, {warmup} of them warm-up" + (
                f" ({reason})" if reason else ""
            )
        if status == OK and self.measured_steps is None:
            self.measured_steps = max(CALIBRATION_MIN_STEPS, window.steps)
        m.status = status
        m.reason = reason
        return m


def _failure(code: int, log: Path) -> str:
    """Why a trial's command failed, in one line: its status and its last error line."""
    if code > 128:
        name = _signal_name(code - 128)
        text = f"killed by {name}"
        if code - 128 == signal.SIGKILL:
            text += " (out of memory?)"
    else:
        text = f"exit status {code}"
    last = _last_error_line(log)
    return f"{text}: {last}" if last else text


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def _last_error_line(log: Path) -> str:
    try:
        with open(log, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 8192))
            lines = fh.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return ""
    for line in reversed(lines):
        line = line.strip()
        if line:
            return line[:200]
    return ""


class TrialProcess(ChildProcess):
    """The trial's command in a new process group, stdout+stderr to ``log``, no stdin."""

    def __init__(self, executable: str, argv: list[str], env: dict[str, str], log: Path) -> None:
        super().__init__(executable, argv, env, log=log, new_group=True)

    def stop(self) -> None:
        """End the command and every process it started (those that left its process group
        included), then reap it. Also run after a clean exit: DataLoader workers of a
        crashed trainer would otherwise live on until their watchdog notices."""
        stop_tree(ProcessTree(self.pid), KILL_GRACE_S)
        while self.poll() is None:  # KILLed: the kernel takes it down now
            time.sleep(0.02)
