"""rank-straggler: one rank's own work per step is persistently slower than the others'.

Step times say nothing here: every rank waits for the slowest in all-reduce, so their steps
are equally long, and the straggler is the rank that waits *least*. What is compared is each
rank's own work per step: data wait, forward, optimizer, DDP's backward compute (on the
iterations DDP samples), and the time spent outside those (the loop's own code). The last is
counted only when DDP's forward was seen: then the waiting happens inside backward, not there.

Score (NVIDIA resiliency extension style): the fastest rank's median own work divided by this
rank's, below 0.75 and worth at least 10 % of the step. The cause is the part that makes up
most of the excess; the node's CPU load and the rank's CPU affinity are named when they differ.
"""

from __future__ import annotations

import statistics

from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.diagnosis.findings import Evidence, Finding
from torchdoctor.diagnosis.ranks import RankSeries, ms

ID = "rank-straggler"
SCOPE = "job"
SCORE_LIMIT = 0.75  # fastest rank's own work / this rank's (NVRx threshold)
MIN_STEP_SHARE = 0.10  # the excess must be worth this share of the step
PERSISTENT_SHARE = 0.6  # of the steps where the rank is slower than the others' median
CAUSE_SHARE = 0.5  # a part that makes up this share of the excess is named as the cause

PARTS = {
    "data_wait_s": ("data wait", "its input pipeline is slower"),
    "forward_s": ("forward", "its forward pass computes slower"),
    "backward_compute_s": ("backward compute", "its backward pass computes slower"),
    "optimizer_s": ("optimizer step", "its optimizer step is slower"),
    "outside_s": ("code outside forward/backward/optimizer", "it runs extra code in the loop"),
}


def own_parts(rank: RankSeries) -> dict[str, float]:
    """Median seconds per step of each part of the rank's own work that it recorded."""
    parts: dict[str, float] = {}
    for column in ("data_wait_s", "forward_s", "optimizer_s"):
        value = rank.median(column)
        if value is not None:
            parts[column] = value
    value = rank.ddp_median("backward_compute_s")  # DDP's sampled steps
    if value is not None:
        parts["backward_compute_s"] = value
    if "forward_s" in parts:
        outside = rank.median("outside_s")  # over the steps that timed their backward
        if outside is not None:
            parts["outside_s"] = max(outside, 0.0)
    return parts


def _per_step_own(rank: RankSeries, columns: list[str]) -> dict[int, float]:
    out = {}
    for s in rank.steady:
        total = 0.0
        for c in columns:
            if c == "outside_s":
                total += max(
                    s["wall_s"]
                    - sum(s[k] or 0.0 for k in ("data_wait_s", "forward_s", "backward_s"))
                    - (s["optimizer_s"] or 0.0),
                    0.0,
                )
            elif c != "backward_compute_s":
                total += s[c] or 0.0
        out[s["step"]] = total
    return out


def check(ctx: DiagnosisContext) -> list[Finding]:
    job = ctx.job
    ranks = job.stepping(minimum=5)
    if len(ranks) < 2:
        return []
    parts = {r.rank: own_parts(r) for r in ranks}
    common = set.intersection(*(set(p) for p in parts.values()))
    if not common:
        return []
    own = {r.rank: sum(parts[r.rank][c] for c in common) for r in ranks}
    slow = max(ranks, key=lambda r: own[r.rank])
    others = [r for r in ranks if r is not slow]
    fastest = min(own.values())
    if own[slow.rank] <= 0:
        return []
    score = fastest / own[slow.rank]
    typical = statistics.median(own[r.rank] for r in others)
    excess = own[slow.rank] - typical
    step = statistics.median(r.median("wall_s") or 0.0 for r in ranks)
    if score >= SCORE_LIMIT or step <= 0 or excess < MIN_STEP_SHARE * step:
        return []
    # Persistent: slower than the others' median own work step by step, most of the time.
    columns = sorted(c for c in common if c != "backward_compute_s")
    slow_steps = _per_step_own(slow, columns)
    other_steps = [_per_step_own(r, columns) for r in others]
    compared = slower = 0
    for step_no, value in slow_steps.items():
        peers = [o[step_no] for o in other_steps if step_no in o]
        if peers:
            compared += 1
            slower += value > statistics.median(peers) + excess / 2
    persistent = slower / compared if compared else 1.0
    if compared and persistent < PERSISTENT_SHARE:
        return []

    excess_by_part = {
        c: parts[slow.rank][c] - statistics.median(parts[r.rank][c] for r in others) for c in common
    }
    cause_part = max(excess_by_part, key=excess_by_part.get)
    named = excess_by_part[cause_part] >= CAUSE_SHARE * excess
    evidence = [
        Evidence(f"rank {slow.rank} own work per step (median)", ms(own[slow.rank]), "ms"),
        Evidence("other ranks' own work per step (median)", ms(typical), "ms"),
        Evidence("score: fastest rank / this rank (below 0.75 = straggler)", round(score, 2), ""),
        Evidence("step time (equal on every rank: they wait for it)", ms(step), "ms"),
        Evidence(f"steps where rank {slow.rank} was slower", round(persistent * 100), "%"),
    ]
    for c in sorted(common, key=lambda c: -excess_by_part[c]):
        others_value = statistics.median(parts[r.rank][c] for r in others)
        evidence.append(
            Evidence(
                f"{PARTS[c][0]}: rank {slow.rank} vs others",
                f"{ms(parts[slow.rank][c])} vs {ms(others_value)}",
                "ms",
            )
        )
    wait = _waits(slow, others)
    if wait is not None:
        evidence.append(Evidence("backward incl. all-reduce wait: this rank vs others", wait, "ms"))
    context = _node_context(ctx, slow, others)
    evidence.extend(context[0])
    cause = PARTS[cause_part][1] if named else "its own work is slower (no single part dominates)"
    if context[1]:
        cause += f"; {context[1]}"
    return [
        Finding(
            id=ID,
            severity="warning",
            title=f"Rank {slow.rank} on {slow.node} is a straggler: {cause}",
            evidence=evidence,
            recommendation=_fix(slow, cause_part if named else None, context[1]),
            expected_effect=(
                f"Every rank waits about {ms(excess)} ms per step for rank {slow.rank}; "
                f"bringing it to the others' pace cuts the step by up to "
                f"{round(100 * excess / step)} %."
            ),
            confidence=0.8 if named else 0.6,
            settings={"rank": slow.rank, "node_rank": slow.node_rank, "cause": cause_part},
            details=(
                "Compared: each rank's own work (data wait, forward, backward compute, "
                "optimizer, loop code), not step time, which the all-reduce makes equal. A "
                "delay inside backward is seen only through DDP's sampled backward compute."
            ),
        )
    ]


