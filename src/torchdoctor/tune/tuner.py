"""`torchdoctor tune`'s engine: the user's command run in short trials, searched and verified.

The first trial runs the script exactly as written: it tells the job's own settings, calibrates
the trial length and is diagnosed for a first suggestion. The search and verification then run
trials with overrides applied by the instrumentation, under one hard time budget.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from torchdoctor.errors import UserError
from torchdoctor.run.process import resolve_command
from torchdoctor.sampling.hostinfo import whole_cpus_here
from torchdoctor.tune.measure import ObservedJob
from torchdoctor.tune.result import Measurement, TuneResult
from torchdoctor.tune.search import Search, SearchLimits
from torchdoctor.tune.space import Config, Space
from torchdoctor.tune.trial import TrialLimits, TrialRunner
from torchdoctor.units import fmt_duration

DEFAULT_BUDGET_S = 300.0
MIN_BUDGET_S = 20.0
# A search converges in minutes; a day is far beyond any useful tune, and a budget of years
# (--budget 99999999h) is a typo that would keep the machine busy until someone notices.
MAX_BUDGET_S = 86400.0
KEEP_FREE = 0.5  # share of the RAM available at the start that the job must leave free
_PLACEHOLDER = Config(num_workers=0, num_threads=1)


def available_memory() -> int:
    """RAM available to the trials now (the one free-RAM rule)."""
    from torchdoctor.sampling.hostinfo import available_ram

    return available_ram()


def tune_folder(base: Path | None = None) -> Path:
    """<recordings folder>/tune-<UTC time>/ (a new one each time, made by this call)."""
    from torchdoctor.config import runs_dir_setting
    from torchdoctor.recording.paths import create_unique_folder

    root, setter = runs_dir_setting(base)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    option = "--out-dir" if setter is None else f"--out-dir or change {setter}"
    return create_unique_folder(root / f"tune-{stamp}", option)


def suggestion_from_diagnosis(recording_path: str, original: Config) -> Config | None:
    """The diagnosis' recommended settings for the first trial, applied to ``original``."""
    from torchdoctor.diagnosis.engine import diagnose
    from torchdoctor.recording import open_recording
    from torchdoctor.thresholds import load_thresholds

    changes: dict = {}
    try:
        with open_recording(recording_path) as rec:
            findings = diagnose(rec, load_thresholds())
    except Exception:  # noqa: BLE001 - a diagnosis problem only costs tune its head start
        return None
    keys = {
        "num_workers": "num_workers",
        "prefetch_factor": "prefetch_factor",
        "pin_memory": "pin_memory",
        "persistent_workers": "persistent_workers",
        "torch.num_threads": "num_threads",
        "num_threads": "num_threads",
    }
    for finding in findings:
        for key, value in (finding.settings or {}).items():
            field = keys.get(key)
            if field is None or field in changes:
                continue
            if field in ("pin_memory", "persistent_workers"):
                changes[field] = bool(value)
            else:
                try:
                    changes[field] = int(value)
                except (TypeError, ValueError):
                    continue
    if not changes:
        return None
    suggestion = replace(original, **changes).normalized()
    return suggestion if suggestion != original else None


def check_limits(budget_s: float, trial_timeout_s: float | None, trial_steps: int | None) -> None:
    """The tune's limits, refused before anything starts or is printed."""
    if budget_s < MIN_BUDGET_S:
        raise UserError(
            f"--budget {budget_s:g}s is too short: tune needs at least {MIN_BUDGET_S:g}s "
            "(a few trials of the job); try --budget 5m"
        )
    if not budget_s <= MAX_BUDGET_S:
        raise UserError(
            f"--budget {fmt_duration(budget_s)} is too long: use at most "
            f"{MAX_BUDGET_S / 3600:g}h (a tune usually converges within minutes)"
        )
    if trial_timeout_s is not None and not (0 < trial_timeout_s <= MAX_BUDGET_S):
        # nan passed a `<= 0` check and then no stall could ever exceed it: hang detection off
        raise UserError(
            f"--trial-timeout {trial_timeout_s:g}: give the seconds a trial may go without a "
            f"step, above 0 and at most {MAX_BUDGET_S:g}"
        )
    if trial_steps is not None and trial_steps < 5:
        raise UserError(f"--trial-steps {trial_steps} is too few: use 5 or more (default: auto)")


