"""The report's figures and chart axes: units, scales, round ticks and clock times.

Sizes use binary units (GiB, as RAM and VRAM are sold and shown by the kernel); rates use
decimal units (MB/s), because the threshold table states swap traffic in MB/s.
"""

from __future__ import annotations

import math
import time

from torchdoctor.units import fmt_bytes, fmt_duration

# Units a chart axis or a figure can be in. Values are always stored in base units.
PERCENT = "%"
BYTES = "B"
BYTES_PER_S = "B/s"
SECONDS = "s"
COUNT = ""

_BINARY = (("GiB", 1024.0**3), ("MiB", 1024.0**2), ("KiB", 1024.0), ("B", 1.0))
_DECIMAL_RATE = (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3), ("B/s", 1.0))
_TIME = (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6))


def scale_for(unit: str, largest: float) -> tuple[str, float]:
    """The display unit and divisor that suit values up to ``largest`` (in base units)."""
    largest = abs(largest)
    if unit == BYTES:
        table = _BINARY
    elif unit == BYTES_PER_S:
        table = _DECIMAL_RATE
    elif unit == SECONDS:
        table = _TIME
    else:
        return unit, 1.0
    for name, factor in table:
        if largest >= factor:
            return name, factor
    return table[-1]


def fmt_value(value: float | int | None, unit: str, digits: int = 3) -> str:
    """One figure with its unit, e.g. ``fmt_value(3.2e9, "B") == "2.98 GiB"``. Sizes and
    durations read as in every other command (:mod:`torchdoctor.units`)."""
    if value is None:
        return "n/a"
    if isinstance(value, float) and not math.isfinite(value):
        return "n/a"
    if unit == PERCENT:
        if 0 < abs(value) < 0.1:
            return "< 0.1 %"  # shares read in tenths of a percent at best
        return f"{_round(round(value, 1), digits)} %"
    if unit == BYTES:
        return fmt_bytes(value)
    if unit == SECONDS:
        return fmt_duration(value)
    if unit == BYTES_PER_S:
        name, factor = scale_for(unit, value)
        return f"{_round(value / factor, digits)} {name}"
    if unit == COUNT:
        return _round(value, digits)
    return f"{_round(value, digits)} {unit}"


def _round(value: float, digits: int) -> str:
    """At most ``digits`` significant digits, no exponent, no trailing zeros."""
    if value == 0:
        return "0"
    if float(value).is_integer() and abs(value) < 10**digits:
        return str(int(value))
    magnitude = int(math.floor(math.log10(abs(value))))
    decimals = max(0, digits - 1 - magnitude)
    text = f"{value:.{decimals}f}"
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text


def fmt_clock(elapsed: float) -> str:
    """Elapsed time on a time axis: ``"0:42"``, ``"12:05"``, ``"1:02:03"``."""
    total = int(round(elapsed))
    sign = "-" if total < 0 else ""
    total = abs(total)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{sign}{hours}:{minutes:02d}:{secs:02d}"
    return f"{sign}{minutes}:{secs:02d}"


def fmt_utc(t: float | None) -> str:
    if t is None:
        return "n/a"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def nice_ticks(low: float, high: float, target: int = 5) -> list[float]:
    """Round tick values (1, 2, 2.5, 5 x 10^n steps) covering ``[low, high]``."""
    if not (math.isfinite(low) and math.isfinite(high)) or high <= low:
        return [low]
    raw = (high - low) / max(1, target)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = magnitude
    for m in (1, 2, 2.5, 5, 10):
        step = m * magnitude
        if step >= raw:
            break
    first = math.ceil(low / step - 1e-9) * step
    ticks = []
    value = first
    while value <= high + step * 1e-9:
        ticks.append(round(value, 12))
        value += step
    return ticks


# Steps for a time axis, in seconds: round minutes and hours rather than decimal numbers.
_TIME_STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 14400, 21600)


def time_ticks(span: float, target: int = 8) -> list[float]:
    """Tick positions (elapsed seconds from 0) for a time axis ``span`` seconds long."""
    if span <= 0:
        return [0.0]
    step = next((s for s in _TIME_STEPS if span / s <= target), None)
    if step is None:
        step = 3600 * math.ceil(span / target / 3600)
    count = int(span // step)
    return [float(i * step) for i in range(count + 1)]
