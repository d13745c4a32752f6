"""What every rule needs from a recording, computed once: the job window, the job's processes,
per-time aggregates, step statistics, DataLoader configurations, settings and GPU series.

Rules read from a :class:`DiagnosisContext`; each figure is computed lazily on first use, so a
recording without GPUs or without steps costs nothing for the rules that stay silent.
"""

from __future__ import annotations

import math
from collections import defaultdict
from functools import cached_property
from typing import Any

from torchdoctor.diagnosis.findings import Finding
from torchdoctor.diagnosis.ranks import RankJob, RankSteps, compared_share
from torchdoctor.diagnosis.series import Span, nearest, sustained_span
from torchdoctor.recording.compaction import META_THROUGH
from torchdoctor.recording.frame import SampleFrame
from torchdoctor.recording.profiles import WindowProfile, read_profiles
from torchdoctor.recording.reader import Recording
from torchdoctor.recording.steps import (
    FoldedSteps,
    ProcessSteps,
    StepStats,
    decode_json,
    measured_steps,
    warmup_steps,
)
from torchdoctor.sampling import roles
from torchdoctor.sampling.types import usable_cpus
from torchdoctor.thresholds import Thresholds
from torchdoctor.units import fmt_duration

# Evidence a verdict on a condition over time (saturation, contention, throttling, a trend)
# needs: this much of the run's steady part, sampled this many times. A shorter run, or a
# recording cut short, is not judged: the rules say so instead (rule short_recording).
MIN_EVIDENCE_S = 3.0
MIN_EVIDENCE_SAMPLES = 6
MIN_STEADY_STEPS = 3  # steady steps the step figures of a verdict rest on
# Without steps, the run's start-up (imports, data set loading) is left out: this share of it,
# at most STARTUP_MAX_S.
STARTUP_SHARE = 0.2
STARTUP_MAX_S = 10.0
# The resolution the rules read samples at: every one up to this many sampling instants (6 h
# at the default 0.5 s), past that this many spread over the run (a week: one per 14 s). The
# rules judge minutes-long conditions and trends, which that resolution keeps; the memory and
# time of a diagnosis then stop growing with the recording's length (a week of a 20-process
# job would otherwise be 24 million rows).
MAX_INSTANTS = 43_200
# The step rules that read rows (CUDA memory per step, autocast, batch sizes) read the job's
# last this many steps: their figures are medians of the settled steps, which the last few
# thousand tell as well as a week of them, and reading every row of a long GPU job would make
# a diagnosis's memory grow with the recording.
RECENT_STEPS = 4096


class JobContext:
    """The job recordings belong to: every node's context, and the ranks of all of them,
    gathered once, when a rule first asks. One recording alone is a job of one node."""

    def __init__(self) -> None:
        self.contexts: list[DiagnosisContext] = []

    @cached_property
    def ranks(self) -> RankJob:
        return RankJob.from_contexts(self.contexts)

    @cached_property
    def compared_share(self) -> float:
        """The share of step numbers the rank rules compare step by step (diagnosis.ranks)."""
        return compared_share(self.contexts)


