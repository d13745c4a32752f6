"""What the rules on profiled windows share: the windows, per-step means and shares, and the
words every expected effect of theirs carries (a bound, never more than was measured)."""

from __future__ import annotations

from collections.abc import Callable

from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.diagnosis.findings import Evidence
from torchdoctor.recording.profiles import WindowProfile
from torchdoctor.units import fmt_duration

# The profiler's own cost on the CPU (measured, shared/reference/profiler.md section 4.3):
# +4.7-6.9 us per aten op, so a profiled step of tiny ops is slower than the same step outside
# the window. Findings that rest on op counts say so.
PROFILER_US_PER_OP = 5.0


def windows(ctx: DiagnosisContext, gpu: bool | None = None) -> list[WindowProfile]:
    """The parsed windows; only GPU traces (``gpu=True``) or only CPU ones (``False``)."""
    return [w for w in ctx.profiles if gpu is None or w.gpu == gpu]


def per_step(w: WindowProfile, column: str) -> float:
    return w.typical(column) or 0.0


def pct(part: float, whole: float) -> float:
    return round(100.0 * part / whole, 1) if whole > 0 else 0.0


def gpu_span(w: WindowProfile) -> float:
    return per_step(w, "gpu_busy_s") + per_step(w, "gpu_idle_s")


def step_time(w: WindowProfile) -> float:
    """The median profiled step: its CPU span, or the GPU's work for it where that is longer (a
    host that runs ahead of a deep queue ends its steps before their kernels do)."""
    times = sorted(
        max(s["dur_s"] or 0.0, (s.get("gpu_busy_s") or 0.0) + (s.get("gpu_idle_s") or 0.0))
        for s in w.judged
    )
    if not times:
        return 0.0
    mid = len(times) // 2
    return times[mid] if len(times) % 2 else (times[mid - 1] + times[mid]) / 2


def window_evidence(w: WindowProfile) -> list[Evidence]:
    t0 = w.judged[0]["t_start"]
    last = w.judged[-1]
    t1 = last["t_start"] + last["dur_s"] if t0 is not None else None
    return [
        Evidence("profiled window", w.label, ""),
        Evidence("steps judged", len(w.judged), "steps", t0, t1),
        Evidence("median profiled step", round(step_time(w), 6), "s", t0, t1),
    ]


def at_most(seconds: float, step_s: float) -> str:
    """'at most X per step (Y % of the step)': the bound an expected effect may claim."""
    return f"at most {fmt_duration(seconds)} per step ({pct(seconds, step_s):g} % of the step)"


def worst(candidates: list[tuple[float, WindowProfile]]) -> WindowProfile | None:
    return max(candidates, key=lambda c: c[0])[1] if candidates else None


def pick(
    ctx: DiagnosisContext, score: Callable[[WindowProfile], float | None], gpu: bool | None
) -> WindowProfile | None:
    """The window where ``score`` (None: the rule's condition does not hold there) is
    highest: one finding per rule, from its clearest window."""
    return worst([(v, w) for w in windows(ctx, gpu) if (v := score(w)) is not None])
