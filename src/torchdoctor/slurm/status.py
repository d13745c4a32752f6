"""What became of a Slurm job: its state, what it asked for against what it used.

Slurm's answer comes from the first source that knows the job: ``scontrol show job`` (until
MinJobAge after the end), ``sacct`` (where slurmdbd runs), the ``jobcomp/filetxt`` log (where
the cluster keeps one we can read). After that the job's own folder still holds the copy of
its script (what it asked) and one recording per node (what it used, how it ended), so a
finished job stays reportable without accounting.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from torchdoctor.diagnosis.findings import Finding
from torchdoctor.errors import UserError
from torchdoctor.recording.paths import runs_dir
from torchdoctor.recording.summary import RunSummary
from torchdoctor.slurm import client
from torchdoctor.slurm.notation import parse_duration, parse_memory
from torchdoctor.slurm.script import RECORDINGS_MARKER, job_folder
from torchdoctor.units import fmt_bytes, fmt_duration

SCRIPT_COPY = "job.sbatch"


@dataclass(slots=True)
class SlurmJobState:
    """Slurm's view of the job (or, once Slurm forgot it, the recordings')."""

    job_id: str
    source: str  # "scontrol", "sacct", "jobcomp/filetxt" or "recordings"
    state: str  # Slurm's JobState: PENDING, RUNNING, COMPLETED, FAILED, TIMEOUT...
    name: str | None = None
    reason: str | None = None
    exit_code: str | None = None  # "0:0" (status:signal)
    elapsed_s: int | None = None
    node_list: str | None = None
    num_nodes: int | None = None


@dataclass(slots=True)
class Asked:
    """Per node, as the job asked for it."""

    mem_per_node: int | None = None
    cpus_per_task: int | None = None
    time_limit_s: int | None = None
    source: str = ""


@dataclass(slots=True)
class AskedUsed:
    figure: str  # "memory per node", "CPUs per node", "time"
    unit: str  # "B", "cores", "s"
    asked: float | None
    used: float | None
    detail: str = ""  # how "used" was measured

    @property
    def share(self) -> float | None:
        if self.asked in (None, 0) or self.used is None:
            return None
        return self.used / self.asked

    def text(self) -> str:
        """``asked 1.25 GiB, used 300 MiB (23 %, peak PSS on vm)``."""
        fmt = {"B": fmt_bytes, "s": fmt_duration}.get(self.unit, _cores)
        share = self.share
        extra = ", ".join(
            p for p in (f"{share * 100:.0f} %" if share is not None else "", self.detail) if p
        )
        asked = fmt(self.asked) if self.asked is not None else "nothing (cluster default)"
        used = fmt(self.used) if self.used is not None else "not recorded"
        return f"asked {asked}, used {used}" + (f" ({extra})" if extra else "")


OOM_KILLED = "oom-killed"  # the diagnosis rule's id


@dataclass(slots=True)
class NodeRecording:
    path: str
    hostname: str | None
    summary: RunSummary
    findings: list[Finding]


@dataclass(slots=True)
class JobReport:
    state: SlurmJobState
    asked: Asked
    folder: str
    recordings: list[NodeRecording] = field(default_factory=list)
    asked_used: list[AskedUsed] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def job_report(job_id: str, recordings: Path | None) -> JobReport:
    """Everything `slurm status` shows about ``job_id``.

    ``recordings`` is the folder given to `sbatch --recordings`; None: the one the job's
    script names (while Slurm still has the script), else the recordings folder (torchdoctor.config).
    """
    if not job_id.isdigit():
        raise UserError(f"{job_id!r} is not a Slurm job id (a number, as sbatch printed it)")
    notes: list[str] = []
    has_slurm = shutil.which("scontrol") is not None
    fields = None
    if has_slurm:
        try:
            fields = client.show_job(job_id)
        except UserError as exc:
            # Slurm's client without a reachable controller (a login image with the client
            # only, a node whose slurmctld is down): the job's own folder still tells.
            has_slurm = False
            notes.append(
                f"Slurm cannot be asked ({exc.message}): what follows comes from the job's own folder"
            )
    state = _from_scontrol(job_id, fields) if fields else None
    if recordings is None:
        recordings = (_recordings_from_script(job_id) if fields else None) or runs_dir()
    folder = job_folder(recordings.resolve(), job_id)
    if not has_slurm and not notes:
        notes.append("`scontrol` is not on PATH: what follows comes from the job's own folder")
    elif state is None:
        state = _from_accounting(job_id)
        if state is None:
            notes.append(
                "Slurm no longer knows the job (slurmctld forgets finished jobs after "
                f"MinJobAge = {client.config().get('MinJobAge', '300 sec')}, and no accounting "
                "keeps it): its state and times come from its recordings"
            )
    nodes = _node_recordings(folder, job_id)
    asked = _asked_from_scontrol(fields) if fields else _asked_from_copy(folder)
    if state is None:
        if not nodes:
            raise UserError(
                f"Slurm does not know job {job_id} and {folder} holds no recording of it: give "
                "the folder the job wrote into with --recordings DIR (as given to sbatch)"
            )
        state = _from_recordings(job_id, nodes)
    if not nodes and state.state not in ("PENDING", "CONFIGURING"):
        notes.append(f"no recording of the job in {folder} yet")
    for node in nodes:
        for f in node.findings:
            if f.id == OOM_KILLED:  # Slurm says OUT_OF_MEMORY at best; the recording says who
                notes.append(f"OOM-killed on {node.hostname or node.path}: {f.title}")
    return JobReport(
        state=state,
        asked=asked,
        folder=str(folder),
        recordings=nodes,
        asked_used=_asked_used(asked, state, nodes),
        notes=notes,
    )


def _recordings_from_script(job_id: str) -> Path | None:
    script = client.batch_script(job_id)
    if not script:
        return None
    for line in script.splitlines():
        if line.startswith(RECORDINGS_MARKER):
            return Path(line[len(RECORDINGS_MARKER) :].strip())
    return None


def _from_scontrol(job_id: str, f: dict[str, str]) -> SlurmJobState:
    return SlurmJobState(
        job_id=job_id,
        source="scontrol",
        state=f.get("JobState", "UNKNOWN"),
        name=f.get("JobName"),
        reason=_none(f.get("Reason")),
        exit_code=f.get("ExitCode"),
        elapsed_s=parse_duration(f.get("RunTime", "")),
        node_list=_none(f.get("NodeList")),
        num_nodes=_int(f.get("NumNodes")),
    )


def _from_accounting(job_id: str) -> SlurmJobState | None:
    row = client.sacct_job(job_id)
    if row is not None:
        return SlurmJobState(
            job_id=job_id,
            source="sacct",
            state=row["State"].split()[0],  # "CANCELLED by 0" -> CANCELLED
            exit_code=row["ExitCode"],
            elapsed_s=parse_duration(row["Elapsed"]),
            node_list=_none(row["NodeList"]),
            num_nodes=_int(row["NNodes"]),
        )
    row = client.jobcomp_job(job_id, client.config())
    if row is not None:
        return SlurmJobState(
            job_id=job_id,
            source="jobcomp/filetxt",
            state=row.get("JobState", "UNKNOWN"),
            name=row.get("Name"),
            exit_code=row.get("ExitCode"),
            elapsed_s=_span(row.get("StartTime"), row.get("EndTime")),
            node_list=_none(row.get("NodeList")),
            num_nodes=_int(row.get("NodeCnt")),
        )
    return None


def _from_recordings(job_id: str, nodes: list[NodeRecording]) -> SlurmJobState:
    statuses = [n.summary.exit_status for n in nodes]
    if not all(n.summary.complete for n in nodes):
        state = "UNKNOWN (a node's recording was cut short: killed, or still running)"
    elif any(f.id == OOM_KILLED for n in nodes for f in n.findings):
        state = "OUT_OF_MEMORY"  # Slurm's own name for a job its cgroup's OOM killer ended
    elif all(s == 0 for s in statuses):
        state = "COMPLETED"
    else:
        state = "FAILED"
    worst = max((s for s in statuses if s is not None), default=None)
    durations = [n.summary.duration_s for n in nodes if n.summary.duration_s is not None]
    return SlurmJobState(
        job_id=job_id,
        source="recordings",
        state=state,
        exit_code=None if worst is None else f"{worst}:0",
        elapsed_s=int(round(max(durations))) if durations else None,
        node_list=",".join(n.hostname or "?" for n in nodes),
        num_nodes=len(nodes),
    )


def _asked_from_scontrol(f: dict[str, str]) -> Asked:
    mem = parse_memory(f.get("MinMemoryNode", "")) if "MinMemoryNode" in f else None
    return Asked(
        mem_per_node=mem,
        cpus_per_task=_int(f.get("CPUs/Task")),
        time_limit_s=parse_duration(f.get("TimeLimit", "")),
        source="scontrol",
    )


_SBATCH = re.compile(r"^#SBATCH\s+--([\w-]+)=(\S+)")


def _asked_from_copy(folder: Path) -> Asked:
    """What the job's script asked, from the copy it left beside its recordings."""
    try:
        text = (folder / SCRIPT_COPY).read_text(errors="replace")
    except OSError:
        return Asked(source="unknown (no copy of the script in the job's folder)")
    opts = {m.group(1): m.group(2) for m in map(_SBATCH.match, text.splitlines()) if m}
    return Asked(
        mem_per_node=parse_memory(opts["mem"]) if "mem" in opts else None,
        cpus_per_task=_int(opts.get("cpus-per-task")),
        time_limit_s=parse_duration(opts["time"]) if "time" in opts else None,
        source=f"the job's script ({folder / SCRIPT_COPY})",
    )


