"""host-memory-leak: a training process's own memory grows in step with the steps.

Memory is the process's private memory (USS) when the recording has it, else RSS. The first
fifth of the run is left out (allocator and library warm-up). Growth counts as a leak when a
straight line over the steps explains it (r^2 >= 0.8) and it adds up to at least
``leak_min_growth_bytes``. Without steps to count, growth over time is only judged on a run
long enough that start-up (imports grow a process by a hundred MiB in its first seconds) is a
small part of it: MIN_SPAN_WITHOUT_STEPS_S seconds after the warm-up cut. DataLoader workers are judged by their own rule
(dataloader-copy-on-access): their growth is bounded by the data set.
"""

from __future__ import annotations

import bisect

from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.diagnosis.findings import Evidence, Finding
from torchdoctor.diagnosis.series import linear_fit
from torchdoctor.units import fmt_bytes, fmt_duration

ID = "host-memory-leak"
MIN_R2 = 0.8
WARMUP_SHARE = 0.2
MIN_STEPS = 10  # steps of a process for growth to be measured against its steps
MIN_SPAN_WITHOUT_STEPS_S = 20.0


def check(ctx: DiagnosisContext) -> list[Finding]:
    findings: list[Finding] = []
    for pid in ctx.compute_pids:
        finding = check_process(ctx, pid)
        if finding is not None:
            findings.append(finding)
    return findings


def _done_at(times: list[float], done: list[int], t: float) -> int:
    """Steps ended by ``t`` (ctx.step_progress's lists)."""
    i = bisect.bisect_right(times, t)
    return done[i - 1] if i else 0


def memory_series(samples: list[dict]) -> tuple[str, list[tuple[float, float]]]:
    """(label, [(t, bytes)]): private memory when its readings can show a trend, else RSS.

    USS comes from the slow tier and is carried between refreshes, so only the samples where
    it changed are fresh readings. One value throughout is a flat private memory; a couple of
    refreshes would draw a staircase, so RSS (read at every sample) is used instead.
    """
    have = [s for s in samples if s["uss"] is not None]
    if len(have) >= 0.8 * len(samples) and len(have) >= 3:
        fresh: list[tuple[float, float]] = []
        for s in have:
            if not fresh or float(s["uss"]) != fresh[-1][1]:
                fresh.append((s["t"], float(s["uss"])))
        if len(fresh) == 1:
            return "private memory (USS)", [(s["t"], float(s["uss"])) for s in have]
        if len(fresh) >= 5:
            return "private memory (USS)", fresh
    return "resident memory (RSS)", [(s["t"], float(s["rss"])) for s in samples]


def check_process(ctx: DiagnosisContext, pid: int) -> Finding | None:
    """The leak finding for one process, or None (also used by the advice benchmark)."""
    samples = ctx.samples_by_pid.get(pid, [])
    if len(samples) < 5:
        return None
    step_ends, steps_done = ctx.step_progress(pid)
    stepped = steps_done[-1] if steps_done else 0
    if stepped >= MIN_STEPS:
        # Growth with steps is measured while the process steps: the torch import before the
        # first step and the teardown after the last are not the training loop's doing. USS
        # or RSS is chosen on these samples: USS refreshed often during the import may have
        # only a few fresh readings left here (a slow machine steps for longer between them).
        samples = [s for s in samples if step_ends[0] <= s["t"] <= step_ends[-1]]
        if len(samples) < 5:
            return None
    label, series = memory_series(samples)
    t_first, t_last = series[0][0], series[-1][0]
    cut = t_first + WARMUP_SHARE * (t_last - t_first)
    series = [(t, v) for t, v in series if t >= cut]
    if len(series) < 4:
        return None
    if stepped < MIN_STEPS and series[-1][0] - series[0][0] < MIN_SPAN_WITHOUT_STEPS_S:
        ctx.not_judged[f"memory growth of pid {pid}"] = (
            f"{stepped} steps and {series[-1][0] - series[0][0]:.1f} s of samples after "
            f"the start-up (a trend needs {MIN_STEPS} steps or "
            f"{MIN_SPAN_WITHOUT_STEPS_S:g} s)"
        )
        return None
    if stepped >= MIN_STEPS:
        x_unit = "step"
        points = [(float(_done_at(step_ends, steps_done, t)), v) for t, v in series]
    else:
        x_unit = "s"
        points = list(series)
    fit = linear_fit(points)
    if fit is None:
        return None
    slope, _, r2 = fit
    span_x = points[-1][0] - points[0][0]
    growth = slope * span_x
    if slope <= 0 or r2 < MIN_R2 or growth < ctx.thresholds.leak_min_growth_bytes:
        return None
    t0, t1 = series[0][0], series[-1][0]
    per_s = growth / (t1 - t0) if t1 > t0 else 0.0
    headroom = _headroom(ctx)
    evidence = [
        Evidence(f"growth of the {label}", round(growth), "B", t0, t1),
        Evidence(f"growth per {x_unit}", round(slope), "B", t0, t1),
        Evidence("growth rate", round(per_s), "B/s", t0, t1),
        Evidence("linear fit r^2", round(r2, 3), ""),
        Evidence(f"{label} at the end", round(series[-1][1]), "B", t1, t1),
    ]
    exhaustion = None
    if headroom is not None and per_s > 0:
        exhaustion = headroom[0] / per_s
        evidence.append(Evidence(headroom[1], headroom[0], "B", t1, t1))
        evidence.append(Evidence("time until that is used up", round(exhaustion), "s"))
    per_what = f"{fmt_bytes(slope)} per step" if x_unit == "step" else f"{fmt_bytes(slope)}/s"
    over = f"{span_x:,.0f} steps" if x_unit == "step" else fmt_duration(span_x)
    until = ""
    if exhaustion is not None:
        until = f"; at this rate the {headroom[1]} runs out in {fmt_duration(exhaustion)}"
        if x_unit == "step" and slope > 0:
            until += f" (about {headroom[0] / slope:,.0f} more steps)"
    severity = "critical" if exhaustion is not None and exhaustion < 3600 else "warning"
    return Finding(
        id=ID,
        severity=severity,
        title=f"The {ctx.role_of(pid)} process (pid {pid}) grows by {per_what}",
        evidence=evidence,
        recommendation=(
            f"pid {pid} keeps {fmt_bytes(growth)} more after {over} "
            f"(r^2 {r2:.2f}){until}. Look for references kept across steps: accumulating the "
            "loss tensor (`total += loss` keeps every step's autograd graph; use "
            "`loss.item()` or `loss.detach()`), appending outputs/logits to a list, caches "
            "keyed by step. `tracemalloc` snapshots two steps apart name the line that allocates."
        ),
        expected_effect="Flat memory over the run: the job no longer ends in swapping or the OOM killer.",
        confidence=min(0.95, 0.5 + r2 / 2),
        details=(
            "Growth is a least-squares line of the process's memory against its step count, "
            "after the first fifth of the run."
        ),
    )


def _headroom(ctx: DiagnosisContext) -> tuple[float, str] | None:
    """Memory the job can still take: the cgroup limit's rest, else the machine's available."""
    last = ctx.host_samples[-1] if ctx.host_samples else None
    limit = ctx.host.get("cgroup_memory_limit")
    if limit:
        used = 0.0
        t_last = max((s["t"] for s in ctx.process_samples), default=None)
        if t_last is not None:
            used = sum(s["rss"] for s in ctx.process_samples if s["t"] == t_last)
        return max(limit - used, 0.0), "cgroup memory limit"
    if last is not None:
        return float(last["mem_available"]), "available memory"
    return None
