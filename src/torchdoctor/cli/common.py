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
            return f"{base}-{Path(arg).stem}" if is_python(base) else base
        break
    return base


def stderr_console() -> Console:
    return Console(file=sys.stderr, highlight=False, soft_wrap=True)
