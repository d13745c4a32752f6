"""Figures as people read and write them, the same in every command: sizes, rates, shares and
durations. Every flag that takes a size or a duration reads it here, and every figure printed
is written here.

The vocabulary (one table, documented as is):

===============================  ===============================================================
``16G``, ``16GiB``, ``16g``      16 x 2^30 bytes, as Slurm (``--mem=16G``), Docker and nccl-tests
                                 read G; likewise K/KiB (2^10), M/MiB (2^20), T/TiB (2^40)
``16GB``, ``400MB``, ``8kB``     SI, only when written out with a B: 16 x 10^9, 400 x 10^6...
``1024``, ``1024B``              bytes
``90``, ``90s``                  seconds: a bare number is seconds everywhere it is accepted
``5m``, ``1h30m``, ``2d``        minutes, hours and minutes, days (units may be combined)
``250ms``, ``5min``              milliseconds; minutes written out
``MM:SS``, ``HH:MM:SS``,         clock forms, as Slurm writes them
``D-HH:MM:SS``
===============================  ===============================================================

A bare duration is refused where it is ambiguous: ``sbatch --time`` (Slurm reads ``--time 5`` as
five minutes) asks for a unit or a clock form. Printed sizes use binary units (``GiB``), as the
kernel, nvidia-smi and ``torch.cuda.memory_summary`` show them; printed durations use ``s``,
``min``, ``h``.
"""

from __future__ import annotations

import math
import re
import shlex

from torchdoctor.errors import UserError

BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


