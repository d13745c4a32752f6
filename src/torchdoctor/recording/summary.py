"""The end-of-run summary: duration, and peak and mean of the main figures of a recording."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torchdoctor.recording.compaction import META_THROUGH
from torchdoctor.recording.profiles import read_profiles, window_summary
from torchdoctor.recording.reader import Recording, damaged
from torchdoctor.recording.state import describe_state, missing_wal_hint
from torchdoctor.recording.steps import evaluation_stats
from torchdoctor.sampling.roles import TRAINER
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
    steps: dict[str, Any] | None = None  # Recording.step_stats() as a dict, when recorded
    # How an attached job's steps were seen ("sampled-stacks" / "none"), and why not.
    steps_source: str | None = None
    steps_source_reason: str | None = None
    steps_source_limit: str | None = None  # sampled steps that merge: a lower bound, and why
    # recording.steps.evaluation_stats as a dict: evaluation between steps, left out of steps
    evaluation: dict[str, Any] | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    # `attach` stopped by the user (Ctrl-C, TERM, HUP) while the job still ran: that signal
    stopped_by_signal: int | None = None
    # One line: complete, in progress (writer alive, last write N s ago) or cut short.
    state: str = ""
    recording_state: str = ""  # torchdoctor.recording.state: COMPLETE, IN_PROGRESS...
    state_hint: str | None = None  # a copy without its WAL: what it lacks, how to get it
    damage: list[str] = field(default_factory=list)  # what a damaged file lost, one line each
    # Processes whose in-job instrumentation switched itself off, and why (one line each):
    # their steps and settings stop there (Recording.instrumentation_off).
    instrumentation_off: list[str] = field(default_factory=list)
    # Shared memory, per sample summed over the job's processes: the /dev/shm space its files
    # take (each file once) and RssShmem (a page mapped by two processes counts twice). Both
    # None where the recording predates their sampling: "not measured".
    job_dev_shm: Stat = field(default_factory=lambda: Stat(None, None))
    job_rss_shmem: Stat = field(default_factory=lambda: Stat(None, None))
    # Profiler windows (run --profile-steps), one dict each (recording.profiles.window_summary):
    # where, state, its median step split into parts; [] for a recording without any.
    profiles: list[dict[str, Any]] = field(default_factory=list)


def summarize(rec: Recording) -> RunSummary:
    """The figures of a whole recording, aggregated by SQLite: memory stays flat however long
    the run (a week at 0.5 s is 1.2 million samples), nothing per sample is held here."""
    meta = rec.meta
    host_sql = (
        "SELECT COUNT(*) AS n, AVG(cpu_busy) AS cpu_mean, MAX(cpu_busy) AS cpu_peak,"
        " AVG(cpu_iowait) AS io_mean, MAX(cpu_iowait) AS io_peak,"
        " AVG(mem_used) AS mem_mean, MAX(mem_used) AS mem_peak,"
        " AVG(swap_in_per_s + swap_out_per_s) AS swap_mean,"
        " MAX(swap_in_per_s + swap_out_per_s) AS swap_peak FROM host_samples"
    )
    host = _uniform_means(rec, "host_samples", host_sql)
    # Per sample time, the job's sums over its processes; then mean and peak of those sums.
    # A PSS sum over a partial set of processes would understate the job: such samples skip.
    job_sql = (
        "SELECT COUNT(*) AS n, AVG(cpu) AS cpu_mean, MAX(cpu) AS cpu_peak,"
        " AVG(rss) AS rss_mean, MAX(rss) AS rss_peak,"
        " AVG(CASE WHEN n_pss = n THEN pss END) AS pss_mean,"
        " MAX(CASE WHEN n_pss = n THEN pss END) AS pss_peak,"
        " AVG(threads) AS threads_mean, MAX(threads) AS threads_peak,"
        " AVG(n) AS n_mean, MAX(n) AS n_peak"
        " FROM (SELECT t, SUM(cpu_percent) AS cpu, SUM(rss) AS rss, SUM(pss) AS pss,"
        " COUNT(pss) AS n_pss, SUM(threads) AS threads, COUNT(*) AS n"
        " FROM process_samples GROUP BY t)"
    )
    job = _uniform_means(rec, "process_samples", job_sql)
    shm = _shared_memory(rec)
    # SQLite's AVG and MAX of a column holding text or a blob (an edited file) give text:
    # it would fail only where a figure is printed, after the recording is closed.
    for name, value in [*host.items(), *job.items()]:
        if value is not None and not isinstance(value, (int, float)):
            raise damaged(rec.path, f"the samples' {name} is {str(value)[:40]!r}, not a number")
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
        samples=(host["n"] or job["n"]) + _folded_samples(rec),
        usable_cpus=usable_cpus_of(host_info),
        host_cpu_busy_pct=_stat(host, "cpu"),
        host_iowait_pct=_stat(host, "io"),
        host_mem_used=_stat(host, "mem"),
        host_swap_traffic=_stat(host, "swap"),
        job_cpu_pct=_stat(job, "cpu"),
        job_rss=_with_folded_peak(rec, _stat(job, "rss")),
        job_pss=_stat(job, "pss"),
        job_threads=_stat(job, "threads"),
        job_processes=_stat(job, "n"),
        roles=roles,
        gpus=_gpus(rec),
        gpu_unavailable=_gpu_unavailable(meta.get("gpus")),
        steps=_steps(rec),
        steps_source=meta.get("steps_source"),
        steps_source_reason=meta.get("steps_source_reason"),
        steps_source_limit=meta.get("steps_source_limit"),
        evaluation=_evaluation(rec),
        settings=_settings(rec),
        stopped_by_signal=meta.get("stopped_by_signal"),
        state=describe_state(rec.state, rec.path, hint=False),
        state_hint=missing_wal_hint(rec.path, rec.state.checkpoint_every_s)
        if rec.state.wal_missing
        else None,
        recording_state=rec.state.kind,
        damage=list(rec.damage),
        instrumentation_off=rec.instrumentation_off(),
        job_dev_shm=_with_folded_peak(rec, _stat(shm, "dev_shm"), "dev_shm"),
        job_rss_shmem=_with_folded_peak(rec, _stat(shm, "shmem"), "shmem"),
        profiles=[window_summary(w) for w in read_profiles(rec)],
    )


def _shared_memory(rec: Recording) -> dict[str, Any]:
    """Mean and peak of the job's shared memory per sample; None in a recording made before
    it was sampled (its process_samples has no such columns)."""
    if not {"dev_shm", "shmem"} <= rec.stored_columns("process_samples"):
        return dict.fromkeys(("dev_shm_mean", "dev_shm_peak", "shmem_mean", "shmem_peak"))
    # A sample whose processes were not all read counts no sum (as PSS): it would understate.
    (row,) = rec.query(
        "SELECT AVG(CASE WHEN n_shm = n THEN dev_shm END) AS dev_shm_mean,"
        " MAX(CASE WHEN n_shm = n THEN dev_shm END) AS dev_shm_peak,"
        " AVG(shmem) AS shmem_mean, MAX(shmem) AS shmem_peak"
        " FROM (SELECT t, SUM(dev_shm) AS dev_shm, COUNT(dev_shm) AS n_shm,"
        " SUM(shmem) AS shmem, COUNT(*) AS n FROM process_samples GROUP BY t)"
    )
    return row


def _uniform_means(rec: Recording, table: str, sql: str) -> dict[str, Any]:
    """The row of ``sql`` over ``table``; where the writer folded older samples
    (recording.compaction) its means are taken at one instant a bucket throughout, the
    instants the folded rows stand at: read row by row, the minutes kept whole would
    outweigh the folded days. Counts and peaks stay those of every row."""
    (row,) = rec.query(sql)
    policy, start = rec.compaction, rec.started_at
    if policy is None or start is None or not rec.meta.get(META_THROUGH):
        return row
    instants = rec.bucket_instants(table, start, policy.bucket_s)
    if not instants.condition:
        return row
    where = f"FROM {table} WHERE {instants.condition}"
    (uniform,) = rec.query(sql.replace(f"FROM {table}", where, 1), instants.params)
    return {**row, **{k: v for k, v in uniform.items() if k.endswith("_mean")}}


def _folded_samples(rec: Recording) -> int:
    """Samples the writer folded away (recording.compaction): counted as taken, not as the
    rows they left (one a minute)."""
    if rec.compaction is None:
        return 0
    (row,) = rec.query("SELECT COALESCE(SUM(n) - SUM(kept), 0) AS extra FROM host_sample_summaries")
    return int(row["extra"] or 0)


def _with_folded_peak(rec: Recording, stat: Stat, column: str = "rss") -> Stat:
    """The job's peak of a per-process ``column`` (RSS, shared memory), the folded minutes
    included: their rows hold means, their summaries each process's peak per period; the sum
    of those is never below the job's true peak in the period (the sizing of a hand-off must
    not come out short). A recording folded before the column's peak was kept has only the
    means."""
    name = f"{column}_max"
    if rec.compaction is None:
        return stat
    if not _has_columns(rec, "process_sample_summaries", (name,)):
        return stat
    (row,) = rec.query(
        f"SELECT MAX(s) AS peak FROM (SELECT SUM({name}) AS s FROM process_sample_summaries"
        " GROUP BY period)"
    )
    peak = row["peak"]
    if peak is None or (stat.peak is not None and stat.peak >= peak):
        return stat
    return Stat(stat.mean, peak)


def _stat(row: dict[str, Any], prefix: str) -> Stat:
    return Stat(row[f"{prefix}_mean"], row[f"{prefix}_peak"])


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
        'SELECT "index" AS i, AVG(utilization_gpu) AS u_mean, MAX(utilization_gpu) AS u_peak,'
        " AVG(memory_used) AS m_mean, MAX(memory_used) AS m_peak,"
        # the last total reported (a bare column beside MAX() comes from the row of the max)
        ' (SELECT g2.memory_total FROM gpu_samples g2 WHERE g2."index" = g."index"'
        " AND g2.memory_total IS NOT NULL ORDER BY g2.t DESC LIMIT 1) AS total"
        ' FROM gpu_samples g GROUP BY "index" ORDER BY "index"'
    )
    job_mem = rec.query(
        "SELECT gpu_index AS i, MAX(s) AS peak FROM (SELECT gpu_index, t, SUM(used_memory) AS s"
        " FROM gpu_process_samples WHERE in_job = 1 GROUP BY gpu_index, t) GROUP BY gpu_index"
    )
    job_peak = {r["i"]: r["peak"] for r in job_mem}
    # Where samples were folded their rows hold means; the summaries keep the peaks.
    device_peak: dict[int, tuple[Any, Any]] = {}
    if rec.compaction is not None:
        for r in rec.query(
            'SELECT "index" AS i, MAX(utilization_gpu_max) AS u, MAX(memory_used_max) AS m'
            ' FROM gpu_sample_summaries GROUP BY "index"'
        ):
            device_peak[r["i"]] = (r["u"], r["m"])
        if _has_columns(rec, "gpu_process_sample_summaries", ("used_memory_max", "in_job")):
            for r in rec.query(
                "SELECT gpu_index AS i, MAX(s) AS peak FROM (SELECT gpu_index, period,"
                " SUM(used_memory_max) AS s FROM gpu_process_sample_summaries WHERE in_job = 1"
                " GROUP BY gpu_index, period) GROUP BY gpu_index"
            ):
                job_peak[r["i"]] = _higher(job_peak.get(r["i"]), r["peak"])
    out = []
    for r in rows:
        u_folded, m_folded = device_peak.get(r["i"], (None, None))
        out.append(
            GpuSummary(
                index=r["i"],
                name=names.get(r["i"]),
                utilization_gpu=Stat(r["u_mean"], _higher(r["u_peak"], u_folded)),
                memory_used=Stat(r["m_mean"], _higher(r["m_peak"], m_folded)),
                memory_total=r["total"],
                job_memory_peak=job_peak.get(r["i"]),
            )
        )
    return out


def _higher(a: Any, b: Any) -> Any:
    """The higher of two peaks, either of which may be unknown (None)."""
    return b if a is None else a if b is None else max(a, b)


def _has_columns(rec: Recording, table: str, names: tuple[str, ...]) -> bool:
    """``table`` (a summary table, which the reader's schema does not list) exists in this
    file with ``names`` among its columns: one folded by an older writer may lack them."""
    kept = {r["name"] for r in rec.query(f"SELECT name FROM pragma_table_info('{table}')")}
    return set(names) <= kept


def _steps(rec: Recording) -> dict[str, Any] | None:
    stats = rec.step_stats()
    return stats.to_dict() if stats is not None else None


def _evaluation(rec: Recording) -> dict[str, Any] | None:
    rows = rec.query("SELECT pid, kind, detail FROM events WHERE kind = 'evaluation'")
    if not rows:
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
    trainers = [p["pid"] for p in rec.processes() if p["role"] == TRAINER]
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
