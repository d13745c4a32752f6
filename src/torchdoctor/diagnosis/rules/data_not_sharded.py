"""data-not-sharded: the ranks of a job train on the same samples.

Each rank fingerprints the first batches it draws in every training epoch (``data-fingerprint``
events of the agent: a hash of the sample indices, or of the batch tensors' values for an
IterableDataset); two ranks with the same fingerprint for one loader and epoch drew the same
samples. Also found without fingerprints: a DistributedSampler built for another world size
or rank than the process's (``sampler-epoch`` against ``rank-info``). Without either kind of
event (a recording made before them, one rank) the rule says nothing.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.diagnosis.findings import Evidence, Finding

ID = "data-not-sharded"
SCOPE = "job"


def _shared_fingerprints(job) -> tuple[list[int], dict[str, Any]] | None:
    """(ranks that drew the same samples, one of their fingerprints), first epoch first."""
    by_key: dict[tuple[int, int], dict[int, dict[str, Any]]] = defaultdict(dict)
    for rank in job.ranks.values():
        for e in rank.events_of("data-fingerprint"):
            d = e["detail"]
            if not isinstance(d, dict):
                continue  # an edited or damaged row: nothing claimed from it
            by_key[(d.get("loader_id") or 0, d.get("epoch") or 0)].setdefault(rank.rank, d)
    for key in sorted(by_key, key=lambda k: (k[1], k[0])):
        digests: dict[str, list[int]] = defaultdict(list)
        for r, d in by_key[key].items():
            digests[str(d.get("digest"))].append(r)
        same = max(digests.values(), key=len)
        if len(same) >= 2:
            return sorted(same), by_key[key][min(same)]
    return None


def _wrong_samplers(job) -> list[str]:
    """DistributedSamplers whose num_replicas or rank is not the process's own."""
    wrong = []
    world = job.world_size
    for rank in job.ranks.values():
        for e in rank.events_of("sampler-epoch")[:1]:
            d = e["detail"]
            if not isinstance(d, dict):
                continue  # an edited or damaged row: nothing claimed from it
            replicas, own = d.get("num_replicas"), d.get("sampler_rank")
            if (replicas is not None and world and replicas != world) or (
                own is not None and own != rank.rank
            ):
                wrong.append(
                    f"rank {rank.rank}: DistributedSampler(num_replicas={replicas}, rank={own})"
                )
    return wrong


def check(ctx: DiagnosisContext) -> list[Finding]:
    job = ctx.job
    if not job.distributed:
        return []
    shared = _shared_fingerprints(job)
    wrong = _wrong_samplers(job)
    if shared is None and not wrong:
        return []
    world = job.world_size or len(job.ranks)
    evidence: list[Evidence] = []
    iterable = False
    if shared is not None:
        ranks, d = shared
        iterable = d.get("kind") == "data"
        what = "batch values" if iterable else "sample indices"
        evidence += [
            Evidence(
                f"ranks whose first batches have the same {what}", ", ".join(map(str, ranks)), ""
            ),
            Evidence("epoch compared", int(d.get("epoch") or 0), ""),
            Evidence("batches fingerprinted per rank", int(d.get("batches") or 0), "batches"),
            Evidence("samples in them", int(d.get("samples") or 0), "samples"),
            Evidence(
                "first " + ("values" if iterable else "indices") + " drawn on each",
                str(d.get("first")),
                "",
            ),
        ]
    for text in wrong:
        evidence.append(Evidence("sampler built for another world", text, ""))
    samples = _samples_per_epoch(job)
    if samples is not None:
        evidence.append(Evidence("samples per epoch on each rank", samples, "samples"))
    if iterable:
        rec = (
            "Split the stream by rank in the IterableDataset's __iter__: `rank, world = "
            "dist.get_rank(), dist.get_world_size()` and yield only the samples with "
            "`index % world == rank` (for Hugging Face datasets: "
            "`datasets.distributed.split_dataset_by_node(ds, rank=rank, world_size=world)`)."
        )
    else:
        rec = (
            "Give the DataLoader a DistributedSampler and reshuffle it each epoch: "
            "`sampler = DistributedSampler(dataset)` (num_replicas and rank come from the "
            "process group: do not pass them), `DataLoader(dataset, ..., sampler=sampler)` "
            "(without shuffle=), and `sampler.set_epoch(epoch)` at the start of every epoch."
        )
    effect = (
        f"Each rank draws its own 1/{world} of the data: each epoch {world} times shorter for "
        f"the same samples seen, where today the {world} ranks compute the same samples and "
        f"{world - 1} of every {world} sample computations add nothing."
    )
    return [
        Finding(
            id=ID,
            severity="critical",
            title=f"Data not sharded: {len(shared[0]) if shared else world} ranks train on the same samples",
            evidence=evidence,
            recommendation=rec,
            expected_effect=effect,
            confidence=0.9 if shared is not None else 0.8,
            settings={"sampler": "DistributedSampler", "num_replicas": world, "set_epoch": True},
        )
    ]


def _samples_per_epoch(job) -> int | None:
    for rank in job.ranks.values():
        for e in rank.events_of("rank-epoch"):
            d = e["detail"]
            if not isinstance(d, dict):
                continue  # an edited or damaged row: nothing claimed from it
            if d.get("training") and d.get("samples") is not None:
                return int(d["samples"])
    return None
