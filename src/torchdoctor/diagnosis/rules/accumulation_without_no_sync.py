"""accumulation-without-no-sync: gradient accumulation under DDP all-reduces on every
micro-step instead of the last.

DDP all-reduces the gradients in every backward pass unless the forward ran under
``model.no_sync()``. With K micro-steps per optimizer step only the last all-reduce is needed.
The agent counts, per optimizer step, the forward passes under grad and those DDP prepared an
all-reduce for (``require_backward_grad_sync``): the ``ddp-sync-pattern`` events. The saving is
the all-reduce time DDP measured (``comm_s`` of the ranks' sampled steps) times the
all-reduces skipped, where the time of one is what a synchronised micro-step took beyond
its backward compute (the agent's backward time against DDP's backward compute time).
"""

from __future__ import annotations

import statistics

from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.diagnosis.findings import Evidence, Finding
from torchdoctor.diagnosis.ranks import ms

ID = "accumulation-without-no-sync"
SCOPE = "job"


def check(ctx: DiagnosisContext) -> list[Finding]:
    job = ctx.job
    if not job.distributed:
        return []
    patterns = {r.rank: r.first_event("ddp-sync-pattern") for r in job.ranks.values()}
    patterns = {
        r: p for r, p in patterns.items() if isinstance(p, dict) and p.get("accumulating_steps")
    }
    if not patterns:
        return []
    p = patterns[min(patterns)]
    steps = int(p["accumulating_steps"])
    micro = int(p.get("micro_steps") or 0) / steps
    synced = int(p.get("synced_micro_steps") or 0) / steps
    if synced <= 1.0:
        return []
    skipped = synced - 1.0  # all-reduces per optimizer step that no_sync() would leave out
    comm = _allreduce_times(job, micro)
    walls = [s["wall_s"] for r in job.ranks.values() for s in r.steady if s.get("wall_s")]
    evidence = [
        Evidence("forward/backward passes per optimizer step", round(micro, 2), "micro-steps"),
        Evidence("of which all-reduced", round(synced, 2), "micro-steps"),
        Evidence("optimizer steps that accumulated", steps, "steps"),
    ]
    settings: dict[str, object] = {"no_sync": True}
    if comm and min(comm) > 0:
        # The rank that waits least: the others' figures include waiting for it, which
        # no_sync() does not remove (communication-bound reads DDP's figures the same way).
        per_allreduce = min(comm)
        saving = skipped * per_allreduce
        evidence.append(
            Evidence("synchronisation per micro-step (rank waiting least)", ms(per_allreduce), "ms")
        )
        effect = (
            f"{skipped:g} all-reduce(s) fewer per optimizer step: about {ms(saving)} ms saved "
            f"per step (what a synchronised micro-step took beyond its backward compute, "
            f"{ms(per_allreduce)} ms, times {skipped:g})"
        )
        if walls:
            wall = statistics.median(walls)
            evidence.append(Evidence("step time (median)", ms(wall), "ms"))
            effect += f", {min(saving / wall, 1.0) * 100:.0f} % of the {ms(wall)} ms step"
        effect += "; the gradients are the same."
        settings["saving_s_per_step"] = round(saving, 6)
    else:
        effect = (
            f"{skipped:g} all-reduce(s) fewer per optimizer step, each of every gradient; "
            "the recording's DDP timing does not put a figure on it (no sampled step past "
            "DDP's warm-up, or no synchronisation time above its backward compute). The "
            "benchmark distributed_pitfalls.py measures the saving on 2 gloo ranks."
        )
    k = round(micro)
    return [
        Finding(
            id=ID,
            severity="warning",
            title=(
                f"Gradient accumulation all-reduces on every micro-step: {synced:g} all-reduces "
                f"per optimizer step where 1 is needed"
            ),
            evidence=evidence,
            recommendation=(
                "Skip DDP's all-reduce on all but the last micro-step: `ctx = model.no_sync() if "
                f"(i + 1) % {k} else contextlib.nullcontext()`, then `with ctx: "
                "loss = model(x); loss.backward()`; step the optimizer after the last one."
            ),
            expected_effect=effect,
            confidence=0.85,
            settings=settings,
        )
    ]


def _allreduce_times(job, micro: float) -> list[float]:
    """What synchronising one micro-step cost, per rank: on each step DDP sampled, the agent's
    backward time of one micro-step (the step's backward over its micro-steps, all
    synchronised) less DDP's backward compute time of one; the rank's median. That is the
    all-reduce, the wait for it and the reducer's copies: what no_sync() leaves out (DDP's
    comm_s alone misses the copies). DDP's median comm_s where a rank lacks the pair.

    DDP samples by its own iteration count, one per forward: with K micro-steps per optimizer
    step its sampled iterations (1-10) fall in the first few steps, so where that leaves none
    past the warm-up, every sampled step but each rank's first (the bucket rebuild)."""
    out = []
    for r in job.ranks.values():
        sampled = r.ddp_steps() or [s for s in r.steps if s.get("comm_s")][1:]
        pairs = [
            s["backward_s"] / micro - s["backward_compute_s"]
            for s in sampled
            if s.get("backward_s") and s.get("backward_compute_s") is not None and micro >= 1
        ]
        comm = [s["comm_s"] for s in sampled if s.get("comm_s")]
        if pairs:
            out.append(max(statistics.median(pairs), 0.0))
        elif comm:
            out.append(statistics.median(comm))
    return out
