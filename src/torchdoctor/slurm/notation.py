"""Slurm's own notation for sizes and durations, read and written.

Slurm counts memory in MiB ("M"; its documentation says megabytes, its code multiplies by
1024) with suffixes K, M, G, T; durations are ``[days-]hours:minutes:seconds`` with shorter
forms accepted on input (sbatch.1 "--time").
"""

from __future__ import annotations

import math

from torchdoctor import units
from torchdoctor.errors import UserError

# Sizing writes its figures in this notation; the Slurm side reads and writes the same.
from torchdoctor.sizing.size import MAX_TIME_LIMIT_S as MAX_TIME_LIMIT_S
from torchdoctor.sizing.size import MIB as MIB
from torchdoctor.sizing.size import format_memory as format_memory
from torchdoctor.units import parse_size

UNLIMITED = ("UNLIMITED", "INFINITE", "NONE", "INVALID", "N/A", "")


def parse_memory(text: str) -> int | None:
    """Bytes in a Slurm memory figure ("1280M", "64G", "500" = MiB), None for none/unlimited."""
    if text.strip().upper() in UNLIMITED:
        return None
    try:
        return parse_size(text, "memory", bare_unit=MIB)
    except UserError:
        return None


def parse_duration(text: str) -> int | None:
    """Seconds in a Slurm duration, None for UNLIMITED/INVALID or what is not one.

    Read as sbatch does: "MM" (a bare number is minutes in Slurm's notation), "MM:SS",
    "HH:MM:SS", "D-HH", "D-HH:MM", "D-HH:MM:SS"."""
    if text.strip().upper() in UNLIMITED:
        return None
    try:
        return int(units.parse_duration(text, bare_unit=60))
    except UserError:
        return None


def require_duration(text: str, option: str) -> int:
    """A duration the user typed, in torchdoctor's one vocabulary (5m, 1h30m, HH:MM:SS); a bare
    number is refused, as Slurm would read it as minutes and the rest of torchdoctor as seconds."""
    seconds = units.parse_duration(text, option, bare=False)
    if seconds <= 0:
        raise UserError(f"{option} {text!r} must be longer than zero (or `auto`)")
    if seconds > MAX_TIME_LIMIT_S:
        raise UserError(
            f"{option} {text!r} is longer than 365 days, more than any Slurm partition grants; "
            "give the job's real time limit"
        )
    return int(seconds)


def format_duration(seconds: float) -> str:
    """``HH:MM:SS`` (hours may pass 24, which sbatch accepts), rounded up to the second."""
    total = math.ceil(seconds)
    h, rest = divmod(total, 3600)
    m, s = divmod(rest, 60)
    return f"{h:02d}:{m:02d}:{s:02d}"
