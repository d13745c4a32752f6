"""Human-readable numbers for terminal output."""

from __future__ import annotations


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def fmt_rate(n: float | None) -> str:
    return "n/a" if n is None else f"{fmt_bytes(n)}/s"


def fmt_pct(n: float | None) -> str:
    return "n/a" if n is None else f"{n:.0f} %"


def fmt_duration(s: float | None) -> str:
    if s is None:
        return "n/a"
    if s < 60:
        return f"{s:.1f} s"
    m, sec = divmod(int(round(s)), 60)
    if m < 60:
        return f"{m} min {sec:02d} s"
    h, m = divmod(m, 60)
    return f"{h} h {m:02d} min"


def one_line(argv: list[str], limit: int = 100) -> str:
    """A command line on one line (scripts passed with -c hold newlines), cut at ``limit``."""
    text = " ".join(" ".join(argv).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
