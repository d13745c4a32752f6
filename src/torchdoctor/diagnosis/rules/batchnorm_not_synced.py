"""batchnorm-not-synced: DDP over a model with BatchNorm layers, a small batch per rank, no
SyncBatchNorm.

Under DDP each rank normalises with the statistics of its own batch (DDP only broadcasts rank
0's running buffers); with a few samples per rank those statistics are noisy. The limit is the
threshold ``batchnorm_min_batch_per_rank`` (16: Wu & He, "Group Normalization", ECCV 2018,
arXiv:1803.08494 - BN's ImageNet error "increases rapidly when the batch size becomes smaller",
from 23.6 % at 32 images per GPU to 34.7 % at 2). Read from the ``ddp-model`` event (layers)
and the ranks' steps (batch size).
"""

from __future__ import annotations

import statistics

from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.diagnosis.findings import Evidence, Finding

ID = "batchnorm-not-synced"
SCOPE = "job"


def check(ctx: DiagnosisContext) -> list[Finding]:
    job = ctx.job
    if not job.distributed:
        return []
    models = [r.first_event("ddp-model") for r in job.ranks.values()]
    models = [m for m in models if isinstance(m, dict) and m]
    if not models or any(m.get("syncbatchnorm_layers") for m in models):
        return []
    layers = max(int(m.get("batchnorm_layers") or 0) for m in models)
    if not layers:
        return []
    batches = [s["batch_size"] for r in job.ranks.values() for s in r.steps if s["batch_size"]]
    if not batches:
        return []
    batch = statistics.median(batches)
    limit = ctx.thresholds.batchnorm_min_batch_per_rank
    if batch >= limit:
        return []
    names = next((m.get("batchnorm_names") for m in models if m.get("batchnorm_names")), [])
    return [
        Finding(
            id=ID,
            severity="warning",
            title=(
                f"BatchNorm not synchronised: {layers} BatchNorm layer(s) normalise over "
                f"{batch:g} samples per rank"
            ),
            evidence=[
                Evidence("BatchNorm layers (not SyncBatchNorm)", layers, "layers"),
                Evidence("first of them", ", ".join(names), ""),
                Evidence("batch per rank (median)", batch, "samples"),
                Evidence("batch below which BN statistics degrade", limit, "samples"),
                Evidence("ranks", len(job.ranks), "ranks"),
            ],
            recommendation=(
                "Convert the BatchNorm layers before wrapping the model in DDP, after moving it "
                "to its GPU: `model = nn.SyncBatchNorm.convert_sync_batchnorm(model)` then "
                "`DistributedDataParallel(model, device_ids=[local_rank])` (SyncBatchNorm needs "
                "CUDA; NCCL). Or a batch of at least "
                f"{limit:g} per rank, or GroupNorm."
            ),
            expected_effect=(
                f"Statistics over the global batch ({batch:g} x {len(job.ranks)} ranks) instead "
                "of each rank's: Wu & He (ECCV 2018) measure BN's ImageNet error rising from "
                "23.6 % at 32 images per GPU to 34.7 % at 2. Its cost is one all-reduce per "
                "BatchNorm layer in each forward and backward: measure it on your ranks by "
                "recording the converted run and comparing with `torchdoctor compare`."
            ),
            confidence=0.7,
            settings={"sync_batchnorm": True},
        )
    ]
