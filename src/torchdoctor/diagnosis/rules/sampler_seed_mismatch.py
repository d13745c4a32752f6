"""sampler-seed-mismatch: the ranks' DistributedSamplers disagree on seed, shuffle, drop_last
or num_replicas.

DistributedSampler shards one permutation (``seed + epoch``) of the whole dataset: rank r takes
every world-th index of it. Ranks that shuffle with different seeds cut different
permutations, so their shards overlap (samples seen twice in an epoch, others never); a
different shuffle or drop_last also breaks the split. Read from the ``sampler-epoch`` events
each rank's sampler sends at the start of an epoch.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.diagnosis.findings import Evidence, Finding

ID = "sampler-seed-mismatch"
SCOPE = "job"
_FIELDS = ("seed", "shuffle", "drop_last", "num_replicas")


def check(ctx: DiagnosisContext) -> list[Finding]:
    job = ctx.job
    if not job.distributed:
        return []
    # sampler id -> rank -> its first sampler-epoch detail
    first: dict[int, dict[int, dict[str, Any]]] = {}
    for rank in job.ranks.values():
        for e in rank.events_of("sampler-epoch"):
            d = e["detail"]
            if not isinstance(d, dict):
                continue  # an edited or damaged row: nothing claimed from it
            first.setdefault(d.get("sampler_id") or 0, {}).setdefault(rank.rank, d)
    for sampler_id in sorted(first):
        by_rank = first[sampler_id]
        if len(by_rank) < 2:
            continue
        differing = [f for f in _FIELDS if len({by_rank[r].get(f) for r in by_rank}) > 1]
        if differing:
            return [_finding(by_rank, differing, job.world_size or len(by_rank))]
    return []


def _finding(by_rank: dict[int, dict[str, Any]], differing: list[str], world: int) -> Finding:
    evidence = [
        Evidence(
            f"{field} per rank",
            ", ".join(f"rank {r}: {by_rank[r].get(field)}" for r in sorted(by_rank)),
            "",
        )
        for field in differing
    ]
    seeds = Counter(by_rank[r].get("seed") for r in sorted(by_rank))
    seed = by_rank[min(by_rank)].get("seed") if "seed" in differing else seeds.most_common(1)[0][0]
    args = [f"seed={seed}"]
    for field in ("shuffle", "drop_last"):
        if field in differing:
            args.append(f"{field}={by_rank[min(by_rank)].get(field)}")
    effect = "Every rank cuts its shard from the same permutation: each sample once per epoch."
    if "seed" in differing and all(by_rank[r].get("shuffle") for r in by_rank):
        # Independent permutations: a sample is missed by all N ranks with (1 - 1/N)^N.
        missed = (1 - 1 / world) ** world * 100
        effect += (
            f" Today, with independent shuffles on {world} ranks, about {missed:.0f} % of the "
            "samples are skipped in each epoch and as many are seen twice or more."
        )
    return Finding(
        id=ID,
        severity="warning",
        title="DistributedSampler settings differ across ranks: " + ", ".join(differing),
        evidence=evidence,
        recommendation=(
            f"Build the sampler with the same arguments on every rank: "
            f"`DistributedSampler(dataset, {', '.join(args)})`; seed it with a constant (or a "
            "value broadcast from rank 0), never with the rank or the time; seed per-rank "
            "augmentation elsewhere."
        ),
        expected_effect=effect,
        confidence=0.9,
        settings={"sampler_seed": seed},
    )
