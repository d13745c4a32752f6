"""Pieces shared by the recording commands (`run`, `attach`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click
from rich.console import Console

from torchdoctor.errors import UserError
from torchdoctor.recording.recorder import DEFAULT_INTERVAL_S, MAX_INTERVAL_S, MIN_INTERVAL_S
from torchdoctor.sampling.roles import is_python
from torchdoctor.terminal import make_console


def _interval_setting(ctx: click.Context, param: click.Parameter, value: str | None) -> float:
    """--interval, else $TORCHDOCTOR_INTERVAL or the config files, else the built-in default;
    checked here, so that a bad value is refused before anything starts, in the words of
    whoever set it (a variable or a file the user may have forgotten about)."""
    from torchdoctor import config
    from torchdoctor.units import parse_duration

    if value is not None:
        seconds = parse_duration(value, "--interval", examples=INTERVAL_EXAMPLES)
        check_interval(seconds)
        return seconds
    seconds, where = config.interval(DEFAULT_INTERVAL_S, INTERVAL_EXAMPLES)
    if where is not None:
        check_interval(seconds, where)
    return seconds


# What a bad interval's message offers: values inside MIN_INTERVAL_S-MAX_INTERVAL_S
INTERVAL_EXAMPLES = "0.5, 2s or 250ms"


interval_option = click.option(
    "--interval",
    default=None,
    callback=_interval_setting,
    metavar="TIME",
    help=f"Time between samples, {MIN_INTERVAL_S}-{MAX_INTERVAL_S:g} s (e.g. 0.5, 2s; "
    f"default: $TORCHDOCTOR_INTERVAL, interval in the config, else {DEFAULT_INTERVAL_S:g} s).",
)
out_option = click.option(
    "-o",
    "--out",
    type=click.Path(dir_okay=False),
    default=None,
    metavar="FILE",
    help="Where to write the recording (default: <recordings folder>/<UTC time>-<command>.sqlite; "
    "the folder is $TORCHDOCTOR_RUNS_DIR, runs_dir in the config, or ./torchdoctor-runs).",
)

keep_option = click.option(
    "--keep",
    type=click.Choice(["compact", "full"]),
    default="compact",
    show_default=True,
    help="compact: samples older than 15 minutes are folded into one row per minute "
    "(means, with min/max beside; the start-up and the minutes around every event kept "
    "whole), so a week of a node stays a file of about 150 MB; full: keep every sample.",
)


def _thresholds_setting(ctx: click.Context, param: click.Parameter, value: str | None):
    """Checked now (a bad file fails before anything starts), then handed to every diagnosis
    this command runs, however deep (the exporter's, tune's, slurm status'), and to the
    processes it starts, as $TORCHDOCTOR_THRESHOLDS: the flag outranks the variable.

    Without the flag every other layer (config.toml, pyproject.toml, $TORCHDOCTOR_THRESHOLDS)
    is loaded and checked all the same: `run` diagnoses only after the job ended, and a bad
    key found then would lose the diagnosis of a job that may have run for hours."""
    from torchdoctor.config import ENV_THRESHOLDS
    from torchdoctor.thresholds import load_thresholds

    if value == "":
        # abspath('') is the cwd: an empty name would hand the current folder to every
        # diagnosis and child process as the thresholds file
        raise click.BadParameter("an empty file name: give the path of a TOML file", ctx, param)
    load_thresholds(value)
    if value is None:
        return None
    os.environ[ENV_THRESHOLDS] = os.path.abspath(value)
    return value


thresholds_option = click.option(
    "--thresholds",
    type=click.Path(dir_okay=False),
    default=None,
    callback=_thresholds_setting,
    metavar="FILE",
    help="TOML file overriding the threshold table (default: $TORCHDOCTOR_THRESHOLDS, "
    "[tool.torchdoctor.thresholds] in pyproject.toml, [thresholds] in the user config).",
)

python_option = click.option(
    "--python",
    "python",
    type=click.Path(dir_okay=False),
    default=None,
    metavar="PATH",
    help="The training environment's Python, for the job and torch (default: the command's "
    "interpreter, else the active virtualenv/conda env, else torchdoctor's own).",
)


def run_in_job_python(python: str | None) -> None:
    """Relay this whole command into the training environment's Python when that is not ours
    (it imports torch, which is the job's): see :mod:`torchdoctor.run.interpreter`."""
    from torchdoctor.run.interpreter import find_job_python, relay_if_needed

    relay_if_needed(find_job_python(explicit=python), sys.argv[1:])


def check_interval(interval: float, option: str = "--interval") -> None:
    """``option`` names who set the value: the flag, ``$TORCHDOCTOR_INTERVAL`` or a file."""
    if not (MIN_INTERVAL_S <= interval <= MAX_INTERVAL_S):
        raise UserError(
            f"{option} {interval:g} is out of range: use {MIN_INTERVAL_S:g}-{MAX_INTERVAL_S:g} "
            f"seconds (e.g. {INTERVAL_EXAMPLES})"
        )


def job_name(argv: list[str]) -> str:
    """A short name for file names: `python train.py` -> `python-train`."""
    base = os.path.basename(argv[0])
    for arg in argv[1:]:
        if arg == "-m":
            continue
        if not arg.startswith("-"):
            return f"{base}-{Path(arg).stem}" if is_python(base) else base
        break
    return base


def stderr_console() -> Console:
    return make_console(stderr=True, soft_wrap=True)


no_auto_profile_option = click.option(
    "--no-auto-profile",
    is_flag=True,
    help="Never profile a window of steps on our own (by default, once per run, when the step "
    "is slow with the GPU waiting and no host-side cause, 5 steps are profiled; also "
    "$TORCHDOCTOR_AUTO_PROFILE=0 or auto_profile = false in the config).",
)


def auto_profile_env(no_auto_profile: bool) -> dict[str, str]:
    """The job's environment for ``--no-auto-profile`` (empty without it): the variable the
    recorder reads (run/auto_profile.py), so it goes wherever the job's environment goes (the
    ranks of launch, a queued job). Without the flag the setting is checked now: a bad value
    in the variable or a file is refused before the job starts, not found while it runs."""
    from torchdoctor import config

    if no_auto_profile:
        return {config.ENV_AUTO_PROFILE: "0"}
    config.auto_profile()
    return {}


def profile_steps_env(value: str | None, no_instrument: bool) -> dict[str, str]:
    """The job's environment for ``--profile-steps A-B`` (empty without it), checked before
    anything starts: the agent arms the window (instrument/agent/profile.py)."""
    if value is None:
        return {}
    from torchdoctor.instrument.agent.contract import ENV_PROFILE_STEPS
    from torchdoctor.instrument.agent.profile import parse_steps

    if no_instrument:
        raise click.UsageError("--profile-steps needs the instrumentation: drop --no-instrument")
    try:
        first, last = parse_steps(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--profile-steps") from None
    return {ENV_PROFILE_STEPS: f"{first}-{last}"}
