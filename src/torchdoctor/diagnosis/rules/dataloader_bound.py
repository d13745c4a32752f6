"""dataloader-bound: steps wait on the DataLoader for a significant share of step time.

The fix is sized from what a batch really costs. With ``num_workers=0`` the main process loads
each batch itself, so the wait per step is the load time L of one batch; with n workers running
flat out a batch is ready every L/n, so L ~ n * (wait + compute). A worker runs one torch
thread: loading one batch costs it at most L of CPU time, however much CPU the trainer's
intra-op threads burned on the same small per-sample ops (parallel overhead, OpenMP spinning).
The step's CPU work is therefore the trainer's measured CPU time capped at L plus its compute
on its threads; measured worker CPU is used as it is. :func:`size_workers` then picks the
fewest workers that bring the step down to its floor: the compute time, or that CPU work spread
over the CPUs available (affinity capped by the cgroup quota, less what other programs take),
whichever is longer.

The step's compute was measured with the trainer's threads on the CPUs the loading left them.
When the workers' CPU and those threads no longer fit in the CPUs, the measured compute no
longer holds: the trainer gets the k CPUs left, and its compute is bounded by what one thread
can do at worst (the measured compute times its parallelism over k, no speed-up from its
threads at all). The prediction uses that bound, the trainer's thread count k is part of the
fix when below its threads (``torch.set_num_threads(k)`` / ``OMP_NUM_THREADS=k``), and a fix
whose bounded prediction is not faster is not printed (pytorch/examples' vae on 2 CPUs: one
worker predicted 1.3x faster from the unchanged compute, measured 16 % slower).

An attached job's steps seen by sampling can merge (:func:`torchdoctor.sampling.pystacks.
merging_note`): a seen step is then k steps' data waits with one sample of work, k about the
sampling period over the work. Load, compute and CPU per step all scale by about k, so their
ratios, and the workers sized from them, hold; the times themselves do not, and the finding
then gives the fix and its speed-up without a time per step.
"""

from __future__ import annotations

import math

from torchdoctor.diagnosis.context import MIN_EVIDENCE_S, DiagnosisContext
from torchdoctor.diagnosis.findings import Evidence, Finding
from torchdoctor.diagnosis.rules._common import (
    mean_cpu_cores,
    per_process_mean_cores,
    torch_threads,
    training_loader,
)
from torchdoctor.units import fmt_duration

ID = "dataloader-bound"
CRITICAL_SHARE = 0.5  # half of every step spent waiting for data


# When the job's own work fills its CPUs, a data wait below this share is reported as info.
NO_FIX_WARNING_SHARE = 0.25


