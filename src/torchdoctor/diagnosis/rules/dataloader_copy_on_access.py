"""dataloader-copy-on-access: DataLoader workers' memory grows as they touch the data set.

Forked workers share the trainer's pages copy-on-write; reading Python objects (lists, dicts)
updates their reference counts, which writes to the pages and copies them into every worker.
The growth is bounded by the data set, so it is not a leak, but RSS summed over workers
counts shared pages once per worker: the proportional set size (PSS) tells the real cost.
"""

from __future__ import annotations

from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.diagnosis.findings import Evidence, Finding
from torchdoctor.diagnosis.series import linear_fit
from torchdoctor.units import fmt_bytes

ID = "dataloader-copy-on-access"
MIN_R2 = 0.6


def check(ctx: DiagnosisContext) -> list[Finding]:
    workers = ctx.worker_pids
    if not workers:
        return []
    growths: list[tuple[int, float, float, float]] = []  # pid, uss growth, rss growth, pss end
    for pid in workers:
        samples = [s for s in ctx.samples_by_pid[pid] if s["uss"] is not None]
        if len(samples) < 4:
            continue
        fit = linear_fit([(s["t"], float(s["uss"])) for s in samples])
        if fit is None or fit[0] <= 0 or fit[2] < MIN_R2:
            continue
        growth = samples[-1]["uss"] - samples[0]["uss"]
        rss_growth = samples[-1]["rss"] - samples[0]["rss"]
        growths.append((pid, float(growth), float(rss_growth), float(samples[-1]["pss"] or 0)))
    total = sum(g for _, g, _, _ in growths)
    if not growths or total < ctx.thresholds.leak_min_growth_bytes:
        return []
    rss_total = sum(r for _, _, r, _ in growths)
    pss_total = sum(p for _, _, _, p in growths)
    t0, t1 = ctx.t_start, ctx.t_end
    return [
        Finding(
            id=ID,
            severity="info",
            title=f"{len(growths)} DataLoader workers copy {fmt_bytes(total)} of the data set while reading it",
            evidence=[
                Evidence("growth of the workers' private memory (USS)", round(total), "B", t0, t1),
                Evidence(
                    "growth of the workers' RSS (counts shared pages per worker)",
                    round(rss_total),
                    "B",
                    t0,
                    t1,
                ),
                Evidence("workers' PSS at the end", round(pss_total), "B", t1, t1),
                Evidence("growing workers", len(growths), "processes"),
            ],
            recommendation=(
                "Not a leak: each worker copies the pages of the data set's Python objects it "
                "touches, up to one full copy per worker. Hold samples in NumPy arrays or "
                "tensors (one buffer, no per-item reference counts) instead of lists of "
                "Python objects to keep the pages shared; fewer workers also means fewer copies."
            ),
            expected_effect="Workers' memory stays flat and shared with the trainer.",
            confidence=0.6,
        )
    ]