def _waits(slow: RankSeries, others: list[RankSeries]) -> str | None:
    mine = slow.median("backward_s")
    theirs = [o.median("backward_s") for o in others]
    theirs = [t for t in theirs if t is not None]
    if mine is None or not theirs:
        return None
    return f"{ms(mine)} vs {ms(statistics.median(theirs))}"


def _node_context(
    ctx: DiagnosisContext, slow: RankSeries, others: list[RankSeries]
) -> tuple[list[Evidence], str]:
    """Evidence of why the rank is slow that the recording shows: fewer CPUs, a busier node."""
    evidence: list[Evidence] = []
    reasons = []
    mine = slow.info.get("affinity") or []
    theirs = [len(o.info.get("affinity") or []) for o in others if o.info.get("affinity")]
    if mine and theirs and len(mine) < statistics.median(theirs):
        evidence.append(Evidence(f"CPUs rank {slow.rank} may run on", ",".join(map(str, mine)), ""))
        reasons.append(
            f"it may run on {len(mine)} CPU(s), the others on {round(statistics.median(theirs))}"
        )
    slow_cpu = _process_cores(slow)
    other_cpu = [c for c in (_process_cores(o) for o in others) if c is not None]
    if slow_cpu is not None and other_cpu:
        evidence.append(
            Evidence(
                f"CPU used by rank {slow.rank} vs others",
                f"{round(slow_cpu * 100)} vs {round(statistics.median(other_cpu) * 100)}",
                "% of a core",
            )
        )
    busy = _node_busy(slow)
    others_busy = [b for b in (_node_busy(o) for o in others if o.ctx is not slow.ctx) if b]
    if busy is not None and others_busy and busy - statistics.median(others_busy) > 20:
        evidence.append(Evidence(f"CPU busy on {slow.node}", round(busy), "%"))
        reasons.append(f"{slow.node} is busier ({round(busy)} % CPU busy)")
    return evidence, "; ".join(reasons)


def _process_cores(rank: RankSeries) -> float | None:
    if rank.steady_span is None:
        return None
    t0, t1 = rank.steady_span
    values = [
        s["cpu_percent"] / 100
        for s in rank.ctx.samples_by_pid.get(rank.pid, [])
        if t0 <= s["t"] <= t1 and s["cpu_percent"] is not None
    ]
    return statistics.mean(values) if values else None


def _node_busy(rank: RankSeries) -> float | None:
    values = [s for _, s in rank.ctx.host_series("cpu_busy")]
    return statistics.mean(values) if values else None


def _fix(slow: RankSeries, part: str | None, context: str) -> str:
    r = slow.rank
    if context and "CPU(s)" in context:
        return (
            f"Give rank {r} the same CPUs as the others (check taskset/cgroup cpuset on "
            f"{slow.node}; torchdoctor launch gives each rank usable cores / local ranks)."
        )
    if part == "data_wait_s":
        return (
            f"Speed up rank {r}'s input on {slow.node}: more DataLoader workers there "
            "(num_workers), data on local fast storage, or check what else reads the disk."
        )
    if part == "outside_s":
        return (
            f"Move rank-{r}-only work out of the step (logging, evaluation, checkpointing on "
            "one rank): do it every N steps, asynchronously, or on every rank in parallel."
        )
    return (
        f"Find what slows {slow.node} for rank {r}: other processes on its CPUs/GPU "
        f"(`torchdoctor diagnose` of that node's recording, `torchdoctor top`), a throttling "
        "GPU, or an uneven share of work; otherwise leave that node out of the job."
    )