def _node_recordings(folder: Path, job_id: str) -> list[NodeRecording]:
    from torchdoctor.diagnosis.engine import diagnose
    from torchdoctor.recording.reader import open_recording
    from torchdoctor.recording.summary import summarize
    from torchdoctor.thresholds import load_thresholds

    out = []
    thresholds = load_thresholds(None)
    # os.path.isdir: False for a folder name too long, where Path.is_dir raises ENAMETOOLONG
    for path in sorted(folder.glob("*.sqlite")) if os.path.isdir(folder) else []:
        try:
            with open_recording(path) as rec:
                # A recording that names another job (a folder reused by hand) is not this job's.
                if (rec.meta.get("env") or {}).get("SLURM_JOB_ID", job_id) != job_id:
                    continue
                summary = summarize(rec)
                findings = diagnose(rec, thresholds)
                host = (rec.meta.get("host") or {}).get("hostname")
        except UserError:
            continue  # a half-written file of a node that is starting: not readable yet
        out.append(NodeRecording(str(path), host, summary, findings))
    return out


def _asked_used(asked: Asked, state: SlurmJobState, nodes: list[NodeRecording]) -> list[AskedUsed]:
    rows = []
    pss = [(n.summary.job_pss.peak, n.hostname) for n in nodes if n.summary.job_pss.peak]
    top = max(pss, key=lambda p: p[0], default=(None, None))
    rows.append(
        AskedUsed(
            "memory per node",
            "B",
            asked.mem_per_node,
            top[0],
            f"peak PSS on {top[1]}" if top[0] is not None else "",
        )
    )
    cpu = [n.summary.job_cpu_pct for n in nodes if n.summary.job_cpu_pct.peak is not None]
    peak = max((c.peak for c in cpu), default=None)
    mean = max((c.mean for c in cpu if c.mean is not None), default=None)
    rows.append(
        AskedUsed(
            "CPUs per node",
            "cores",
            asked.cpus_per_task,
            None if peak is None else peak / 100,
            "at peak" + (f", {mean / 100:.2f} on average" if mean is not None else "")
            if peak is not None
            else "",
        )
    )
    rows.append(AskedUsed("time", "s", asked.time_limit_s, state.elapsed_s, "elapsed"))
    return rows


def _span(start: str | None, end: str | None) -> int | None:
    import datetime as dt

    try:
        t0 = dt.datetime.fromisoformat(start or "")
        t1 = dt.datetime.fromisoformat(end or "")
    except ValueError:
        return None
    return int((t1 - t0).total_seconds())


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _none(text: str | None) -> str | None:
    return None if text in (None, "", "(null)", "None") else text


def _cores(v: float | None) -> str:
    return "n/a" if v is None else f"{v:g}" if float(v).is_integer() else f"{v:.2f}"
