"""The reference threshold table (shared/BRIEF.md section 2), shared by diagnosis and live view.

Defaults are the published table; every value can be overridden from a TOML file given with
``--thresholds FILE`` or from ``[tool.torchdoctor.thresholds]`` in the nearest pyproject.toml,
because the right limits depend on the hardware.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchdoctor.errors import UserError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


@dataclass(frozen=True, slots=True)
class Thresholds:
    """Alert limits and best ranges. Percentages are 0-100; rates are bytes per second."""

    gpu_memory_alert_pct: float = 90.0  # VRAM in use above this: alert
    gpu_memory_best_low_pct: float = 60.0  # best range 60-85 %
    gpu_memory_best_high_pct: float = 85.0
    cpu_load_alert_pct: float = 80.0  # mean CPU load above this, sustained: alert
    cpu_load_best_pct: float = 70.0  # at or below this: fine
    swap_alert_bytes_per_s: float = 1_000_000.0  # > 1 MB/s sustained: alert
    swap_best_bytes_per_s: float = 1_000.0  # ~0 KB/s
    iowait_alert_pct: float = 5.0  # > 5 % of CPU time: alert
    iowait_best_pct: float = 2.0
    # Beyond the published table: limits of torchdoctor's own rules.
    data_wait_alert_pct: float = 10.0  # steps wait on the DataLoader above this share: alert
    gpu_busy_alert_pct: float = 50.0  # GPU busy below this while the job runs: underused
    leak_min_growth_bytes: float = 64 * 2**20  # trainer memory growth worth reporting
    sustained_s: float = 10.0  # a condition counts as sustained over this window
    sustained_fraction: float = 0.6  # share of the window's samples that must exceed the limit

    def level(self, metric: str, value: float | None) -> str:
        """'alert', 'warn' (between best range and alert) or 'ok' for one reading."""
        if value is None:
            return "ok"
        limits = {
            "gpu_memory_pct": (self.gpu_memory_best_high_pct, self.gpu_memory_alert_pct),
            "cpu_load_pct": (self.cpu_load_best_pct, self.cpu_load_alert_pct),
            "swap_bytes_per_s": (self.swap_best_bytes_per_s, self.swap_alert_bytes_per_s),
            "iowait_pct": (self.iowait_best_pct, self.iowait_alert_pct),
        }
        if metric not in limits:
            raise KeyError(metric)
        best, alert = limits[metric]
        if value > alert:
            return "alert"
        if value > best:
            return "warn"
        return "ok"


FIELDS = {f.name for f in dataclasses.fields(Thresholds)}


def load_thresholds(
    path: str | os.PathLike[str] | None = None, *, search_from: Path | None = None
) -> Thresholds:
    """Defaults, overridden by ``path`` (a TOML file) or else by the nearest pyproject.toml.

    In a file of its own the values may sit at top level or under ``[thresholds]``; in
    pyproject.toml they sit under ``[tool.torchdoctor.thresholds]``.
    """
    if path is not None:
        data = _read_toml(Path(path))
        table = data.get("thresholds", data)
        return _apply(table, str(path))
    pyproject = _find_pyproject(search_from or Path.cwd())
    if pyproject is None:
        return Thresholds()
    table = _read_toml(pyproject).get("tool", {}).get("torchdoctor", {}).get("thresholds")
    return _apply(table, str(pyproject)) if table else Thresholds()


def _apply(table: dict[str, Any], source: str) -> Thresholds:
    unknown = set(table) - FIELDS
    if unknown:
        raise UserError(
            f"{source}: unknown threshold {sorted(unknown)[0]!r}; known ones: {', '.join(sorted(FIELDS))}"
        )
    values: dict[str, float] = {}
    for key, value in table.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"{source}: threshold {key!r} must be a number, got {value!r}")
        values[key] = float(value)
    return Thresholds(**values)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise UserError(f"no such thresholds file: {str(path)!r}") from None
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{str(path)!r} is not valid TOML: {exc}") from None


def _find_pyproject(start: Path) -> Path | None:
    for folder in (start, *start.parents):
        candidate = folder / "pyproject.toml"
        if candidate.is_file():
            return candidate
    return None
