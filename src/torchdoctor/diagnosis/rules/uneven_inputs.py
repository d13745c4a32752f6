"""uneven-inputs: the ranks get different numbers of batches per epoch.

DDP all-reduces in every backward: a rank with more batches than the others waits in its
extra all-reduce until the timeout, or fails when the others leave. The batch counts come from
``len(DataLoader)`` as each rank started its epochs (``rank-epoch`` events), else from the steps
each rank recorded.
"""

from __future__ import annotations

from collections import defaultdict

from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.diagnosis.findings import Evidence, Finding

ID = "uneven-inputs"
SCOPE = "job"


def batches_per_epoch(job) -> dict[int, list[int]]:
    """Training batches per epoch of each rank's first training loader, in epoch order."""
    out: dict[int, list[int]] = {}
    for rank in job.ranks.values():
        by_loader: dict[int, list[int]] = defaultdict(list)
        for e in rank.events_of("rank-epoch"):
            d = e["detail"]
            if d.get("training") and d.get("batches") is not None:
                by_loader[d.get("loader_id") or 0].append(int(d["batches"]))
        if by_loader:
            out[rank.rank] = by_loader[min(by_loader)]
    return out


def check(ctx: DiagnosisContext) -> list[Finding]:
    job = ctx.job
    if not job.distributed:
        return []
    counts = batches_per_epoch(job)
    evidence: list[Evidence] = []
    if len(counts) >= 2:
        firsts = {r: c[0] for r, c in counts.items() if c}
        if len(set(firsts.values())) <= 1:
            return []
        for r, n in sorted(firsts.items()):
            evidence.append(Evidence(f"rank {r} batches per epoch", n, "batches"))
    else:
        steps = {r.rank: r.step_count for r in job.ranks.values() if r.steps}
        if len(steps) < 2 or max(steps.values()) - min(steps.values()) <= 1:
            return []
        for r, n in sorted(steps.items()):
            evidence.append(Evidence(f"rank {r} steps recorded", n, "steps"))
    steps = {r.rank: r.step_count for r in job.ranks.values()}
    evidence.append(
        Evidence(
            "steps recorded per rank",
            ", ".join(f"rank {r}: {n}" for r, n in sorted(steps.items())),
            "",
        )
    )
    errors = [e for r in job.ranks.values() for e in r.events_of("rank-error")]
    if errors:
        evidence.append(Evidence("a rank failed", errors[0]["detail"].get("error", "")[:160], ""))
    return [
        Finding(
            id=ID,
            severity="critical" if errors else "warning",
            title="Uneven inputs: the ranks do not get the same number of batches per epoch",
            evidence=evidence,
            recommendation=(
                "Give every rank the same number of batches: DistributedSampler(dataset, "
                "drop_last=True) instead of a hand-made split, or shards of "
                "len(dataset) // world_size samples; if the counts must differ, wrap the loop "
                "in `with model.join():` (torch.distributed.algorithms.Join)."
            ),
            expected_effect=(
                "No rank waits in an all-reduce the others never join: no hang or "
                "timeout at the end of an epoch."
            ),
            confidence=0.9,
            settings={"drop_last": True},
        )
    ]