def check(ctx: DiagnosisContext) -> list[Finding]:
    summary = ctx.step_summary
    if summary is None:
        return []
    share = summary.data_wait_fraction
    if share * 100 < ctx.thresholds.data_wait_alert_pct:
        return []
    if not _waits_are_typical(ctx, share):
        return []
    loader = training_loader(ctx)
    merged = ctx.steps_merge
    wait = summary.mean_data_wait_s
    compute = max(summary.mean_step_s - wait, 1e-6)
    t0, t1 = summary.t_start, summary.t_end
    current = loader["num_workers"] if loader else None

    idle = _idle_cpus(ctx, t0, t1)
    load_per_batch = current * (wait + compute) if current else wait
    worker_cores = per_process_mean_cores(ctx, ctx.worker_pids, t0, t1) if current else None
    job_cores = mean_cpu_cores(ctx, [*ctx.compute_pids, *ctx.worker_pids], t0, t1)
    threads = _trainer_threads(ctx)
    trainer_cores = per_process_mean_cores(ctx, ctx.compute_pids, t0, t1)
    # CPU time is what the job consumed, contention or not; the CPUs it can have are what it
    # used plus what sat idle (other processes take the rest).
    measured_cpu = (job_cores or 0.0) * summary.mean_step_s
    cpu_per_step = measured_cpu
    if not current:
        # The main process loads on its intra-op threads: a one-thread worker needs at most
        # the load's wall time of CPU; the trainer's threads may burn up to threads x compute.
        cpu_per_step = min(measured_cpu, load_per_batch + compute * (threads or 1))
    available = ctx.available_cores(t0, t1) or ctx.usable_cpus
    workers, predicted = size_workers(load_per_batch, compute, cpu_per_step, available)
    needed = max(1, math.ceil(load_per_batch / compute))
    # Loading in the main process costs at most its wall time and at most the CPU it used.
    load_cpu = min(load_per_batch, measured_cpu or load_per_batch) if not current else None
    trainer_cpu = trainer_cores * summary.mean_step_s if trainer_cores is not None else None
    fit_threads, bounded_compute = _threads_beside_workers(
        threads, workers, load_cpu, worker_cores, compute, trainer_cpu, predicted, available,
    )  # fmt: skip
    predicted = max(predicted, bounded_compute * 1.05)
    helps = predicted < 0.9 * summary.mean_step_s

    evidence = [
        Evidence("data wait share of step time", round(share * 100, 1), "%", t0, t1),
        Evidence("mean data wait per step", round(wait, 6), "s", t0, t1),
        Evidence("mean step time", round(summary.mean_step_s, 6), "s", t0, t1),
        Evidence("steady steps measured", summary.measured_steps, "steps", t0, t1),
        Evidence("usable CPUs", ctx.usable_cpus, "CPUs"),
    ]
    if loader is not None:
        evidence.append(Evidence("DataLoader num_workers", current or 0, "workers"))
    if worker_cores is not None:
        evidence.append(
            Evidence("CPU per loading worker", round(worker_cores * 100, 1), "% of a core", t0, t1)
        )
    if threads is not None:
        evidence.append(Evidence("trainer torch threads", threads, "threads"))
    if job_cores is not None:
        evidence.append(Evidence("job CPU time per step", round(measured_cpu, 6), "s", t0, t1))
        if cpu_per_step < measured_cpu - 1e-9:
            evidence.append(
                Evidence("CPU work per step with one-thread workers", round(cpu_per_step, 6), "s")
            )
        evidence.append(Evidence("CPUs available to the job", round(available, 2), "CPUs", t0, t1))
    if idle is not None:
        evidence.append(Evidence("idle CPUs while the job ran", round(idle, 1), "CPUs", t0, t1))

    severity = "critical" if share >= CRITICAL_SHARE else "warning"
    title = f"Steps wait {share * 100:.0f} % of their time for the DataLoader"
    settings: dict[str, object] = {}
    if loader is None:
        recommendation = (
            "Load the data with a torch.utils.data.DataLoader with num_workers="
            f"{workers} and persistent_workers=True so batches are prepared in parallel."
        )
        settings = {"num_workers": workers, "persistent_workers": True}
        expected = _expected(summary.mean_step_s, predicted, merged)
    elif workers > (current or 0) and helps:
        settings = {"num_workers": workers, "persistent_workers": True}
        bursty = summary.p90_data_wait_s > 4 * max(summary.median_data_wait_s, 1e-4)
        prefetch = 4 if bursty else (loader["prefetch_factor"] or 2)
        settings["prefetch_factor"] = prefetch
        if ctx.uses_gpu:
            settings["pin_memory"] = True
        args = ", ".join(f"{k}={v}" for k, v in settings.items())
        thread_text = ""
        if fit_threads is not None:
            settings["torch.num_threads"] = fit_threads
            settings["env.OMP_NUM_THREADS"] = str(fit_threads)
            thread_text = (
                f" With them, torch.set_num_threads({fit_threads}) in the training process "
                f"(or OMP_NUM_THREADS={fit_threads}): its {threads} intra-op threads and "
                f"{workers} busy workers would share {available:.1f} CPUs, and threads that "
                "wait for a preempted sibling at every parallel region waste the rest."
            )
        if bounded_compute > compute + 1e-9 and not merged:
            thread_text += (
                f" The prediction takes the compute at its bound beside the workers, "
                f"{fmt_duration(bounded_compute)} (measured {fmt_duration(compute)} with the "
                "CPUs to itself)."
            )
        idle_text = (
            f" and {idle:.1f} of {ctx.allowed_cpus:g} CPUs sit idle"
            if idle is not None and idle >= 1
            else ""
        )
        if merged:
            costs = (
                f"{share * 100:.0f} % of the job's time waits for data{idle_text}. Loading a"
                f" batch takes about {load_per_batch / compute:.0f}x the compute"
            )
            cpu_text = (
                f"the steps' CPU time must fit in the {available:.1f} CPUs available"
                f" ({ctx.cpu_limit_text})"
            )
        else:
            costs = (
                f"{share * 100:.0f} % of each step waits for data ({fmt_duration(wait)} of "
                f"{fmt_duration(summary.mean_step_s)}){idle_text}. Loading one batch takes "
                f"about {fmt_duration(load_per_batch)} against {fmt_duration(compute)} of compute"
            )
            cpu_text = (
                f"the step needs {fmt_duration(cpu_per_step)} of CPU time and {available:.1f}"
                f" CPUs are available ({ctx.cpu_limit_text})"
            )
        recommendation = (
            f"DataLoader({args}): {costs}"
            + (
                f", so {workers} workers keep ahead."
                if workers >= needed
                else f"; {needed} workers would keep ahead but {cpu_text}, so "
                + ("1 worker reaches" if workers == 1 else f"{workers} workers reach")
                + " that limit."
            )
            + thread_text
        )
        expected = _expected(summary.mean_step_s, predicted, merged)
    elif idle is not None and idle >= 1.0:
        times = "" if merged else f" ({fmt_duration(wait)} of {fmt_duration(summary.mean_step_s)})"
        recommendation = (
            f"{share * 100:.0f} % of each step waits for data{times}, but more workers would"
            " shorten the step by less "
            "than 10 %: the model's own compute sets the pace. Make each batch cheaper to "
            "produce (cache decoded samples, store the data set as tensors) if it matters."
        )
        expected = "Step time falls with the cost of producing a batch."
        predicted = None
    else:
        cpus = f"{available:.1f} of the {ctx.cpu_limit_text}"
        cost = (
            f"the steps' CPU time already fills the {cpus} available to the job"
            if merged
            else f"each step already costs {fmt_duration(cpu_per_step)} of CPU time and {cpus}"
            " are available to the job"
        )
        recommendation = (
            f"More workers would have no CPU to run on: {cost}. Make each batch cheaper to "
            "produce - cache decoded samples, store the data set as tensors/NumPy arrays, "
            "move augmentation to the GPU - or free CPUs that other programs take."
        )
        expected = "Step time falls with the cost of producing a batch."
        predicted = None
        if share < NO_FIX_WARNING_SHARE:
            # The job keeps its CPUs busy itself and the wait is modest: nothing to change,
            # and a warning would be a false alarm on a healthy job.
            severity = "info"
    details = (
        "Data wait is the time each step blocks in next() on the DataLoader iterator, measured "
        "inside the job; warm-up steps are left out."
    )
    if merged:
        details += f" The steps were seen by sampling the job's stack from outside: {merged}."
    elif predicted is not None and settings:
        evidence.append(Evidence("predicted step time after the fix", round(predicted, 6), "s"))
    return [
        Finding(
            id=ID,
            severity=severity,
            title=title,
            evidence=evidence,
            recommendation=recommendation,
            expected_effect=expected,
            confidence=0.9 if summary.measured_steps >= 20 and not merged else 0.7,
            settings=settings,
            details=details,
        )
    ]


