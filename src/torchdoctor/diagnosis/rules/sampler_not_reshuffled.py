"""sampler-not-reshuffled: a shuffling DistributedSampler gave every epoch the same order.

DistributedSampler shuffles with ``seed + epoch``; without ``sampler.set_epoch(epoch)`` the
epoch stays 0 and each rank sees the same samples in the same order every epoch. Seen from the
rank hooks: the sampler's ``__iter__`` ran twice or more with an unchanged epoch.
"""

from __future__ import annotations

from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.diagnosis.findings import Evidence, Finding

ID = "sampler-not-reshuffled"
SCOPE = "job"


def check(ctx: DiagnosisContext) -> list[Finding]:
    ranks_hit = []
    passes = epoch = 0
    for rank in ctx.job.ranks.values():
        by_sampler: dict[int, list[dict]] = {}
        for e in rank.events_of("sampler-epoch"):
            by_sampler.setdefault(e["detail"].get("sampler_id", 0), []).append(e["detail"])
        for iters in by_sampler.values():
            shuffled = [d for d in iters if d.get("shuffle")]
            repeats = sum(
                1 for a, b in zip(shuffled, shuffled[1:], strict=False) if a["epoch"] == b["epoch"]
            )
            if repeats:
                ranks_hit.append(rank.rank)
                passes = max(passes, len(shuffled))
                epoch = shuffled[-1]["epoch"]
                break
    if not ranks_hit:
        return []
    set_calls = sum(len(r.events_of("sampler-set-epoch")) for r in ctx.job.ranks.values())
    return [
        Finding(
            id=ID,
            severity="warning",
            title=(
                f"DistributedSampler was not reshuffled: {passes} passes over the data, "
                f"all with epoch {epoch}"
            ),
            evidence=[
                Evidence("passes of the shuffling sampler", passes, ""),
                Evidence("epoch the sampler used in each", epoch, ""),
                Evidence("set_epoch() calls seen", set_calls, ""),
                Evidence("ranks", ", ".join(map(str, ranks_hit)), ""),
            ],
            recommendation=(
                "Call sampler.set_epoch(epoch) at the start of every epoch, before iterating "
                "the DataLoader: `for epoch in range(n): sampler.set_epoch(epoch); for batch in "
                "loader: ...`."
            ),
            expected_effect=(
                "Each epoch gets a new order (seed + epoch), as with shuffle=True on one "
                "process; repeating the same order every epoch can hurt convergence."
            ),
            confidence=0.95,
        )
    ]
