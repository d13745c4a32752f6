"""ranks-share-gpu: two ranks of a job run on the same GPU.

Each rank reports the device its DDP model is on (``rank-device``: CUDA index, GPU UUID); NVML's
per-process memory shows which GPU each rank's process holds memory on. Two ranks on one GPU
halve its throughput for each and double its memory use; NCCL refuses it in recent versions.
"""

from __future__ import annotations

from collections import defaultdict

from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.diagnosis.findings import Evidence, Finding

ID = "ranks-share-gpu"
SCOPE = "job"


def check(ctx: DiagnosisContext) -> list[Finding]:
    findings = []
    for (_, _node), ranks in ctx.job.by_node().items():
        node_ctx = ranks[0].ctx
        by_gpu: dict[str, list[int]] = defaultdict(list)
        for r in ranks:
            d = r.device or {}
            if d.get("device", "") and str(d.get("device")).startswith("cuda"):
                key = (
                    d.get("gpu_uuid")
                    or f"{r.info.get('cuda_visible_devices')}:{d.get('cuda_index')}"
                )
                by_gpu[key].append(r.rank)
        if not by_gpu:
            # No device report: NVML's per-process memory (rank processes on the same GPU).
            pid_rank = {r.pid: r.rank for r in ranks}
            seen: dict[int, set[int]] = defaultdict(set)
            for gpu_index, pid, _ in node_ctx.gpu_memory_holders:
                if pid in pid_rank:
                    seen[gpu_index].add(pid_rank[pid])
            by_gpu = {f"GPU {i}": sorted(v) for i, v in seen.items()}
        shared = {k: v for k, v in by_gpu.items() if len(set(v)) > 1}
        if not shared:
            continue
        gpu, holders = next(iter(shared.items()))
        count = len(node_ctx.gpu_infos) or None
        local = len(ranks)
        findings.append(
            Finding(
                id=ID,
                severity="critical",
                title=f"Ranks {', '.join(map(str, sorted(set(holders))))} on {ranks[0].node} share one GPU",
                evidence=[
                    Evidence("GPU", gpu, ""),
                    Evidence("ranks on it", ", ".join(map(str, sorted(set(holders)))), ""),
                    Evidence("ranks on the node", local, ""),
                    Evidence("GPUs on the node", count if count is not None else "unknown", ""),
                ],
                recommendation=(
                    "One rank per GPU: torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) before "
                    "building the model, DistributedDataParallel(model, device_ids=[local_rank]), "
                    "and no more ranks than GPUs"
                    + (f" (--nproc-per-node {count})." if count else ".")
                    + " Keep every GPU visible to every rank (no per-rank CUDA_VISIBLE_DEVICES)."
                ),
                expected_effect="Each rank gets a whole GPU: no time-slicing, half the memory.",
                confidence=0.9,
                settings={"nproc_per_node": count} if count else {},
            )
        )
    return findings