def size_workers(
    load: float, compute: float, cpu_per_step: float, cpus: float
) -> tuple[int, float]:
    """(workers, predicted step time) for batches that take ``load`` seconds to produce in one
    worker and a step that computes for ``compute`` seconds, when one step costs
    ``cpu_per_step`` seconds of CPU time and ``cpus`` CPUs are available.

    A step can be no shorter than its compute, nor than its CPU time spread over the CPUs.
    With k workers a batch is ready every load/k. The fewest workers that reach the floor
    win; when compute is the floor, 20 % more keep the queue ahead of the jitter.
    """
    floor = max(compute, cpu_per_step / max(cpus, 0.1))
    if floor <= compute:
        workers = math.ceil(1.2 * load / compute - 1e-9)
    else:
        workers = math.ceil(load / floor - 1e-9)
    workers = max(1, min(workers, math.ceil(4 * cpus)))  # each worker holds a dataset copy
    return workers, max(floor, load / workers) * 1.05


def _trainer_threads(ctx: DiagnosisContext) -> int | None:
    """The most torch intra-op threads of a training process, when the job reported them."""
    found = [n for pid in ctx.compute_pids if (n := torch_threads(ctx, pid)) is not None]
    return max(found) if found else None


def _threads_beside_workers(
    threads: int | None,
    workers: int,
    load_cpu: float | None,
    worker_cores: float | None,
    compute: float,
    trainer_cpu: float | None,
    predicted: float,
    cpus: float,
) -> tuple[int | None, float]:
    """(the trainer's thread count that fits beside ``workers`` loading workers, or None when
    its threads can stay; the step's compute bounded by what was measured, beside them).

    The compute was measured with the trainer's parallelism p: its CPU per step less the
    loading's, over the compute time (at most its threads). While p and the workers' busy
    CPUs fit in ``cpus`` the measured compute stands. Otherwise the trainer gets the k CPUs
    the workers leave and, with k threads, computes in at most compute * p / k: no speed-up
    from its threads at all, the bound. k is the fix's thread count when below its threads.

    ``load_cpu`` is one batch's loading CPU work in a one-thread worker (main-process loading:
    at most its wall time and the CPU the trainer used), else ``worker_cores`` the measured
    use of one existing worker; ``trainer_cpu`` the training process's CPU time per step.
    """
    if load_cpu is not None:
        busy = min(load_cpu / max(predicted, 1e-9), float(workers))
    elif worker_cores is not None:
        busy = worker_cores * workers
    else:
        return None, compute
    if trainer_cpu is not None:
        parallel = max(trainer_cpu - (load_cpu or 0.0), 0.0) / max(compute, 1e-9)
        if threads is not None:
            parallel = min(parallel, float(threads))
    elif threads is not None:
        parallel = float(threads)
    else:
        return None, compute
    if parallel + busy <= cpus + 0.25:
        return None, compute
    fit = max(1, math.floor(cpus - busy + 1e-9))
    bounded = compute * max(1.0, parallel / fit)
    return (fit if threads is not None and fit < threads else None), bounded


