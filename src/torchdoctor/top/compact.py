"""What fits a narrow terminal cell: short sizes, rates and percentages, sparklines, and other
programs' text made safe to print."""

from __future__ import annotations

from collections.abc import Sequence

from torchdoctor.units import binary_scaled

# Command lines and environments are other programs' bytes: never let them move the cursor or
# recolour the terminal (an escape sequence in an argv would), nor break a row in two.
_CONTROL = {i: "?" for i in (*range(0x20), 0x7F)} | {0x0A: "⏎", 0x09: " "}
_BLOCKS = " ▁▂▃▄▅▆▇█"


def printable(text: str) -> str:
    """``text`` with control characters made visible: one screen line, no escape sequences."""
    return text.translate(_CONTROL)


def size(n: float | None, missing: str = "-") -> str:
    """Bytes in at most 5 characters: ``512B``, ``3.4K``, ``12M``, ``1.2G``."""
    return missing if n is None else _short(*binary_scaled(n))


def _short(value: float, unit: str) -> str:
    """One decimal below 10 (``3.4K``), none above or for bytes; the unit's first letter."""
    digits = 1 if unit != "B" and abs(value) < 9.95 else 0
    return f"{value:.{digits}f}{unit[0]}"


def rate(n: float | None, missing: str = "-") -> str:
    """Bytes per second, e.g. ``1.2M/s``."""
    return missing if n is None else f"{size(n)}/s"


def pct(value: float | None, missing: str = "-", digits: int = 0) -> str:
    return missing if value is None else f"{value:.{digits}f}%"


def sparkline(values: Sequence[float | None], width: int, top: float | None = None) -> str:
    """The last ``width`` values as block characters scaled to ``top`` (default: the max)."""
    tail = list(values)[-width:]
    known = [v for v in tail if v is not None]
    scale = top if top is not None else (max(known) if known else 0.0)
    out = []
    for v in tail:
        if v is None:
            out.append(" ")
        elif scale <= 0:
            out.append(_BLOCKS[1])
        else:
            i = round(min(max(v / scale, 0.0), 1.0) * (len(_BLOCKS) - 1))
            out.append(_BLOCKS[max(i, 1)])
    return "".join(out).rjust(width)
