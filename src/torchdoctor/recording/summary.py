"""The end-of-run summary: duration, and peak and mean of the main figures of a recording."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torchdoctor.recording.reader import Recording
from torchdoctor.sampling.types import usable_cpus_of


@dataclass(slots=True)
class Stat:
    mean: float | None
    peak: float | None

    @classmethod
    def of(cls, values: list[float | None]) -> Stat:
        vals = [v for v in values if v is not None]
        if not vals:
            return cls(None, None)
        return cls(sum(vals) / len(vals), max(vals))


@dataclass(slots=True)
class GpuSummary:
    index: int
    name: str | None
    utilization_gpu: Stat
    memory_used: Stat
    memory_total: int | None
    job_memory_peak: int | None  # peak of the job's processes' memory on this device


@dataclass(slots=True)
class RunSummary:
    path: str
    command: list[str]
    mode: str | None
    started_at: float | None
    ended_at: float | None
    duration_s: float | None
    exit_status: int | None
    complete: bool
    samples: int
    usable_cpus: float | None
    host_cpu_busy_pct: Stat
    host_iowait_pct: Stat
    host_mem_used: Stat
    host_swap_traffic: Stat  # swap in + out, bytes/s
    job_cpu_pct: Stat  # sum over the job's processes; 100 = one core
    job_rss: Stat
    job_pss: Stat
    job_threads: Stat
    job_processes: Stat
    roles: dict[str, int]  # distinct processes seen per role
    gpus: list[GpuSummary]
    gpu_unavailable: str | None
    steps: dict[str, Any] | None = None  # recording.steps.step_stats as a dict, when recorded
    # recording.steps.evaluation_stats as a dict: evaluation between steps, left out of steps
    evaluation: dict[str, Any] | None = None
    settings: dict[str, Any] = field(default_factory=dict)


def summarize(rec: Recording) -> RunSummary:
    meta = rec.meta
    host = rec.query(
        "SELECT cpu_busy, cpu_iowait, mem_used, swap_in_per_s, swap_out_per_s FROM host_samples"
    )
    job = rec.query(
        "SELECT t, SUM(cpu_percent) AS cpu, SUM(rss) AS rss, SUM(pss) AS pss,"
        " COUNT(pss) AS n_pss, SUM(threads) AS threads, COUNT(*) AS n"
        " FROM process_samples GROUP BY t ORDER BY t"
    )
    roles: dict[str, int] = {}
    for p in rec.processes():
        roles[p["role"]] = roles.get(p["role"], 0) + 1
    started, ended = rec.started_at, rec.ended_at
    host_info = meta.get("host") or {}
    return RunSummary(
        path=str(rec.path),
        command=list(meta.get("command") or []),
        mode=meta.get("mode"),
        started_at=started,
        ended_at=ended,
        duration_s=(ended - started) if started is not None and ended is not None else None,
        exit_status=meta.get("exit_status"),
        complete=rec.complete,
        samples=len(host) or len(job),
        usable_cpus=usable_cpus_of(host_info),
        host_cpu_busy_pct=Stat.of([r["cpu_busy"] for r in host]),
        host_iowait_pct=Stat.of([r["cpu_iowait"] for r in host]),
        host_mem_used=Stat.of([r["mem_used"] for r in host]),
        host_swap_traffic=Stat.of([_add(r["swap_in_per_s"], r["swap_out_per_s"]) for r in host]),
        job_cpu_pct=Stat.of([r["cpu"] for r in job]),
        job_rss=Stat.of([r["rss"] for r in job]),
        # A sum over a partial set of processes would understate the job: skip such samples.
        job_pss=Stat.of([r["pss"] if r["n_pss"] == r["n"] else None for r in job]),
        job_threads=Stat.of([r["threads"] for r in job]),
        job_processes=Stat.of([r["n"] for r in job]),
        roles=roles,
        gpus=_gpus(rec),
        gpu_unavailable=_gpu_unavailable(meta.get("gpus")),
        steps=_steps(rec),
        evaluation=_evaluation(rec),
        settings=_settings(rec),
    )


def _add(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a + b


def _gpu_unavailable(status: dict[str, Any] | None) -> str | None:
    if not status:
        return "GPUs were not read"
    if not status.get("available"):
        return status.get("reason") or "NVML unavailable"
    if not status.get("gpus"):
        return "NVML found no GPU"
    return None


def _gpus(rec: Recording) -> list[GpuSummary]:
    names = {g["index"]: g.get("name") for g in (rec.meta.get("gpus") or {}).get("gpus", [])}
    rows = rec.query(
        'SELECT "index" AS i, utilization_gpu AS u, memory_used AS m, memory_total AS total'
        " FROM gpu_samples ORDER BY t"
    )
    job_mem = rec.query(
        "SELECT gpu_index AS i, MAX(s) AS peak FROM (SELECT gpu_index, t, SUM(used_memory) AS s"
        " FROM gpu_process_samples WHERE in_job = 1 GROUP BY gpu_index, t) GROUP BY gpu_index"
    )
    job_peak = {r["i"]: r["peak"] for r in job_mem}
    out = []
    for index in sorted({r["i"] for r in rows}):
        mine = [r for r in rows if r["i"] == index]
        totals = [r["total"] for r in mine if r["total"] is not None]
        out.append(
            GpuSummary(
                index=index,
                name=names.get(index),
                utilization_gpu=Stat.of([r["u"] for r in mine]),
                memory_used=Stat.of([r["m"] for r in mine]),
                memory_total=totals[-1] if totals else None,
                job_memory_peak=job_peak.get(index),
            )
        )
    return out


def _steps(rec: Recording) -> dict[str, Any] | None:
    if rec.count("steps") == 0:
        return None
    try:
        from torchdoctor.recording.steps import step_stats
    except ImportError:
        return None
    import dataclasses

    stats = step_stats(rec.rows("steps"), rec.rows("dataloaders"), rec.rows("settings"))
    return dataclasses.asdict(stats) if dataclasses.is_dataclass(stats) else dict(stats)


def _evaluation(rec: Recording) -> dict[str, Any] | None:
    rows = rec.query("SELECT pid, kind, detail FROM events WHERE kind = 'evaluation'")
    if not rows:
        return None
    try:
        from torchdoctor.recording.steps import evaluation_stats
    except ImportError:
        return None
    stats = evaluation_stats(rows)
    return stats.to_dict() if stats is not None else None


def _settings(rec: Recording) -> dict[str, Any]:
    """The last value of each setting in the job's main process.

    DataLoader workers record their own settings (torch threads = 1); mixing them in would
    overwrite the trainer's values. The main process is the root, else the first trainer.
    """
    import json

    rows = rec.rows("settings")
    trainers = [p["pid"] for p in rec.processes() if p["role"] == "trainer"]
    main_pid = rec.meta.get("root_pid")
    pids_with_settings = {r["pid"] for r in rows}
    if main_pid not in pids_with_settings:
        main_pid = next((p for p in trainers if p in pids_with_settings), None)
    out: dict[str, Any] = {}
    for row in rows:
        if main_pid is not None and row["pid"] != main_pid:
            continue
        try:
            out[row["key"]] = json.loads(row["value"])
        except (TypeError, ValueError):
            out[row["key"]] = row["value"]
    return out