class DiagnosisContext:
    """Read-only view of one recording, shaped for the rules."""

    def __init__(
        self, recording: Recording, thresholds: Thresholds, job: JobContext | None = None
    ) -> None:
        """``job``: the job this recording is one node of (the engine diagnoses several
        nodes' recordings as one job); by default a job of this recording alone."""
        self.recording = recording
        self.job_context = job if job is not None else JobContext()
        self.job_context.contexts.append(self)
        self.thresholds = thresholds
        self.meta: dict[str, Any] = recording.meta
        self.findings: list[Finding] = []  # filled by the engine; read by AFTER_OTHERS rules
        # What a rule could not judge for want of evidence: what -> why (rule short_recording).
        self.not_judged: dict[str, str] = {}

    # -- the machine --------------------------------------------------------------------
    @cached_property
    def host(self) -> dict[str, Any]:
        return self.meta.get("host") or {}

    @cached_property
    def allowed_cpus(self) -> int:
        allowed = self.host.get("allowed_cpus") or []
        return len(allowed) or int(self.host.get("logical_cpus") or 1)

    @cached_property
    def usable_cpus(self) -> float:
        """CPUs the job can really use: its affinity, capped by a cgroup CPU quota."""
        return usable_cpus(self.allowed_cpus, self.host.get("cgroup_cpu_quota"), None)

    @cached_property
    def cpu_limit_text(self) -> str:
        quota = self.host.get("cgroup_cpu_quota")
        if quota and float(quota) < self.allowed_cpus:
            return f"{_num(float(quota))} CPUs of cgroup quota ({self.allowed_cpus} CPUs allowed)"
        return f"{self.allowed_cpus} allowed CPUs"

    @cached_property
    def gpu_status(self) -> dict[str, Any]:
        return self.meta.get("gpus") or {}

    @cached_property
    def gpu_infos(self) -> dict[int, dict[str, Any]]:
        if not self.gpu_status.get("available"):
            return {}
        return {int(g["index"]): g for g in self.gpu_status.get("gpus") or []}

    # -- the job's time window ----------------------------------------------------------
    @cached_property
    def t_start(self) -> float:
        start = self.meta.get("started_at")
        if start is None:
            firsts = [
                self.recording.query(f"SELECT MIN(t) AS t FROM {table}")[0]["t"]
                for table in ("host_samples", "process_samples")
            ]
            start = next((t for t in firsts if t is not None), 0.0)
        return float(start)

    @cached_property
    def t_end(self) -> float:
        end = self.recording.ended_at
        if end is None:
            end = self.t_start
        return float(end)

    @property
    def duration(self) -> float:
        return max(self.t_end - self.t_start, 0.0)

    # -- host series --------------------------------------------------------------------
    @cached_property
    def host_samples(self) -> SampleFrame:
        """Host samples taken while the job ran (columns read as the rules ask for them)."""
        return self._frame("host_samples", self.t_start - 1e-6, self.t_end + 1e-6)

    def _frame(self, table: str, t_from: float | None = None, t_to: float | None = None):
        """A sample table read at a bounded resolution. Where the writer folded older
        samples into one row per bucket, every part of the run is read at that one
        resolution, at the instants the folded rows stand at: the rules count shares of
        samples, and the recent minutes kept whole would otherwise outweigh the folded days."""
        rec = self.recording
        policy = rec.compaction
        if policy is None or not rec.meta.get(META_THROUGH):
            return rec.frame(table, t_from, t_to, max_instants=MAX_INSTANTS)
        # whole buckets per slice, so that a month still reads at most MAX_INSTANTS
        every = policy.bucket_s * max(1, math.ceil(self.duration / policy.bucket_s / MAX_INSTANTS))
        instants = rec.bucket_instants(table, self.t_start, every)
        return rec.frame(table, t_from, t_to, instants=instants)

    def host_series(self, column: str) -> list[tuple[float, float]]:
        return self.host_samples.series(column)

    # -- the job's processes ------------------------------------------------------------
    @cached_property
    def processes(self) -> dict[int, dict[str, Any]]:
        """Each process of the job by pid (the latest one when a pid was reused)."""
        return {p["pid"]: p for p in self.recording.processes()}

    @cached_property
    def process_samples(self) -> SampleFrame:
        return self._frame("process_samples")

    @cached_property
    def samples_by_pid(self) -> dict[int, SampleFrame]:
        return self.process_samples.group_by("pid")

    def role_of(self, pid: int) -> str:
        info = self.processes.get(pid)
        if info is not None:
            return info["role"]
        samples = self.samples_by_pid.get(pid)
        return samples[-1]["role"] if samples else "other"

    @cached_property
    def compute_pids(self) -> list[int]:
        """Processes that run the model: trainers and ranks, plus any process that recorded steps."""
        pids = {pid for pid in self.samples_by_pid if self.role_of(pid) in roles.COMPUTE}
        pids |= set(self.step_rows)
        pids |= {p for p, info in self.processes.items() if info["role"] in roles.COMPUTE}
        return sorted(pids)

    @cached_property
    def worker_pids(self) -> list[int]:
        return sorted(pid for pid in self.samples_by_pid if self.role_of(pid) == roles.WORKER)

    @cached_property
    def job_cores_series(self) -> list[tuple[float, float]]:
        """CPUs' worth of time used by the whole job at each sample (1.0 = one core)."""
        by_t: dict[float, float] = {}
        samples = self.process_samples
        for t, cpu in zip(samples.values("t"), samples.values("cpu_percent"), strict=True):
            if cpu is not None:
                by_t[t] = by_t.get(t, 0.0) + cpu / 100
        return sorted(by_t.items())

    @cached_property
    def job_cpu_series(self) -> list[tuple[float, float]]:
        """CPU used by the whole job at each sample, in percent of the usable CPUs."""
        return [(t, v * 100 / self.usable_cpus) for t, v in self.job_cores_series]

    def available_cores(self, t0: float, t1: float) -> float | None:
        """CPUs the job could have had between t0 and t1: what it used plus what sat idle,
        capped by the usable CPUs. Below the usable count when other processes compete."""
        job = self.job_cores_series
        values = []
        host = self.host_samples
        for t, busy in zip(host.values("t"), host.values("cpu_busy"), strict=True):
            if not (t0 <= t <= t1) or busy is None:
                continue
            cores = nearest(job, t, tolerance=0.05)
            if cores is not None:
                idle = max(100.0 - busy, 0.0) / 100 * self.allowed_cpus
                values.append(min(cores + idle, self.usable_cpus))
        return sum(values) / len(values) if values else None

    @cached_property
    def steady_window(self) -> tuple[float, float]:
        """The run's steady part: from the first steady step to the last step when the job
        stepped, else the run without its start-up."""
        summary = self.step_summary
        if summary is not None and summary.t_end > summary.t_start:
            return summary.t_start, summary.t_end
        startup = min(STARTUP_SHARE * self.duration, STARTUP_MAX_S)
        return self.t_start + startup, self.t_end

    def enough_evidence(self, series: list[tuple[float, float]], what: str | None) -> bool:
        """Whether ``series`` (already cut to the steady window) can carry a verdict; when
        not, ``what`` (if given) is noted in :attr:`not_judged`."""
        t0, t1 = self.steady_window
        span = t1 - t0
        if span >= MIN_EVIDENCE_S and len(series) >= MIN_EVIDENCE_SAMPLES:
            return True
        if what:
            self.not_judged[what] = (
                f"{fmt_duration(max(span, 0.0))} of steady running and {len(series)} samples "
                f"(a verdict needs {MIN_EVIDENCE_S:g} s and {MIN_EVIDENCE_SAMPLES})"
            )
        return False

    def steady(self, series: list[tuple[float, float]]) -> list[tuple[float, float]]:
        """The points of ``series`` inside the steady window."""
        t0, t1 = self.steady_window
        return [(t, v) for t, v in series if t0 - 1e-6 <= t <= t1 + 1e-6]

    @property
    def busy_window(self) -> tuple[float, float]:
        """The steady steps' time span when the job stepped, else the whole job."""
        summary = self.step_summary
        if summary is not None and summary.t_end > summary.t_start:
            return summary.t_start, summary.t_end
        return self.t_start, self.t_end

    # -- steps --------------------------------------------------------------------------
    @cached_property
    def steps(self) -> SampleFrame:
        """The step rows; where the writer folded steps (recording.compaction), an evenly
        spread few of each process's steps per bucket: what counts or sums every step takes
        :meth:`step_count` and :meth:`folded` too."""
        return self.recording.frame("steps")

    def folded(self, pid: int) -> FoldedSteps:
        """The steps of ``pid`` whose rows were folded (none where all were kept)."""
        return self.recording.folded_steps.get(pid) or FoldedSteps()

    def step_count(self, pid: int | None = None) -> int:
        """Steps ``pid`` took (every process's when None), folded ones included."""
        rows = sum(self.step_rows.values()) if pid is None else self.step_rows.get(pid, 0)
        folded = self.recording.folded_steps
        return rows + sum(f.count for p, f in folded.items() if pid is None or p == pid)

    def step_progress(self, pid: int) -> tuple[list[float], list[int]]:
        """(times, steps ``pid`` had ended by each): its step ends in order, the folded
        steps of a bucket counted at the bucket's last folded end (a minute's resolution
        there). For growth or rates per step over the run, without a value per step."""
        rows = sorted(self.recording.step_ends(pid))
        spans = sorted((t_to, n) for _, t_to, n in self.folded(pid).spans)
        times: list[float] = []
        done: list[int] = []
        total = j = 0
        # the two merged in time order, a row before a bucket that ends with it
        for t in rows:
            while j < len(spans) and spans[j][0] < t:
                total += spans[j][1]
                times.append(spans[j][0])
                done.append(total)
                j += 1
            total += 1
            times.append(t)
            done.append(total)
        for t, n in spans[j:]:
            total += n
            times.append(t)
            done.append(total)
        return times, done

    @cached_property
    def step_rows(self) -> dict[int, int]:
        """Step rows per pid that stepped (SQL counts them: no row is read)."""
        rows = self.recording.query("SELECT pid, COUNT(*) AS n FROM steps GROUP BY pid")
        return {r["pid"]: r["n"] for r in rows}

    @cached_property
    def step_autocast_dtypes(self) -> set[str | None]:
        """The autocast dtypes the step rows name (None: a step without autocast)."""
        rows = self.recording.query("SELECT DISTINCT autocast_dtype AS d FROM steps")
        return {r["d"] for r in rows}

    @cached_property
    def recent_steps(self) -> list[dict[str, Any]]:
        """The job's last RECENT_STEPS step rows, in the order they ended."""
        return self.recording.last_rows("steps", "t_end", RECENT_STEPS)

    @cached_property
    def steady_steps(self) -> list[dict[str, Any]]:
        """Of :attr:`recent_steps`, those past each process's warm-up and outside profiler
        windows (the rule ``show`` and ``tune`` use too), in the order they ended."""
        by_pid: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for s in self.recent_steps:
            by_pid[s["pid"]].append(s)
        out: list[dict[str, Any]] = []
        for pid, rows in by_pid.items():
            rows.sort(key=lambda r: r["step"])
            count = self.step_rows.get(pid, len(rows)) + self.folded(pid).count
            # The warm-up is a process's first rows by step: the last of them, read by SQL
            # where the recent rows do not reach back to it.
            warm = warmup_steps(count)
            first = self.step_rows.get(pid, len(rows)) - len(rows)
            if first == 0:
                out.extend(measured_steps(rows, count))
                continue
            last_warm = None
            if warm > 0:
                found = self.recording.query(
                    "SELECT step FROM steps WHERE pid = ? ORDER BY step LIMIT 1 OFFSET ?",
                    (pid, warm - 1),
                )
                last_warm = found[0]["step"] if found else None
            out.extend(
                r
                for r in rows
                if not r.get("profiled") and (last_warm is None or r["step"] > last_warm)
            )
        out.sort(key=lambda r: r["t_end"])
        return out

    @property
    def steps_merge(self) -> str | None:
        """Why the steps are several merged (an attach whose samples cannot resolve them), or
        None: their count and times are then lower bounds, their data-wait share holds."""
        return self.meta.get("steps_source_limit")

    @cached_property
    def step_summary(self) -> StepStats | None:
        """The recording's step summary (the one ``show`` prints); None when fewer than
        ``MIN_STEADY_STEPS`` steady steps carry it, too few for a verdict on steps."""
        return self.verdict_ready(self._step_pass[0])

    @cached_property
    def _step_pass(self) -> tuple[StepStats | None, dict[int, tuple[int | None, RankSteps]]]:
        """The step summary and each process's rank figures, from one read of the steps
        (one process at a time): (StepStats, pid -> (its first rank, RankSteps))."""
        share = self.job_context.compared_share
        ranks: dict[int, tuple[int | None, RankSteps]] = {}

        def rank_figures(proc: ProcessSteps) -> None:
            ranks[proc.pid] = (proc.first_rank(), RankSteps.of(proc, share))

        return self.recording.step_stats(each=rank_figures), ranks

    def rank_steps(self) -> dict[int, tuple[int | None, RankSteps]]:
        """Per pid that stepped: its first rank and what the rank rules read of its steps
        (diagnosis.ranks), read with the step summary."""
        return self._step_pass[1]

    @cached_property
    def profiles(self) -> list[WindowProfile]:
        """The profiled windows whose trace was parsed into steps (rules on profiles read
        these; [] for a recording without a window)."""
        return [w for w in read_profiles(self.recording) if w.trace is not None and w.judged]

    @staticmethod
    def verdict_ready(stats: StepStats | None) -> StepStats | None:
        """``stats`` when enough steady steps carry a verdict, else None."""
        if (
            stats is None
            or stats.measured_steps < MIN_STEADY_STEPS
            or stats.steps_per_s is None
            or stats.data_wait_fraction is None
        ):
            return None
        return stats

    # -- in-job records -----------------------------------------------------------------
    @cached_property
    def dataloaders(self) -> list[dict[str, Any]]:
        return self.recording.rows("dataloaders")

    @cached_property
    def settings(self) -> dict[int, dict[str, Any]]:
        """The latest value of each setting per process, JSON-decoded."""
        out: dict[int, dict[str, Any]] = defaultdict(dict)
        for row in self.recording.rows("settings"):
            out[row["pid"]][row["key"]] = decode_json(row["value"])
        return dict(out)

    def setting(self, key: str, pid: int | None = None) -> Any:
        """A setting of ``pid``, or of the first compute process that has it."""
        if pid is not None:
            return self.settings.get(pid, {}).get(key)
        for p in [*self.compute_pids, *self.settings]:
            value = self.settings.get(p, {}).get(key)
            if value is not None:
                return value
        return None

    @cached_property
    def events(self) -> list[dict[str, Any]]:
        rows = self.recording.rows("events")
        for r in rows:
            r["detail"] = decode_json(r["detail"])
        return rows

    def events_of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["kind"] == kind]

    @property
    def job(self) -> RankJob:
        """The job's ranks: of this recording alone, or of every node's recording when the
        engine diagnoses several as one job."""
        return self.job_context.ranks

    # -- GPUs ---------------------------------------------------------------------------
    @cached_property
    def gpu_samples(self) -> dict[int, SampleFrame]:
        """Each GPU's samples taken while the job ran, by GPU index."""
        frame = self._frame("gpu_samples", self.t_start - 1e-6, self.t_end + 1e-6)
        return frame.group_by("index")

    @cached_property
    def gpu_memory_holders(self) -> list[tuple[int, int, bool]]:
        """(GPU index, pid, in the job) of every process NVML saw holding memory on a GPU."""
        rows = self.recording.query(
            "SELECT DISTINCT gpu_index, pid, in_job FROM gpu_process_samples"
            " WHERE COALESCE(used_memory, 0) > 0"
        )
        return [(r["gpu_index"], r["pid"], bool(r["in_job"])) for r in rows]

    @cached_property
    def job_gpu_indices(self) -> list[int]:
        """GPUs the job holds memory on (NVML per-process memory), else none."""
        return sorted({index for index, _, in_job in self.gpu_memory_holders if in_job})

    @cached_property
    def steps_use_cuda(self) -> bool:
        # SQL finds the first such row: a CPU job's steps are not read for it
        rows = self.recording.query("SELECT 1 AS x FROM steps WHERE cuda_reserved > 0 LIMIT 1")
        return bool(rows)

    @cached_property
    def param_devices(self) -> list[str]:
        """Devices of the optimizer's parameters (``params.devices``), empty when unknown."""
        devices: list[str] = []
        for pid in self.compute_pids:
            value = self.settings.get(pid, {}).get("params.devices")
            if isinstance(value, list):
                devices.extend(str(d) for d in value)
            elif value:
                devices.append(str(value))
        return sorted(set(devices))

    @cached_property
    def uses_gpu(self) -> bool:
        on_cuda = any(d.startswith("cuda") for d in self.param_devices)
        return bool(self.job_gpu_indices) or self.steps_use_cuda or on_cuda

    @cached_property
    def job_gpus(self) -> list[int]:
        """GPUs the job runs on: where it holds memory, else the only GPU when it uses CUDA."""
        if self.job_gpu_indices:
            return [i for i in self.job_gpu_indices if i in self.gpu_samples]
        if self.uses_gpu and len(self.gpu_samples) == 1:
            return list(self.gpu_samples)
        return []

    def gpu_series(self, index: int, column: str) -> list[tuple[float, float]]:
        samples = self.gpu_samples.get(index)
        return samples.series(column) if samples is not None else []

    # -- conditions over time -----------------------------------------------------------
    def sustained(
        self,
        series: list[tuple[float, float]],
        limit: float,
        *,
        above: bool = True,
        what: str | None = None,
    ) -> Span | None:
        """The longest stretch of the run's steady part where the series stays beyond
        ``limit``, if it is sustained.

        Sustained means: over a window of ``thresholds.sustained_s`` (or the whole steady part
        when it is shorter), at least ``thresholds.sustained_fraction`` of the samples are
        beyond the limit. Overlapping qualifying windows merge into one span. The steady part
        must hold MIN_EVIDENCE_S seconds and MIN_EVIDENCE_SAMPLES samples; when it does not,
        nothing is sustained and ``what`` (if given) is noted as not judged.
        """
        series = self.steady(series)
        if not series:
            return None
        if not self.enough_evidence(series, what):
            return None
        return sustained_span(series, limit, self.thresholds, above=above)


def _num(x: float) -> str:
    return f"{x:g}"
