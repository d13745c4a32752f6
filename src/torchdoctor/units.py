"""Figures as people read them, the same in every command: sizes, rates, shares and durations.

Sizes use binary units (GiB), as RAM and VRAM are sold and as the kernel, nvidia-smi and
``torch.cuda.memory_summary`` show them.
"""

from __future__ import annotations

import math

BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


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
    ``"64G"`` (its M and G are MiB and GiB), or ``torchdoctor submit``'s ``"1280MiB"`` /
    ``"64GiB"`` (where M and G would be decimal)."""
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


def one_line(argv: list[str], limit: int = 100) -> str:
    """A job's command line on one line (scripts passed with -c hold newlines), cut at ``limit``."""
    text = " ".join(" ".join(argv).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
