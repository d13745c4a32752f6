"""thread-oversubscription: the job's compute threads outnumber the CPUs it may use, and the
CPUs show it (run queue above the CPU count, involuntary context switches, cgroup throttling).

Compute threads are what torch will run in parallel: ``torch.get_num_threads()`` of every
training process (from the settings the job reported) plus one per busy DataLoader worker
alive at the same time (workers run with one torch thread; workers restarted each epoch are
counted as they overlapped, not as the run's total). A thread count alone is not a finding: an
idle process with 32 threads harms nobody, so at least one sign of contention is required.

The thread count it advises is bounded by this run: never fewer than the CPUs each training
process's threads actually ran on (fewer would take away parallelism the job used, and make it
slower), and only when that is below the threads it has. Where no such count exists the
finding is a note without a fix.
"""

from __future__ import annotations

import math

from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.diagnosis.findings import Evidence, Finding
from torchdoctor.diagnosis.rules._common import (
    per_process_mean_cores,
    span_evidence,
    torch_threads,
    workers_at_once,
)
from torchdoctor.diagnosis.series import mean

ID = "thread-oversubscription"
RUN_QUEUE_FACTOR = 1.25  # runnable tasks above this many per usable CPU: contention
INVOLUNTARY_PER_THREAD_S = 50.0  # preemptions per compute thread and second: contention
THROTTLED_SHARE = 0.1  # share of wall time the cgroup was throttled
BUSY_WORKER_CORES = 0.2  # a worker using more than this share of a core computes
OTHERS_MIN_CPUS = 0.5  # less CPU taken by other processes (the recorder, a shell) costs no thread
# CPU use read as the next whole thread only above this much past a whole number (sampling noise)
USED_CPUS_SLACK = 0.05


