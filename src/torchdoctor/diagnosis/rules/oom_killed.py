"""oom-killed: the kernel's OOM killer ended a process of the job.

The recorder counts the OOM kills in the job's memory cgroups while it ran and keeps the kernel
log lines naming the victim (``memory_end`` in the recording's metadata). This rule says which
process died, against which limit, what the job held at its last samples, and who grew on the
way there: DataLoader workers copying the data set's pages (copy-on-access: bounded, fewer or
lighter workers fix it) or the trainer itself (a leak: a larger limit only postpones it).
"""

from __future__ import annotations

from typing import Any

from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.diagnosis.findings import Evidence, Finding
from torchdoctor.sampling import roles
from torchdoctor.units import fmt_bytes, fmt_duration, fmt_mem_option

ID = "oom-killed"
HEADROOM = 1.5  # a new limit: what the job held at its end, and room to finish growing
LIMIT_FILL = 0.9  # plan workers to use this share of the limit, not all of it


def check(ctx: DiagnosisContext) -> list[Finding]:
    end = ctx.meta.get("memory_end") or {}
    victims = [v for v in end.get("victims") or [] if v["pid"] in ctx.samples_by_pid]
    killed_here = (end.get("oom_kills") or 0) > 0
    if not killed_here and not victims:
        return []
    cgroup = end.get("cgroup") or {}
    limit = cgroup.get("limit")
    held = _held(ctx)
    growth = _growth(ctx)
    workers = [pid for pid in growth if ctx.role_of(pid) == roles.WORKER]
    worker_growth = sum(growth[p] for p in workers)
    trainer_growth = sum(g for p, g in growth.items() if p not in workers)
    t1 = ctx.t_end
    evidence = [
        Evidence("killed", _victim_text(ctx, victims, end), ""),
        Evidence(
            "memory limit",
            f"{fmt_bytes(limit)} ({cgroup.get('limit_path')})" if limit else _machine_ram(ctx),
            "",
        ),
    ]
    if cgroup.get("current") is not None:
        evidence.append(Evidence("cgroup memory at the last reading", cgroup["current"], "B"))
    if held:
        evidence.append(Evidence("job's PSS at the last samples", sum(held.values()), "B", t1, t1))
        for pid, pss in sorted(held.items(), key=lambda kv: -kv[1])[:4]:
            evidence.append(Evidence(f"  {_who(ctx, pid)}", pss, "B", t1, t1))
    if workers:
        evidence.append(Evidence("DataLoader workers' private memory grew", worker_growth, "B"))
    evidence.append(Evidence("trainer's private memory grew", trainer_growth, "B"))
    for line in (end.get("kernel_log") or [])[-2:]:
        evidence.append(Evidence("kernel log", line.strip(), ""))

    base = max(cgroup.get("peak") or 0, cgroup.get("current") or 0, sum(held.values()))
    bigger = max(base, limit or 0) * HEADROOM
    limit_text = (
        f"a larger limit: sbatch --mem={fmt_mem_option(bigger, slurm=True)} or "
        f"torchdoctor submit --mem {fmt_mem_option(bigger, slurm=False)}"
    )
    settings: dict[str, Any] = {"mem_bytes": int(bigger)}
    # Growth names a cause only where it is a real part of what filled the limit: a trainer
    # that grew 11 MiB of a 400 MiB limit while its workers were read too seldom to show
    # their copies did not leak (seen on a busy CI machine).
    room = limit or sum(held.values())
    seen = max(UNSEEN_GROWTH_B, SEEN_SHARE * room)
    if workers and worker_growth > trainer_growth and worker_growth >= seen:
        cause = (
            f"{len(workers)} DataLoader workers copied {fmt_bytes(worker_growth)} of the data set"
        )
        per_worker = max(held.get(p, growth[p]) for p in workers)
        trainer_held = sum(v for p, v in held.items() if p not in workers)
        fit = int((LIMIT_FILL * limit - trainer_held) // per_worker) if limit and per_worker else 0
        fit = max(0, min(fit, len(workers) - 1))
        settings["num_workers"] = fit
        recommendation = (
            f"The workers, not the trainer, grew: each touches the data set's Python objects "
            f"(their reference counts) and so copies the pages it reads, up to one copy per "
            f"worker. Hold the samples in NumPy arrays or tensors (one buffer, no per-item "
            f"reference counts) so the pages stay shared, or use DataLoader(num_workers={fit}), "
            f"or {limit_text}."
        )
        expected = "Workers' memory stays shared with the trainer; the job stays under its limit."
    elif max(worker_growth, trainer_growth) < seen:
        # The kill came before any process was read growing by much (a fast fill on a busy
        # machine): naming the trainer's leak, or the workers, would be a guess.
        cause = "what filled the limit was not read growing before the kill"
        recommendation = (
            f"No process was sampled growing by {fmt_bytes(seen)} or more before the kill, so "
            "which one filled the limit is not known: record again with a shorter --interval, "
            "then look at the processes that held the most at the last samples (above). "
            "DataLoader workers that read a data set of Python objects copy it (keep samples "
            "in NumPy arrays or tensors); a trainer that keeps each step's tensors leaks; "
            f"{limit_text}."
        )
        expected = "The next recording shows which process grows; the job stays under its limit."
    else:
        rate = trainer_growth / max(ctx.duration, 1e-9)
        steps = ctx.step_count()
        per_step = f", {fmt_bytes(trainer_growth / steps)} per step" if steps else ""
        cause = f"the trainer's own memory grew {fmt_bytes(trainer_growth)}"
        recommendation = (
            f"The trainer grew {fmt_bytes(rate)}/s over {fmt_duration(ctx.duration)}{per_step} "
            "until the limit: something keeps what each step allocates (losses or outputs kept "
            "as tensors with their graphs: keep loss.item(); lists or caches that only grow; "
            "a data set loaded whole). Find it with tracemalloc snapshots a few steps apart; "
            f"{limit_text} only postpones a leak."
        )
        expected = "The trainer's memory stays flat from step to step."
    return [
        Finding(
            id=ID,
            severity="critical",
            title=f"The OOM killer ended {_victim_text(ctx, victims, end, short=True)}"
            + (f" at the {fmt_bytes(limit)} memory limit" if limit else "")
            + f": {cause}",
            evidence=evidence,
            recommendation=recommendation,
            expected_effect=expected,
            confidence=0.9 if victims else 0.7,
            settings=settings,
        )
    ]


def _held(ctx: DiagnosisContext) -> dict[int, int]:
    """PSS (else RSS) of each process at its last sample."""
    out = {}
    for pid, samples in ctx.samples_by_pid.items():
        if samples:
            last = samples[-1]
            value = last["pss"] if last["pss"] is not None else last["rss"]
            if value is not None:
                out[pid] = int(value)
    return out


# Below this much private growth, nothing was seen growing (a sample's noise)...
UNSEEN_GROWTH_B = 1 << 20
# ...nor below this share of the limit (or of what the job held): not what filled it.
SEEN_SHARE = 0.10


def _growth(ctx: DiagnosisContext) -> dict[int, int]:
    """Each process's private memory growth from its first reading to its last.

    A forked worker starts with next to nothing private, so its USS growth is what it copied.
    The trainer is measured from the first sample after the first worker started, or after
    its first DataLoader with workers was built (its own start-up, torch's import, its data
    set's build are no growth that matters); its RSS is read at every sample and a
    trainer's new memory shows in it, while a worker's copies do not (they replace pages
    already counted), so where USS has too few readings the trainer falls back to RSS.
    """
    by_pid = ctx.samples_by_pid
    starts = [by_pid[p][0]["t"] for p in by_pid if ctx.role_of(p) == roles.WORKER]
    # A DataLoader with workers was built after its data set: where the kill came before any
    # worker was sampled, the trainer is measured from there, its data set's build left out.
    starts += [d["t"] for d in ctx.dataloaders if d["num_workers"]]
    since = min(starts) if starts else None
    out: dict[int, int] = {}
    for pid, samples in by_pid.items():
        rows = [s for s in samples if since is None or s["t"] >= since]
        if len(rows) < 2:
            continue
        uss = [s["uss"] for s in rows if s["uss"] is not None]
        if ctx.role_of(pid) == roles.WORKER or len(set(uss)) >= 3:
            if len(uss) >= 2:
                out[pid] = max(0, int(uss[-1] - uss[0]))
            continue
        out[pid] = max(0, int(rows[-1]["rss"] - rows[0]["rss"]))
    return out


def _who(ctx: DiagnosisContext, pid: int) -> str:
    name = (ctx.processes.get(pid) or {}).get("name") or "process"
    return f"pid {pid} ({name}, {ctx.role_of(pid)})"


def _victim_text(ctx: DiagnosisContext, victims: list[dict], end: dict, short: bool = False) -> str:
    if victims:
        v = victims[-1]
        text = _who(ctx, v["pid"])
        if not short and v.get("anon_rss") is not None:
            text += f", {fmt_bytes(v['anon_rss'])} anonymous memory"
        return text
    root = ctx.meta.get("root_pid")
    if ctx.meta.get("exit_signal") == "SIGKILL" and root in ctx.samples_by_pid:
        return _who(ctx, root)
    why = end.get("kernel_log_unavailable")
    return "a process of the job" + (
        f" (the kernel log names it; unreadable: {why})" if why and not short else ""
    )


def _machine_ram(ctx: DiagnosisContext) -> str:
    total = ctx.host.get("mem_total")
    return f"none in the cgroup: the machine's {fmt_bytes(total)} of RAM ran out"
