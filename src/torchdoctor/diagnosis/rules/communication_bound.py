"""communication-bound: gradient all-reduce the backward pass does not hide takes more than
10 % of the step (the PyTorch profiler plugin's threshold).

The figures are DDP's own (``_get_ddp_logging_data()``, sampled on DDP's iterations 1-10 and
every 100th, first two left out for the bucket rebuild): backward communication time and its
overlap with backward compute. Exposed = comm - overlap. A rank that reaches an all-reduce
before its peer counts its wait for that peer as communication (a straggler, or a rank the
scheduler preempted on a busy machine, which can be either rank, step by step), so each
sampled iteration is read from the rank that reached it last: it waited for nobody, and what
it paid is the all-reduce itself.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.diagnosis.findings import Evidence, Finding
from torchdoctor.diagnosis.ranks import RankSeries, ms

ID = "communication-bound"
SCOPE = "job"
EXPOSED_SHARE = 0.10
MIN_SAMPLES = 3
MiB = 2**20


@dataclass(frozen=True)
class ExposedComm:
    """The all-reduce's cost per step, over a job's sampled DDP iterations."""

    comm_s: float  # backward all-reduce (median), as DDP timed it
    overlap_s: float  # of which overlapped with backward compute (median)
    exposed_s: float  # comm - overlap: the lower quartile (preemption only ever adds)
    step_s: float  # the ranks' median step
    iterations: int  # sampled iterations reached by two ranks or more

    @property
    def share(self) -> float:
        return self.exposed_s / self.step_s


def _exposed(step: dict) -> float:
    return max(step["comm_s"] - (step["comm_overlap_s"] or 0.0), 0.0)


def exposed_communication(ranks: Iterable[RankSeries]) -> ExposedComm | None:
    """The job's exposed communication, each iteration from the rank that reached it last."""
    by_iteration: dict[int, list[dict]] = {}
    steps = []
    for rank in ranks:
        for s in rank.ddp_steps():
            by_iteration.setdefault(s["step"], []).append(s)
        step = rank.median("wall_s")
        if step:
            steps.append(step)
    last = [min(rows, key=_exposed) for rows in by_iteration.values() if len(rows) >= 2]
    if len(last) < MIN_SAMPLES or not steps:
        return None
    return ExposedComm(
        comm_s=statistics.median(s["comm_s"] for s in last),
        overlap_s=statistics.median(s["comm_overlap_s"] or 0.0 for s in last),
        exposed_s=_quartile([_exposed(s) for s in last]),
        step_s=statistics.median(steps),
        iterations=len(last),
    )


def _quartile(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 4]


def check(ctx: DiagnosisContext) -> list[Finding]:
    job = ctx.job
    figures = exposed_communication(job.ranks.values())
    if figures is None or figures.share <= EXPOSED_SHARE:
        return []
    comm, overlap = figures.comm_s, figures.overlap_s
    exposed, step = figures.exposed_s, figures.step_s
    share = figures.share
    config = next(iter(job.ranks.values())).ddp_config or {}  # every rank builds the same DDP
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
        Evidence(
            "figures from",
            f"{figures.iterations} sampled iterations, each from the last rank to reach it",
            "",
        ),
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