def _expected(step: float, predicted: float, merged: str | None = None) -> str:
    predicted = min(predicted, step)
    speedup = step / predicted if predicted > 0 else 1.0
    if merged:  # the times are several steps' together: only their ratio holds
        return (
            f"About {speedup:.1f}x more steps per second while the loader keeps ahead of the model."
        )
    return (
        f"About {speedup:.1f}x more steps per second ({fmt_duration(step)} -> about "
        f"{fmt_duration(predicted)} per step) while the loader keeps ahead of the model."
    )


def _waits_are_typical(ctx: DiagnosisContext, share: float) -> bool:
    """Whether the data wait is the steps' pattern rather than a few stalls.

    Over MIN_EVIDENCE_S of steady steps the mean share stands. A shorter stretch has so few
    steps that a handful of long waits (a preempted load on a busy machine, an epoch's first
    batch) carry the mean: there the median step must wait beyond the alert share too, or the
    verdict is left for a longer recording and said so.
    """
    summary = ctx.step_summary
    t0, t1 = ctx.steady_window
    if t1 - t0 >= MIN_EVIDENCE_S:
        return True
    typical = (summary.median_data_wait_s or 0.0) / max(summary.median_step_s or 0.0, 1e-9)
    if typical * 100 >= ctx.thresholds.data_wait_alert_pct:
        return True
    ctx.not_judged["data loading"] = (
        f"{fmt_duration(max(t1 - t0, 0.0))} of steady steps waited {share:.0%} of their time "
        f"on data, but the median step only {typical:.0%} (a few long waits; a verdict from "
        f"so few steps needs the typical step to wait)"
    )
    return False


def _idle_cpus(ctx: DiagnosisContext, t0: float, t1: float) -> float | None:
    busy = [v for t, v in ctx.host_series("cpu_busy") if t0 <= t <= t1]
    if not busy:
        return None
    return max(ctx.allowed_cpus * (100 - sum(busy) / len(busy)) / 100, 0.0)