def check(ctx: DiagnosisContext) -> list[Finding]:
    threads: dict[int, int] = {}
    for pid in ctx.compute_pids:
        n = torch_threads(ctx, pid)
        if n is None:
            n = _env_threads(ctx.setting("env.OMP_NUM_THREADS", pid))
        if n is not None:
            threads[pid] = n
    if not threads:
        return []  # without the torch thread setting the count would be a guess
    t0, t1 = ctx.busy_window
    busy_at_once, busy_in_all, worker_cores = workers_at_once(ctx, t0, t1, BUSY_WORKER_CORES)
    demand = sum(threads.values()) + busy_at_once
    usable = ctx.usable_cpus
    if demand <= usable:
        return []

    signals: list[str] = []
    evidence = [
        Evidence("compute threads in the job", demand, "threads"),
        Evidence("usable CPUs", usable, "CPUs"),
    ]
    for pid, n in threads.items():
        evidence.append(Evidence(f"torch threads of pid {pid} ({ctx.role_of(pid)})", n, "threads"))
    if busy_at_once:
        evidence.append(Evidence("busy DataLoader workers at once", busy_at_once, "processes"))
        if busy_in_all > busy_at_once:
            # Restarted each epoch (persistent_workers=False): many processes, few at a time.
            evidence.append(Evidence("busy DataLoader workers in all", busy_in_all, "processes"))

    run_queue = [(t, v) for t, v in ctx.host_series("procs_running") if t0 <= t <= t1]
    rq_span = ctx.sustained(run_queue, usable * RUN_QUEUE_FACTOR)
    if rq_span is not None:
        signals.append(f"{rq_span.mean:.1f} runnable tasks on {usable:g} CPUs")
        evidence.append(span_evidence("runnable tasks (run queue)", rq_span, "tasks"))
    invol = _involuntary_per_s(ctx, list(threads), t0, t1)
    if invol is not None:
        per_thread = invol / max(sum(threads.values()), 1)
        evidence.append(Evidence("involuntary context switches", round(invol), "/s", t0, t1))
        if per_thread > INVOLUNTARY_PER_THREAD_S:
            signals.append(f"{invol:.0f} involuntary context switches/s")
    throttled = ctx.host_series("cgroup_throttled_per_s")
    if throttled:
        share = mean([v for _, v in throttled]) or 0.0
        evidence.append(
            Evidence("time throttled by the cgroup CPU quota", round(share * 100, 1), "%")
        )
        if share > THROTTLED_SHARE:
            signals.append(f"throttled by the cgroup quota {share * 100:.0f} % of the time")
    if not signals:
        return []

    available = ctx.available_cores(t0, t1)
    others = usable - available if available is not None else 0.0
    free = usable - worker_cores - (others if others >= OTHERS_MIN_CPUS else 0.0)
    # The CPUs each training process's threads ran on, measured: a thread count below it would
    # cost the job parallelism it used (a compute-bound job with 2 threads on 2 CPUs and
    # workers beside it ran 7 % slower with 1), so the advice never goes below it.
    used = {pid: per_process_mean_cores(ctx, [pid], t0, t1) for pid in threads}
    used_most = max((c for c in used.values() if c is not None), default=None)
    if used_most is None:
        return []  # without the trainer's own CPU use no thread count is bounded
    kept = max(1, math.ceil(used_most - USED_CPUS_SLACK))
    per_process = max(1, math.floor(free / len(threads) + 1e-9), kept)
    for pid, cores in used.items():
        if cores is not None:
            evidence.append(
                Evidence(f"CPUs used by the threads of pid {pid}", round(cores, 2), "CPUs", t0, t1)
            )
    ratio = demand / usable
    current = ", ".join(sorted({str(n) for n in threads.values()}))
    title = f"{demand} compute threads compete for {usable:g} CPUs (torch threads = {current})"
    contention = f"{demand} compute threads share {usable:g} CPUs ({'; '.join(signals)})."
    if per_process >= min(threads.values()):
        # No count both below the threads it has and at or above the CPUs it used.
        return [
            Finding(
                id=ID,
                severity="info",
                title=title,
                evidence=evidence,
                recommendation=(
                    f"No thread count to advise from this run: {contention} But the training "
                    f"threads ran on {used_most:.1f} CPUs on average, which fewer than the "
                    f"{min(threads.values())} they have would not cover: fewer threads would "
                    "cost this job parallelism it used. `torchdoctor tune` times thread counts "
                    "with the real model."
                ),
                expected_effect="Nothing to apply: no change is predicted to help this job.",
                confidence=min(0.95, 0.6 + 0.15 * len(signals)),
            )
        ]
    severity = "critical" if ratio >= 4 else "warning"
    code = f"torch.set_num_threads({per_process})"
    recommendation = (
        f"{code} at the start of the script (or OMP_NUM_THREADS={per_process} in its "
        f"environment): {contention}"
    )
    if per_process == kept and kept > math.floor(free / len(threads) + 1e-9):
        recommendation += (
            f" {per_process} and not fewer: the threads ran on {used_most:.1f} CPUs on average."
        )
    if len(threads) > 1:
        recommendation += (
            f" That is {per_process} per training process for {len(threads)} processes."
        )
    if others >= OTHERS_MIN_CPUS:
        evidence.append(Evidence("CPU used by other processes", round(others, 1), "CPUs", t0, t1))
        recommendation += (
            f" Other processes take {others:.1f} CPUs, so {per_process} is what is left; "
            "OpenMP threads that wait for a preempted sibling at every barrier cost more than "
            "the parallelism gains."
        )
    if busy_at_once:
        at_once = "at once" if busy_in_all == busy_at_once else f"at once ({busy_in_all} in all)"
        recommendation += (
            f" {busy_at_once} busy DataLoader workers {at_once} use {worker_cores:.1f} CPUs "
            "of their own."
        )
    return [
        Finding(
            id=ID,
            severity=severity,
            title=title,
            evidence=evidence,
            recommendation=recommendation,
            expected_effect=(
                f"Not slower, by this run's figures: the training threads ran on "
                f"{used_most:.1f} CPUs on average and {per_process} threads cover that, so the "
                "job keeps the parallelism it had. It gains the time its threads lost waiting "
                "for preempted siblings, which one run cannot size (`torchdoctor tune` "
                "measures it), and other processes get CPU back."
            ),
            confidence=min(0.95, 0.6 + 0.15 * len(signals)),
            settings={"torch.num_threads": per_process, "env.OMP_NUM_THREADS": str(per_process)},
            details=(
                "Compute threads count torch.get_num_threads() of each training process and one "
                "thread per busy DataLoader worker alive at the same time; the limit is the CPU "
                "affinity capped by the cgroup CPU quota. The advised count is never below the "
                "CPUs the training threads were measured to use."
            ),
        )
    ]


def _env_threads(value: object) -> int | None:
    try:
        return int(str(value)) if value not in (None, "") else None
    except ValueError:
        return None


def _involuntary_per_s(
    ctx: DiagnosisContext, pids: list[int], t0: float, t1: float
) -> float | None:
    per_t: dict[float, float] = {}
    for pid in pids:
        for s in ctx.samples_by_pid.get(pid, []):
            if t0 <= s["t"] <= t1 and s["ctx_involuntary_per_s"] is not None:
                per_t[s["t"]] = per_t.get(s["t"], 0.0) + s["ctx_involuntary_per_s"]
    return mean(list(per_t.values()))
