"""scaling-no-gain: N ranks are not (much) faster than one.

`torchdoctor bench scaling` records one trial per rank count and puts the 1-rank trial's
throughput into each later trial's meta (``bench_scaling.baseline``). On such a recording
this rule measures the trial's own throughput as bench scaling does (samples per second of
all ranks over the steps after its warm-up) and its efficiency E(N) = throughput(N) /
(N x throughput(1)); below ``scaling_efficiency_min_pct`` it names the loss with the cause
the other rules found on the same recording (communication, a straggler, data wait, ranks
oversubscribing the cores). "More data parallelism is faster" holds only while each rank's
share of the work outweighs what the ranks add. Other recordings hold no baseline: silent.
"""

from __future__ import annotations

from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.diagnosis.findings import Evidence, Finding

ID = "scaling-no-gain"
AFTER_OTHERS = True
# Findings that explain where the N ranks' time goes, most specific first.
CAUSES = (
    "communication-bound",
    "rank-straggler",
    "rank-oversubscribed",
    "dataloader-bound",
    "cpu-contention",
    "cpu-saturated",
    "uneven-inputs",
)


def throughput(ctx: DiagnosisContext, warmup: int) -> float | None:
    """Samples per second of all ranks together, each over its steps after ``warmup``."""
    by_pid: dict[int, list[dict]] = {}
    for s in ctx.steps:
        by_pid.setdefault(s["pid"], []).append(s)
    rate = 0.0
    for pid, rows in by_pid.items():
        rows.sort(key=lambda r: r["step"])
        window = rows[warmup:]  # a process's first steps are never folded
        folded = ctx.folded(pid)
        if len(window) < 2 or folded.samples_unknown:
            return None
        span = window[-1]["t_end"] - window[0]["t_start"]
        samples = [r["samples"] or r["batch_size"] or 0 for r in window]
        if span <= 0 or not all(samples):
            return None
        rate += (sum(samples) + folded.samples) / span
    return rate or None


def check(ctx: DiagnosisContext) -> list[Finding]:
    bench = ctx.meta.get("bench_scaling")
    if not isinstance(bench, dict) or not isinstance(bench.get("baseline"), dict):
        return []
    base = bench["baseline"]
    nproc = int(bench.get("nproc") or 0)
    base_rate = base.get("samples_per_s")
    if nproc < 2 or not base_rate:
        return []
    rate = throughput(ctx, int(bench.get("warmup") or 0))
    if rate is None:
        return []
    efficiency = rate / (nproc * base_rate)
    limit = ctx.thresholds.scaling_efficiency_min_pct / 100
    if efficiency >= limit:
        return []
    speedup = rate / base_rate
    found = {f.id: f for f in ctx.findings}
    cause = next((found[c] for c in CAUSES if c in found), None)
    evidence = [
        Evidence(f"throughput at {nproc} ranks", round(rate, 1), "samples/s"),
        Evidence("throughput at 1 rank (bench scaling's trial)", round(base_rate, 1), "samples/s"),
        Evidence(f"speed-up of {nproc} ranks", round(speedup, 2), "x"),
        Evidence(f"E({nproc}) = speed-up / {nproc}", round(efficiency, 2), ""),
    ]
    cores = (base.get("cores_per_rank") or 0) / nproc
    if cause is not None:
        evidence.append(Evidence("cause found on this recording", f"{cause.id}: {cause.title}", ""))
        fix = f"Fix first what `{cause.id}` names: {cause.recommendation}"
    elif cores and cores < 1:
        fix = (
            f"Each rank has {cores:g} cores: more ranks than this node has cores for buy "
            "nothing on CPU; use GPUs, or more nodes."
        )
    else:
        fix = "Measure where the step goes with `diagnose` on both trials' recordings."
    verdict = "no faster than" if speedup <= 1.0 else f"only {speedup:.2f}x"
    return [
        Finding(
            id=ID,
            severity="warning" if speedup <= 1.0 else "info",
            title=f"{nproc} ranks are {verdict} one rank (E({nproc}) = {efficiency:.2f})",
            evidence=evidence,
            recommendation=(
                f"Run 1 rank until the loss is fixed ({nproc} ranks spend {nproc}x the "
                f"hardware for {speedup:.2f}x the throughput). {fix}"
            ),
            expected_effect=(
                f"At 1 rank the same throughput ({base_rate:.0f} samples/s measured) for "
                f"1/{nproc} of the hardware; after the fix, bench scaling again tells whether "
                f"{nproc} ranks pay."
            ),
            confidence=0.75,
            settings={"nproc_per_node": 1},
        )
    ]