def tune_command(
    argv: list[str],
    *,
    budget_s: float = DEFAULT_BUDGET_S,
    trial_steps: int | None = None,
    trial_timeout_s: float | None = None,
    keep_free: float = KEEP_FREE,
    folder: Path | None = None,
    signals_held: bool = False,
    on_trial: Callable[[Measurement], None] | None = None,
    on_start: Callable[[int, Config, str], None] | None = None,
    on_phase: Callable[[str], None] | None = None,
    on_folder: Callable[[Path], None] | None = None,
    env: dict[str, str] | None = None,
) -> TuneResult:
    """Tune ``argv``'s DataLoader and thread settings within ``budget_s`` seconds.

    Raises UserError when the command cannot be tuned (it fails as written, takes no
    optimizer step, or the budget is too small to run it twice).
    """
    check_limits(budget_s, trial_timeout_s, trial_steps)
    executable = resolve_command(list(argv))
    started = time.monotonic()
    deadline = started + budget_s
    if folder is None:
        folder = tune_folder()
    else:
        # Checked writable now: an unusable --out-dir (/proc/1) used to be found by the first
        # trial, after "trial 0" was printed, in words of an option tune does not have.
        from torchdoctor.recording.paths import prepare_folder

        prepare_folder(folder, "--out-dir")
    if on_folder is not None:
        on_folder(folder)  # the trials record there: said before the first one starts
    memory_budget = int(available_memory() * (1 - keep_free))
    cpus = whole_cpus_here()
    timeout = trial_timeout_s
    runner = TrialRunner(
        executable=executable,
        argv=list(argv),
        folder=folder,
        env=dict(os.environ if env is None else env),
        memory_budget=memory_budget,
        measured_steps=trial_steps,
        # Short trials for short budgets: about 40 trials fit in the budget.
        window_s=min(15.0, max(2.0, budget_s / 40)),
        # The first trial shows how long the job takes to start: only the budget limits it.
        limits=TrialLimits(startup_s=budget_s / 2, stall_s=timeout or 60.0),
        signals_held=signals_held,
        on_trial=on_trial,
        on_start=on_start,
    )
    try:
        if on_phase:
            on_phase("original")
        first = runner(_PLACEHOLDER, "original", deadline)
        observed = runner.observed
        if first.status == "interrupted":
            first.config = observed.config if observed and observed.config else first.config
            partial = _partial(first, started, budget_s, memory_budget)
            partial.stop_signal = runner.stop_signal
            return partial
        if observed is None or observed.config is None:
            if first.reason.startswith(("exit status", "killed by")):
                raise UserError(
                    f"the command does not run as written: {first.reason}. Fix that first "
                    f"(its output is in {first.log})"
                )
            raise UserError(
                "the command took no training step (no torch optimizer.step()) "
                + (f"({first.reason}); " if first.reason else "; ")
                + f"tune needs a training loop. Its output: {first.log}"
            )
        original = observed.config
        first.config = original
        if not first.ok:
            raise UserError(
                f"the command does not run as written: {first.reason}. Fix that first "
                f"(its output is in {first.log})"
            )
        runner.limits = limits_after(first, trial_timeout_s)
        space = space_for(observed, cpus)
        suggestion = suggestion_from_diagnosis(first.recording, original)
        if on_phase:
            on_phase("search")
        search = Search(
            space,
            runner,
            original,
            suggestions=[suggestion] if suggestion else [],
            limits=SearchLimits(deadline=deadline),
            first=first,
        )
        result = search.run()
    finally:
        runner.close()
    result.elapsed_s = time.monotonic() - started
    result.budget_s = budget_s
    result.memory_budget = memory_budget
    result.threads_set_in_script = runner.threads_set_in_script
    result.trial_steps = runner.measured_steps
    result.stop_signal = runner.stop_signal
    result.notes.extend(_notes(result, space, observed, runner, suggestion))
    return result