SIZE_HINT = "write a size like 16G or 16GiB (16 x 2^30 bytes), 16GB (16 x 10^9), 400M or bytes"
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_size(text: str, option: str = "size", bare_unit: int = 1) -> int:
    """Bytes in ``text``: ``16G``/``16GiB`` = 16 x 2^30, ``16GB`` = 16 x 10^9, ``1024`` bytes.

    ``bare_unit`` is what a number without a unit counts (1 byte; Slurm's own notation reads
    MiB). ``option`` names the flag in the message a bad value gets."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if unit.endswith("ib"):
        power, base = unit[:-2], 1024
    elif unit.endswith("b") and len(unit) == 2:
        power, base = unit[:-1], 1000
    elif unit == "b":
        power, base = "", 1
    else:
        power, base = unit, 1024
    if match is None or power not in _POWERS or (unit.endswith("ib") and not power):
        raise UserError(f"cannot read {option} {text!r}: {SIZE_HINT}")
    factor = base ** _POWERS[power] if unit else bare_unit
    return int(float(match.group(1)) * factor)


# The longer units first: the alternation takes the first that matches, and "ms" or "min"
# read as "m" left "s" or "in" over (so "50ms" and "5min" were refused).
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|min|d|h|m|s)")
_DURATION_UNITS = {"d": 86400, "h": 3600, "m": 60, "min": 60, "s": 1, "ms": 0.001}
DURATION_HINT = "90 or 90s (seconds), 5m, 1h30m or HH:MM:SS"


def parse_duration(
    text: str,
    option: str = "duration",
    *,
    bare: bool = True,
    bare_unit: float = 1.0,
    examples: str = DURATION_HINT,
) -> float:
    """Seconds in ``text``: ``90``, ``90s``, ``5m``, ``1h30m``, ``2d``, ``MM:SS``,
    ``HH:MM:SS``, ``D-HH[:MM[:SS]]``.

    A bare number counts ``bare_unit`` seconds (1: seconds everywhere in torchdoctor; Slurm's
    own notation, as read from its scripts, counts minutes); ``bare=False`` refuses it where it
    would be ambiguous. ``examples`` is what the message of a value it cannot read offers:
    an option with a range offers values inside it."""
    value = text.strip().lower()
    seconds = _clock(value) if (":" in value or "-" in value) else None
    if seconds is None and re.fullmatch(r"\d+(\.\d+)?", value):
        if not bare:
            raise UserError(
                f"{option} {text!r} has no unit: write {text}s, {text}m or a clock form "
                f"such as 00:{int(float(text)):02d}:00 (HH:MM:SS)"
            )
        seconds = float(value) * bare_unit
    if seconds is None:
        parts = _DURATION_PART.findall(value)
        if parts and "".join(n + u for n, u in parts) == value:
            seconds = sum(float(n) * _DURATION_UNITS[u] for n, u in parts)
    if seconds is None:
        raise UserError(f"cannot read {option} {text!r}: write a duration like {examples}")
    return seconds


def _clock(value: str) -> float | None:
    """``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS`` (Slurm's forms)."""
    days = 0
    if "-" in value:
        head, _, value = value.partition("-")
        if not head.isdigit():
            return None
        days = int(head)
        parts = value.split(":")
        if not all(p.isdigit() for p in parts) or len(parts) > 3:
            return None
        h, m, s = ([int(p) for p in parts] + [0, 0])[:3]
        return float(((days * 24 + h) * 60 + m) * 60 + s)
    parts = value.split(":")
    if not all(p.isdigit() for p in parts) or len(parts) not in (2, 3):
        return None
    nums = [int(p) for p in parts]
    if len(nums) == 2:
        return float(nums[0] * 60 + nums[1])
    return float((nums[0] * 60 + nums[1]) * 60 + nums[2])


def binary_scaled(n: float) -> tuple[float, str]:
    """``n`` bytes as a value below 1024 (where a unit is large enough) and its binary unit."""
    value = float(n)
    for unit in BINARY_UNITS:
        if abs(value) < 1024 or unit == BINARY_UNITS[-1]:
            return value, unit
        value /= 1024
    raise AssertionError("unreachable")


def fmt_bytes(n: float | None, missing: str = "n/a") -> str:
    """Three significant figures: ``"100 B"``, ``"1.50 KiB"``, ``"812 MiB"``, ``"80.0 GiB"``."""
    if n is None:
        return missing
    value, unit = binary_scaled(n)
    if unit == "B":
        return f"{int(value)} B"
    return f"{_three_figures(value)} {unit}"


def fmt_mem_option(n_bytes: float, *, slurm: bool) -> str:
    """A RAM size as a ``--mem`` option takes it, rounded up to whole MiB: Slurm's ``"1280M"`` /
    ``"64G"``, or ``torchdoctor submit``'s ``"1280MiB"`` / ``"64GiB"``: both read M and G as
    MiB and GiB; the submit spelling says so to a reader who thinks in decimal units."""
    mib = -(-int(math.ceil(n_bytes)) // 2**20)
    value, unit = (mib // 1024, "G") if mib % 1024 == 0 and mib else (mib, "M")
    return f"{value}{unit}" if slurm else f"{value}{unit}iB"


def fmt_rate(n: float | None, missing: str = "n/a") -> str:
    """Bytes per second: ``"60.0 MiB/s"``."""
    return missing if n is None else f"{fmt_bytes(n)}/s"


def fmt_pct(share: float | None, missing: str = "n/a", digits: int = 0) -> str:
    """A share already in percent (0-100): ``"42 %"``."""
    return missing if share is None else f"{share:.{digits}f} %"


def fmt_duration(seconds: float | None, missing: str = "n/a") -> str:
    """A duration as a person says it: three significant figures below a minute (``"350 µs"``,
    ``"42.1 ms"``, ``"1.24 s"``), then ``"3 min 05 s"``, ``"1 h 02 min"``, ``"4.2 days"``."""
    if seconds is None:
        return missing
    if seconds == 0:
        return "0 s"
    if abs(seconds) < 0.9995e-3:
        return f"{seconds * 1e6:.0f} µs"
    if abs(seconds) < 0.9995:
        return f"{_three_figures(seconds * 1e3)} ms"
    if abs(seconds) < 59.95:  # what would print as "60.0 s" reads as "1 min 00 s"
        return f"{_three_figures(seconds)} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    if seconds < 3 * 86400:
        hours, minutes = divmod(minutes, 60)
        return f"{hours} h {minutes:02d} min"
    return f"{seconds / 86400:.1f} days"


def parse_cpu_list(text: str) -> list[int]:
    """``"0-3,8"`` (the kernel's cpulist format, as in /sys and cgroups) as ``[0, 1, 2, 3, 8]``."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        cpus.extend(range(int(low), int(high or low) + 1))
    return cpus


def fmt_cpu_list(cpus: list[int]) -> str:
    """``[0, 1, 2, 3, 8]`` as ``"0-3,8"``, the way taskset and cgroups write CPU lists."""
    ranges: list[str] = []
    ordered = sorted(cpus)
    if not ordered:
        return "-"
    start = prev = ordered[0]
    for c in [*ordered[1:], None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        ranges.append(str(start) if start == prev else f"{start}-{prev}")
        if c is not None:
            start = prev = c
    return ",".join(ranges)


def _three_figures(value: float) -> str:
    """``value`` (below 1000) to three significant figures: 1.50, 42.1, 812."""
    digits = 2 if abs(value) < 9.995 else 1 if abs(value) < 99.95 else 0  # as they will round
    return f"{value:.{digits}f}"


def shell_line(argv: list[str], limit: int = 80) -> str:
    """A command line as a shell would take it back (``shlex.join``) on one line: newlines,
    tabs and other control characters (a ``-c`` script's) escaped, and at most ``limit``
    characters, cut at a word boundary with an ellipsis where that does not lose most of it."""
    text = visible(shlex.join(argv))
    if len(text) <= limit:
        return text
    cut = text[: limit - 3]
    space = cut.rfind(" ")
    return (cut[:space] if space > limit // 2 else cut) + "..."


_ESCAPES = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def visible(text: str) -> str:
    """``text`` with newlines, tabs and every other unprintable character (C0 and C1 controls,
    line separators, bidi overrides, the surrogates of undecodable bytes) written as Python
    escapes: what a user typed or a file named stays on one line and cannot move the cursor."""
    return "".join(ch if ch.isprintable() or ch == " " else _escape(ch) for ch in text)


def _escape(ch: str) -> str:
    code = ord(ch)
    if ch in _ESCAPES:
        return _ESCAPES[ch]
    # \x2028 would read as \x20 then "28": the width says how many digits belong to it
    return (
        f"\\x{code:02x}"
        if code < 0x100
        else f"\\u{code:04x}"
        if code < 0x10000
        else f"\\U{code:08x}"
    )


def one_line(argv: list[str], limit: int = 100) -> str:
    """A job's command line on one line (scripts passed with -c hold newlines), cut at ``limit``."""
    text = " ".join(" ".join(argv).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
