"""Numbers as people read them in findings: bytes in binary units, shares in percent."""

from __future__ import annotations


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "unknown"
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def fmt_rate(n: float | None) -> str:
    return "unknown" if n is None else f"{fmt_bytes(n)}/s"


def fmt_pct(share: float, digits: int = 0) -> str:
    """A share in percent (0-100 in, text out)."""
    return f"{share:.{digits}f} %"


def fmt_s(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 3 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def fmt_cpus(n: float) -> str:
    return f"{n:g}"