def space_for(observed: ObservedJob, cpus: int) -> Space:
    """The settings worth searching for this job on this machine.

    pin_memory only matters when the model is on a GPU, and persistent_workers only where
    the trials see an epoch end; otherwise they keep the job's own values.
    """
    original = observed.config
    space = Space.for_machine(
        cpus,
        tune_pin_memory=any(str(d).startswith("cuda") for d in observed.devices),
        tune_persistent=observed.epochs_seen > 1,
        include=original,
    )
    if not observed.has_loader:
        space = replace(space, num_workers=(0,))
    return space


STARTUP_FLOOR_S = 30.0


def limits_after(first: Measurement, timeout: float | None = None) -> TrialLimits:
    """Limits for every later trial, scaled on the first one."""
    step_s = 1 / first.throughput if first.throughput else 1.0
    to_first = first.first_step_s or first.duration_s
    return TrialLimits(
        # Start-up (interpreter, imports, workers) slows more than steps do when the machine
        # gets busier mid-tune: never call a trial hung before STARTUP_FLOOR_S.
        startup_s=max(timeout or 0.0, STARTUP_FLOOR_S, 2 * to_first),
        stall_s=timeout or max(20.0, 30 * step_s),
        # A configuration 3x slower than the job as written is no candidate: measure what
        # it did by then and move on.
        cap_s=max(3 * first.duration_s, first.duration_s + 20.0),
    )


def _partial(first: Measurement, started: float, budget_s: float, memory_budget: int):
    return TuneResult(
        original=first.config,
        recommended=first.config,
        candidate=None,
        trials=[first],
        noise=0.0,
        verification=None,
        stopped="interrupted",
        elapsed_s=time.monotonic() - started,
        search_s=time.monotonic() - started,
        budget_s=budget_s,
        memory_budget=memory_budget,
    )


def _notes(result: TuneResult, space: Space, observed, runner, suggestion) -> list[str]:
    notes = []
    if result.stopped == "budget":
        done = [m.duration_s for m in result.trials if m.ok]
        per_trial = statistics.median(done) if done else 0.0
        searched = sum(1 for m in result.trials if m.purpose in ("search", "suggested"))
        if searched < 4 and per_trial > 0:
            suggested = math.ceil(per_trial * 16 / 60)
            notes.append(
                f"The budget ran out after {searched} search trial(s): each trial of this job "
                f"takes about {per_trial:.0f} s. Give it --budget {suggested}m or more, or "
                "shorten the trials with --trial-steps."
            )
        else:
            notes.append(
                "The budget ended the search before it converged: a larger --budget may find more."
            )
    if result.stopped == "interrupted":
        notes.append("Interrupted: the results so far are shown, nothing was verified.")
    if result.candidate is not None and result.candidate != result.original:
        v = result.verification
        if v is None or not v.confirmed:
            why = v.reason if v is not None else "no verification ran"
            notes.append(f"Keeping your settings: the search's pick was not verified ({why}).")
    if len(space.persistent_workers) == 1 and observed.has_loader:
        notes.append(
            "persistent_workers was left as it is: the trials never reached the end of an "
            "epoch, where it matters."
        )
    if len(space.pin_memory) == 1 and observed.has_loader:
        notes.append("pin_memory was left as it is: the model trains on the CPU.")
    if not observed.has_loader:
        notes.append("The job builds no DataLoader: only the trainer's threads were tuned.")
    if runner.threads_set_in_script:
        notes.append(
            "The script calls torch.set_num_threads() itself, which OMP_NUM_THREADS does not "
            "override: change that call's value instead."
        )
    cut = [m for m in result.trials if m.ok and "time cap" in m.reason]
    if cut:
        notes.append(f"{len(cut)} slow trial(s) were measured on the steps they made by the cap.")
    if suggestion is not None:
        notes.append(f"The diagnosis of the first trial suggested {suggestion.label()}.")
    done = [m.duration_s for m in result.trials if m.ok]
    if done:
        notes.append(
            f"A trial took {statistics.median(done):.1f} s (median); "
            f"{runner.measured_steps} measured steps each."
        )
    return notes
