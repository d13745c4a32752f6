"""Pieces shared by the recording commands (`run`, `attach`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click
from rich.console import Console

from torchdoctor.errors import UserError
from torchdoctor.recording.paths import claim_recording_file, create_recording_file
from torchdoctor.recording.recorder import DEFAULT_INTERVAL_S, MAX_INTERVAL_S, MIN_INTERVAL_S

interval_option = click.option(
    "--interval",
    type=float,
    default=DEFAULT_INTERVAL_S,
    show_default=True,
    metavar="S",
    help=f"Seconds between samples ({MIN_INTERVAL_S}-{MAX_INTERVAL_S:g}).",
)
out_option = click.option(
    "--out",
    type=click.Path(dir_okay=False),
    default=None,
    metavar="FILE",
    help="Where to write the recording (default: ./torchdoctor-runs/<UTC time>-<command>.sqlite).",
)
thresholds_option = click.option(
    "--thresholds",
    type=click.Path(dir_okay=False),
    default=None,
    metavar="FILE",
    help="TOML file overriding the threshold table (default: [tool.torchdoctor.thresholds] in pyproject.toml).",
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


def new_recording(out: str | None, name: str) -> Path:
    """The recording file of this run, created now: --out exactly, else a fresh unique name."""
    return claim_recording_file(out) if out else create_recording_file(name)


def check_interval(interval: float) -> None:
    if not (MIN_INTERVAL_S <= interval <= MAX_INTERVAL_S):
        raise UserError(
            f"--interval {interval:g} is out of range: use {MIN_INTERVAL_S}-{MAX_INTERVAL_S:g} seconds"
        )


def job_name(argv: list[str]) -> str:
    """A short name for file names: `python train.py` -> `python-train`."""
    base = os.path.basename(argv[0])
    for arg in argv[1:]:
        if arg == "-m":
            continue
        if not arg.startswith("-"):
            return f"{base}-{Path(arg).stem}" if base.startswith("python") else base
        break
    return base


def stderr_console() -> Console:
    return Console(file=sys.stderr, highlight=False, soft_wrap=True)


def print_end_report(path: Path, console: Console, thresholds_path: str | None) -> None:
    """The summary, then the findings, on stderr; problems here never change the exit status."""
    from torchdoctor.cli.summary_view import render_summary
    from torchdoctor.recording import open_recording
    from torchdoctor.recording.summary import summarize

    try:
        with open_recording(path) as rec:
            render_summary(summarize(rec), console)
            _print_findings(rec, console, thresholds_path)
    except UserError as exc:
        console.print(f"torchdoctor: could not summarize the recording: {exc.message}")
    except Exception as exc:  # noqa: BLE001 - the report is a courtesy; never fail the run
        console.print(
            f"torchdoctor: could not summarize the recording ({type(exc).__name__}: {exc})"
        )


def _print_findings(rec, console: Console, thresholds_path: str | None) -> None:
    try:
        from torchdoctor.diagnosis.engine import diagnose
        from torchdoctor.diagnosis.render import render_findings
    except ImportError:
        return
    from torchdoctor.thresholds import load_thresholds

    findings = diagnose(rec, load_thresholds(thresholds_path))
    render_findings(findings, console)
