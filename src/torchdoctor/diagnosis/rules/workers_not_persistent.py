"""workers-not-persistent: DataLoader workers are started again at every epoch
(persistent_workers=False), and the first step of each epoch waits for them."""

from __future__ import annotations

import statistics

from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.diagnosis.findings import Evidence, Finding
from torchdoctor.diagnosis.rules._common import training_loader
from torchdoctor.units import fmt_duration

ID = "workers-not-persistent"
MIN_GAP_FACTOR = 2.0  # an epoch start must wait at least this many median steps to count
WARN_SHARE = 0.05  # lost time above this share of the run's step time: warning


def check(ctx: DiagnosisContext) -> list[Finding]:
    loader = training_loader(ctx)
    summary = ctx.step_summary
    if (
        loader is None
        or summary is None
        or not loader["num_workers"]
        or loader["persistent_workers"]
    ):
        return []
    pid = loader["pid"]
    starts = sorted(e["t"] for e in ctx.events_of("epoch-start") if e["pid"] == pid)
    steps = sorted((s for s in ctx.steps if s["pid"] == pid), key=lambda s: s["t_end"])
    if len(starts) < 2 or len(steps) < 5:
        return []
    gaps: list[float] = []
    for t in starts[1:]:  # the first epoch's start-up happens whatever the setting
        first = next((s for s in steps if s["t_end"] > t), None)
        if first is not None:
            gaps.append(first["data_wait_s"] or 0.0)
    if not gaps:
        return []
    typical = summary.median_data_wait_s
    gap = statistics.median(gaps)
    if gap < MIN_GAP_FACTOR * max(summary.median_step_s, 1e-4):
        return []
    lost = sum(max(g - typical, 0.0) for g in gaps)
    total = sum(s["wall_s"] for s in steps) + ctx.folded(pid).wall_s
    share = lost / total if total > 0 else 0.0
    severity = "warning" if share >= WARN_SHARE else "info"
    return [
        Finding(
            id=ID,
            severity=severity,
            title=f"Each epoch waits {fmt_duration(gap)} to restart {loader['num_workers']} DataLoader workers",
            evidence=[
                Evidence("epochs", len(starts), "epochs", starts[0], starts[-1]),
                Evidence("median wait of an epoch's first step", round(gap, 4), "s"),
                Evidence("median data wait of other steps", round(typical, 6), "s"),
                Evidence("time lost to restarts", round(lost, 3), "s"),
                Evidence("share of the run's step time", round(share * 100, 1), "%"),
            ],
            recommendation=(
                "DataLoader(persistent_workers=True): the workers and their dataset copies stay "
                f"alive between epochs instead of being forked again {len(starts) - 1} times."
            ),
            expected_effect=f"About {fmt_duration(lost)} less over this run ({share * 100:.1f} % of step time).",
            confidence=0.8,
            settings={"persistent_workers": True},
        )
    ]
