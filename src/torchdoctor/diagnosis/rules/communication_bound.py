"""communication-bound: gradient all-reduce the backward pass does not hide takes more than
10 % of the step (the PyTorch profiler plugin's threshold).

The figures are DDP's own (``_get_ddp_logging_data()``, sampled on DDP's iterations 1-10 and
every 100th, first two left out for the bucket rebuild): backward communication time and its
overlap with backward compute. Exposed = comm - overlap. A rank that waits for a straggler
counts the wait as communication, so the rank with the least exposed communication (the
straggler, if any) is taken: what remains is the cost of the all-reduce itself.
"""

from __future__ import annotations

import math
import statistics

from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.diagnosis.findings import Evidence, Finding
from torchdoctor.diagnosis.ranks import RankSeries, ms

ID = "communication-bound"
SCOPE = "job"
EXPOSED_SHARE = 0.10
MIN_SAMPLES = 3
MiB = 2**20


def exposed_share(rank: RankSeries) -> tuple[float, float, float, float] | None:
    """(comm, overlap, exposed, step) in seconds over the rank's DDP samples: medians, and
    the lower quartile of exposed communication."""
    sampled = rank.ddp_steps()
    if len(sampled) < MIN_SAMPLES:
        return None
    comm = statistics.median(s["comm_s"] for s in sampled)
    overlap = statistics.median(s["comm_overlap_s"] or 0.0 for s in sampled)
    # Waiting for a late peer (a straggler, a rank the scheduler left out) only ever adds to
    # DDP's comm time: the lower quartile is the all-reduce's own cost.
    exposed = _quartile([max(s["comm_s"] - (s["comm_overlap_s"] or 0.0), 0.0) for s in sampled])
    step = rank.median("wall_s") or statistics.median(s["wall_s"] for s in sampled)
    return comm, overlap, exposed, step


def _quartile(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 4]


def check(ctx: DiagnosisContext) -> list[Finding]:
    job = ctx.job
    figures = {r.rank: exposed_share(r) for r in job.ranks.values()}
    figures = {k: v for k, v in figures.items() if v is not None and v[3] > 0}
    if len(figures) < 2:
        return []
    best = min(figures, key=lambda k: figures[k][2] / figures[k][3])
    comm, overlap, exposed, step = figures[best]
    share = exposed / step
    if share <= EXPOSED_SHARE:
        return []
    rank = job.ranks[best]
    config = rank.ddp_config or {}
    world = job.world_size or len(job.ranks)
    size = config.get("total_parameter_size_bytes")
    evidence = [
        Evidence(
            "exposed communication (comm - overlap) share of step", round(share * 100, 1), "%"
        ),
        Evidence("backward all-reduce per step (DDP)", ms(comm), "ms"),
        Evidence("of which overlapped with backward compute (DDP)", ms(overlap), "ms"),
        Evidence("step time", ms(step), "ms"),
        Evidence("ranks", world, ""),
        Evidence("figures from", f"rank {best} (least waiting)", ""),
    ]
    if size:
        evidence.append(Evidence("gradient bytes all-reduced per step", size, "B"))
        algbw = size / comm if comm > 0 else None
        if algbw:
            busbw = algbw * 2 * (world - 1) / world
            evidence.append(
                Evidence("achieved bus bandwidth (DDP figures)", round(busbw / 1e9, 3), "GB/s")
            )
    buckets = bucket_sizes(config)
    if buckets:
        evidence.append(Evidence("DDP buckets", len(buckets), ""))
        evidence.append(Evidence("largest bucket", max(buckets), "B"))
    evidence.append(Evidence("backend", config.get("backend_name") or "?", ""))
    return [
        Finding(
            id=ID,
            severity="warning",
            title=(
                f"Communication-bound: the gradient all-reduce leaves {ms(exposed)} ms of every "
                f"{ms(step)} ms step exposed ({round(share * 100)} %)"
            ),
            evidence=evidence,
            recommendation=_fix(config, exposed, step, overlap / comm if comm > 0 else 0.0),
            expected_effect=(
                f"Up to {round(share * 100)} % shorter steps if the all-reduce is hidden; with "
                "no_sync accumulation over k micro-batches it is paid once per k."
            ),
            confidence=0.75,
            settings=_settings(config, exposed, step),
            details=(
                "DDP measures its own all-reduce (backward comm) and the part overlapped with "
                "backward compute; the rest is time the step waits for the network."
            ),
        )
    ]


def _accumulation(exposed: float, step: float) -> int:
    """Micro-batches per all-reduce that bring exposed communication under the threshold."""
    compute = max(step - exposed, 1e-9)
    # k steps of compute, one exposed all-reduce: exposed / (k * compute + exposed) <= 10 %
    k = math.ceil(exposed * (1 - EXPOSED_SHARE) / (EXPOSED_SHARE * compute))
    return max(2, min(k, 64))


def _settings(config: dict, exposed: float, step: float) -> dict:
    out = {"no_sync_accumulation_steps": _accumulation(exposed, step)}
    if not config.get("gradient_as_bucket_view"):
        out["gradient_as_bucket_view"] = True
    if not config.get("static_graph"):
        out["static_graph"] = True
    return out


def bucket_sizes(config: dict) -> list[int]:
    text = str(config.get("rebuilt_bucket_sizes") or config.get("bucket_sizes") or "")
    return [int(b) for b in text.replace(" ", "").split(",") if b.isdigit()]


def _fix(config: dict, exposed: float, step: float, overlap_share: float) -> str:
    k = _accumulation(exposed, step)
    args = []
    if not config.get("gradient_as_bucket_view"):
        args.append("gradient_as_bucket_view=True")
    if not config.get("static_graph"):
        args.append("static_graph=True (if every step uses the same parameters)")
    largest = max(bucket_sizes(config), default=0)
    if overlap_share < 0.5 and largest > 4 * MiB:
        # A big bucket is all-reduced only once all its gradients are ready, near the end of
        # backward: smaller buckets start earlier and overlap with the rest of backward.
        args.append(f"bucket_cap_mb={max(1, round(largest / 4 / MiB))}")
    parts = [
        f"Accumulate {k} micro-batches per all-reduce: `with model.no_sync():` for the first "
        f"{k - 1} backward passes, then a normal backward and optimizer.step() (same samples "
        f"per update at {k}x the per-rank batch, or keep the global batch with a {k}x smaller "
        "one)."
    ]
    if args:
        parts.append(f"DistributedDataParallel(model, {', '.join(args)}).")
    parts.append(
        "Halve the bytes with a compression hook: "
        "`model.register_comm_hook(None, torch.distributed.algorithms.ddp_comm_hooks."
        "default_hooks.bf16_compress_hook)`; or a faster interconnect (measure it with "
        "`torchdoctor bench allreduce`)."
    )
    return " ".join(parts)
