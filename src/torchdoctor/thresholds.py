"""The reference threshold table (shared/BRIEF.md section 2), shared by diagnosis and live view.

Defaults are the published table; every value can be overridden from a TOML file given with
``--thresholds FILE`` or from ``[tool.torchdoctor.thresholds]`` in the nearest pyproject.toml,
because the right limits depend on the hardware.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchdoctor.errors import UserError


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
    # Profiled windows (run --profile-steps): shares of a profiled step, from the anchors of
    # shared/reference/profiler.md section 6.2.
    profile_sync_alert_pct: float = 10.0  # syncs' wait above this share of the step: warning
    profile_hot_op_pct: float = 50.0  # one op (one shape, one dtype) above this share: op-bound
    profile_ops_cover_pct: float = 80.0  # op-bound names the ops making up this share
    profile_gpu_idle_alert_pct: float = 20.0  # GPU idle above this share of its span
    profile_launch_wait_pct: float = 50.0  # kernel wait (or short kernels) above this share
    profile_gpu_saturated_pct: float = 90.0  # GPU busy above this: a deep queue, never launch-bound
    profile_python_alert_pct: float = 50.0  # CPU: between ops and in tiny ops above this share
    profile_tiny_ops_per_step: float = 1000.0  # CPU: top-level ops under 20 us per step
    profile_memcpy_alert_pct: float = 15.0  # host-to-device copies above this share of the step
    profile_comm_exposed_alert_pct: float = 10.0  # communication no compute overlaps, of the step
    # The automatic window (run/auto_profile.py) is asked only past start-up: the first steps
    # are slow for reasons of their own (lazy initialisation, allocator warm-up, cuDNN's
    # autotuning, torch.compile), and a GPU that waits through them says nothing of the
    # steady step. Both must hold: many short steps in a few seconds, or a few long ones.
    auto_profile_min_steps: float = 20.0  # steps recorded past the first two
    auto_profile_min_s: float = 30.0  # seconds recorded
    # Per-rank batch below which plain BatchNorm under DDP is flagged: BN's error "increases
    # rapidly when the batch size becomes smaller" (Wu & He, Group Normalization, ECCV 2018).
    batchnorm_min_batch_per_rank: float = 16.0
    # GradScaler steps skipped (inf/NaN gradients) after its warm-up, above this share: its
    # scale keeps falling. At equilibrium it skips one step per growth_interval (2000): 0.05 %.
    scaler_skip_alert_pct: float = 1.0
    # bench scaling's trials: N ranks below this share of N times one rank's throughput
    # (E(N)) have not paid for themselves (bench scaling's own verdict uses 0.7 too).
    scaling_efficiency_min_pct: float = 70.0

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
    """Defaults, overridden key by key by the user's config.toml ``[thresholds]``, the nearest
    pyproject.toml's ``[tool.torchdoctor.thresholds]``, then ``path`` (a TOML file, values at
    top level or under ``[thresholds]``; default: $TORCHDOCTOR_THRESHOLDS). torchdoctor.config
    says where each is looked for."""
    from torchdoctor import config

    values: dict[str, float] = {}
    origin: dict[str, str] = {}  # which layer set each key, for the message of an ordering
    for source, table in config.threshold_tables(path, search_from):
        layer = _values(table, source)
        values.update(layer)
        origin.update(dict.fromkeys(layer, source))
    thresholds = Thresholds(**values)
    _check_order(thresholds, origin)
    return thresholds


# The range each threshold may take: a nonsense value (a fraction of 0, a negative window)
# makes rules fire on an idle machine (the swap and I/O-wait rules reported "0 B/s" as a
# warning with sustained_fraction = 0), so it is refused where the file is read.
# (low, high, low_included, what to write)
_PCT = (0.0, 100.0, True, "a percentage from 0 to 100")
_NON_NEGATIVE = (0.0, math.inf, True, "a number of 0 or more")
RANGES: dict[str, tuple[float, float, bool, str]] = {
    **{name: _PCT for name in FIELDS if name.endswith("_pct")},
    "swap_alert_bytes_per_s": _NON_NEGATIVE,
    "swap_best_bytes_per_s": _NON_NEGATIVE,
    "leak_min_growth_bytes": _NON_NEGATIVE,
    "profile_tiny_ops_per_step": _NON_NEGATIVE,
    "auto_profile_min_steps": _NON_NEGATIVE,
    "auto_profile_min_s": _NON_NEGATIVE,
    "batchnorm_min_batch_per_rank": _NON_NEGATIVE,
    "sustained_s": (0.0, math.inf, False, "seconds above 0"),
    "sustained_fraction": (0.0, 1.0, False, "a fraction above 0 and at most 1"),
}

# (lower, higher): a best range must end at or below its alert limit, or every reading between
# the two would be both fine and alarming.
ORDER = (
    ("gpu_memory_best_low_pct", "gpu_memory_best_high_pct"),
    ("gpu_memory_best_high_pct", "gpu_memory_alert_pct"),
    ("cpu_load_best_pct", "cpu_load_alert_pct"),
    ("swap_best_bytes_per_s", "swap_alert_bytes_per_s"),
    ("iowait_best_pct", "iowait_alert_pct"),
)


def _values(table: dict[str, Any], source: str) -> dict[str, float]:
    unknown = set(table) - FIELDS
    if unknown:
        raise UserError(
            f"{source}: unknown threshold {sorted(unknown)[0]!r}; known ones: {', '.join(sorted(FIELDS))}"
        )
    values: dict[str, float] = {}
    for key, value in table.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"{source}: threshold {key!r} must be a number, got {value!r}")
        number = float(value)
        low, high, low_ok, words = RANGES[key]
        above_low = number >= low if low_ok else number > low
        # nan fails both comparisons; inf (and 1e400, which TOML reads as inf) fails the
        # finiteness test: neither is a limit a rule can compare against.
        if not (math.isfinite(number) and above_low and number <= high):
            raise UserError(f"{source}: threshold {key!r} = {value!r} is out of range: use {words}")
        values[key] = number
    return values


def _check_order(thresholds: Thresholds, origin: dict[str, str]) -> None:
    for lower, higher in ORDER:
        low, high = getattr(thresholds, lower), getattr(thresholds, higher)
        if low > high:
            where = origin.get(lower) or origin.get(higher) or "the defaults"
            set_in = {origin.get(lower, "the defaults"), origin.get(higher, "the defaults")}
            also = "" if len(set_in) == 1 else f" ({' and '.join(sorted(set_in))})"
            raise UserError(
                f"{where}: threshold {lower!r} = {low:g} is above {higher!r} = {high:g}{also}: "
                f"use {lower} <= {higher}"
            )
