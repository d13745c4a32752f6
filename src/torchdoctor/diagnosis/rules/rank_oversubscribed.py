"""rank-oversubscribed: on a node, the ranks' compute threads outnumber the usable cores.

Each rank runs ``torch.get_num_threads()`` compute threads plus its DataLoader workers (one
thread each). torchrun sets OMP_NUM_THREADS=1 only when it is unset; a value set for one
process (or torch's default, one per core) multiplied by the ranks oversubscribes the node.
"""

from __future__ import annotations

from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.diagnosis.findings import Evidence, Finding
from torchdoctor.diagnosis.rules._common import torch_threads

ID = "rank-oversubscribed"
SCOPE = "job"


def check(ctx: DiagnosisContext) -> list[Finding]:
    findings = []
    for (_, _node), ranks in ctx.job.by_node().items():
        if len(ranks) < 2:
            continue
        node_ctx = ranks[0].ctx
        cores = node_ctx.usable_cpus
        threads = {}
        for r in ranks:
            n = torch_threads(node_ctx, r.pid) or r.info.get("torch_threads")
            if n:
                threads[r.rank] = int(n)
        if len(threads) < len(ranks):
            continue
        workers = {
            r.rank: max(
                (d["num_workers"] for d in node_ctx.dataloaders if d["pid"] == r.pid), default=0
            )
            for r in ranks
        }
        total = sum(threads.values()) + sum(workers.values())
        if total <= cores:
            continue
        per_rank = max(1, int(cores // len(ranks)))
        node = ranks[0].node
        findings.append(
            Finding(
                id=ID,
                severity="warning",
                title=(
                    f"{len(ranks)} ranks on {node} run {total} compute threads on "
                    f"{cores:g} usable cores"
                ),
                evidence=[
                    Evidence("ranks on the node", len(ranks), ""),
                    Evidence(
                        "torch threads per rank",
                        ", ".join(f"rank {r}: {n}" for r, n in sorted(threads.items())),
                        "",
                    ),
                    Evidence("DataLoader workers per rank", max(workers.values()), ""),
                    Evidence("usable cores", round(cores, 1), "cores"),
                ],
                recommendation=(
                    f"OMP_NUM_THREADS={per_rank} for every rank (usable cores / local ranks; "
                    "`torchdoctor launch` sets it when unset), and count DataLoader workers in: "
                    f"threads + workers per rank <= {per_rank}."
                ),
                expected_effect=(
                    "Ranks stop preempting each other; with all-reduce every rank waits for the "
                    "most preempted one, so oversubscription slows the whole job."
                ),
                confidence=0.8,
                settings={"OMP_NUM_THREADS": per_rank},
            )
        )
    return findings
