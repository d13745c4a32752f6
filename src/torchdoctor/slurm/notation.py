"""Slurm's own notation for sizes and durations, read and written.

Slurm counts memory in MiB ("M"; its documentation says megabytes, its code multiplies by
1024) with suffixes K, M, G, T; durations are ``[days-]hours:minutes:seconds`` with shorter
forms accepted on input (sbatch.1 "--time").
"""

from __future__ import annotations

import math
import re

from torchdoctor.errors import UserError
from torchdoctor.units import fmt_mem_option

MIB = 1024 * 1024
_MEM = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)B?\s*$", re.IGNORECASE)
_MEM_FACTORS = {"": MIB, "K": 1024, "M": MIB, "G": 1024 * MIB, "T": 1024 * 1024 * MIB}
UNLIMITED = ("UNLIMITED", "INFINITE", "NONE", "INVALID", "N/A", "")


def parse_memory(text: str) -> int | None:
    """Bytes in a Slurm memory figure ("1280M", "64G", "500"), None for none/unlimited."""
    if text.strip().upper() in UNLIMITED:
        return None
    match = _MEM.match(text)
    if match is None:
        return None
    return int(float(match.group(1)) * _MEM_FACTORS[match.group(2).upper()])


def format_memory(n_bytes: int) -> str:
    """Whole MiB, as sbatch's ``--mem`` reads it: ``"1280M"``; whole GiB as ``"64G"``."""
    return fmt_mem_option(n_bytes, slurm=True)


def parse_duration(text: str) -> int | None:
    """Seconds in a Slurm duration, None for UNLIMITED/INVALID.

    Accepted as sbatch does: "MM", "MM:SS", "HH:MM:SS", "D-HH", "D-HH:MM", "D-HH:MM:SS".
    """
    text = text.strip()
    if text.upper() in UNLIMITED:
        return None
    days = 0
    if "-" in text:
        head, _, text = text.partition("-")
        if not head.isdigit():
            return None
        days = int(head)
        parts = text.split(":")
        if not all(p.isdigit() for p in parts) or len(parts) > 3:
            return None
        h, m, s = ([int(p) for p in parts] + [0, 0])[:3]
        return ((days * 24 + h) * 60 + m) * 60 + s
    parts = text.split(":")
    if not all(p.isdigit() for p in parts) or not 1 <= len(parts) <= 3:
        return None
    nums = [int(p) for p in parts]
    if len(nums) == 1:
        return nums[0] * 60
    if len(nums) == 2:
        return nums[0] * 60 + nums[1]
    return (nums[0] * 60 + nums[1]) * 60 + nums[2]


def require_duration(text: str, option: str) -> int:
    """A duration the user typed, or a UserError that says how to write one."""
    seconds = parse_duration(text)
    if seconds is None or seconds <= 0:
        raise UserError(
            f"cannot read {option} {text!r}: write it as Slurm does, HH:MM:SS or D-HH:MM:SS "
            "(or `auto` to size it from the recording)"
        )
    return seconds


def format_duration(seconds: float) -> str:
    """``HH:MM:SS`` (hours may pass 24, which sbatch accepts), rounded up to the second."""
    total = math.ceil(seconds)
    h, rest = divmod(total, 3600)
    m, s = divmod(rest, 60)
    return f"{h:02d}:{m:02d}:{s:02d}"
