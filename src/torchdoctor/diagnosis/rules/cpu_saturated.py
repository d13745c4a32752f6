"""cpu-saturated: the job keeps all its usable CPUs busy (the table's CPU load row).

For GPU training a saturated CPU is the bottleneck (the GPU waits for the host); for CPU
training it means the job already uses what it has, which is reported as information. When
the CPUs are saturated by other processes, the job is competing for them: that is reported
under its own id, ``cpu-contention``.
"""

from __future__ import annotations

import math

from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.diagnosis.findings import Evidence, Finding
from torchdoctor.diagnosis.rules._common import span_evidence, torch_threads
from torchdoctor.diagnosis.series import mean_in

ID = "cpu-saturated"
CONTENTION_ID = "cpu-contention"  # the CPUs are saturated by other processes, not the job


def check(ctx: DiagnosisContext) -> list[Finding]:
    limit = ctx.thresholds.cpu_load_alert_pct
    job_span = ctx.sustained(ctx.job_cpu_series, limit, what="CPU saturation")
    host_span = ctx.sustained(ctx.host_series("cpu_busy"), limit, what="CPU contention")
    if job_span is None and host_span is None:
        return []
    usable = ctx.usable_cpus
    summary = ctx.step_summary
    waits = (
        summary is not None
        and summary.data_wait_fraction * 100 >= ctx.thresholds.data_wait_alert_pct
    )
    if job_span is None:
        assert host_span is not None
        job_share = mean_in(ctx.job_cpu_series, host_span.t_start, host_span.t_end)
        if job_share is not None and job_share >= ctx.thresholds.cpu_load_best_pct:
            return []  # the job is the main user; below its own limit only by sampling noise
        others = host_span.mean - (job_share or 0.0) * usable / max(ctx.allowed_cpus, 1)
        recommendation = (
            "Stop or move the other CPU-heavy processes, or pin the job to CPUs of its own "
            "(taskset / cgroup cpuset); the job gets only what is left of "
            f"{ctx.cpu_limit_text}."
        )
        settings: dict[str, object] = {}
        available = ctx.available_cores(host_span.t_start, host_span.t_end)
        threads = [t for pid in ctx.compute_pids if (t := torch_threads(ctx, pid)) is not None]
        if available is not None and threads and not ctx.uses_gpu:
            fit = max(1, math.floor(available / len(threads) + 1e-9))
            # Only when the threads are twice what is left: with 2 threads and 1.1 CPUs left
            # the second thread still gained (the healthy case of advice_works: one thread
            # ran 0.91x as fast), while threads far beyond the CPUs lose at every barrier.
            if max(threads) >= 2 * available / len(threads) and max(threads) > fit:
                settings = {"torch.num_threads": fit, "env.OMP_NUM_THREADS": str(fit)}
                recommendation += (
                    f" Until then, torch.set_num_threads({fit}) matches the {available:.1f} "
                    f"CPUs left to the job (it runs {max(threads)} threads): threads of one "
                    "parallel region that wait for a preempted sibling waste the rest."
                )
        return [
            Finding(
                id=CONTENTION_ID,
                severity="warning",
                title=f"Other processes keep the CPUs {host_span.mean:.0f} % busy while the job runs",
                evidence=[
                    span_evidence("machine CPU busy", host_span, "%"),
                    Evidence("of which the job", round(job_share or 0.0, 1), "% of usable CPUs"),
                    Evidence("used by other processes", round(max(others, 0.0), 1), "%"),
                ],
                recommendation=recommendation,
                expected_effect="The job's steps stop waiting for CPU time taken by other programs.",
                confidence=0.7,
                settings=settings,
            )
        ]
    gpu = ctx.uses_gpu
    severity = "warning" if gpu or waits else "info"
    evidence = [
        span_evidence("job CPU use", job_span, "% of usable CPUs"),
        Evidence("usable CPUs", usable, "CPUs"),
        Evidence(
            "sustained for", round(job_span.duration, 1), "s", job_span.t_start, job_span.t_end
        ),
    ]
    if host_span is not None:
        evidence.append(span_evidence("machine CPU busy", host_span, "%"))
    if gpu:
        recommendation = (
            f"The GPU waits for a host that uses {job_span.mean:.0f} % of {ctx.cpu_limit_text}: "
            "move per-sample work off the CPU (decode once and cache, augment on the GPU), "
            "feed pre-processed tensors, or run on a machine with more CPUs per GPU."
        )
        expected = "The GPU gets batches as fast as it computes them."
    elif waits:
        recommendation = (
            f"Data loading and compute share {ctx.cpu_limit_text} at {job_span.mean:.0f} %: "
            "cheaper batches (cached, pre-decoded tensors) or more CPUs shorten the step."
        )
        expected = "Shorter data wait per step."
    else:
        recommendation = (
            f"The job trains on the CPU and keeps {ctx.cpu_limit_text} "
            f"{job_span.mean:.0f} % busy: it is compute-bound. Only more CPUs or a GPU make it "
            "faster; nothing in its settings is wasting CPU."
        )
        expected = "Nothing to fix; this is the expected state of CPU training."
    return [
        Finding(
            id=ID,
            severity=severity,
            title=f"The job keeps its {usable:g} CPUs {job_span.mean:.0f} % busy",
            evidence=evidence,
            recommendation=recommendation,
            expected_effect=expected,
            confidence=0.8 if job_span.samples >= 5 else 0.6,
            details=(
                f"CPU load above {ctx.thresholds.cpu_load_alert_pct:g} % of the usable CPUs, "
                f"sustained over {ctx.thresholds.sustained_s:g} s (or the whole job when shorter)."
            ),
        )
    ]
