"""A Ray job from the sizing: ``torchdoctor launch`` (torchrun, every rank recorded) as the
entrypoint of a job submitted to the cluster's job API, and the job read back.

Why each part:

- entrypoint resources (CPUs, GPUs, memory) from the sizing: Ray reserves none for an entrypoint
  by default, so other work is scheduled onto the cores and GPUs torchrun uses, and the
  entrypoint runs on the head node (Ray's job_manager.py; PR #24546).
- ``runtime_env.env_vars``: OMP_NUM_THREADS and the network settings, as the sbatch script
  exports them.
- the entrypoint is a string Ray runs through a shell: every word is quoted with
  :func:`shlex.join`, so no word of the command is shell syntax.
- the recordings go to one folder per submission, named in the job's metadata, which
  ``handoff status ray:ID`` reads back.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchdoctor.errors import UserError
from torchdoctor.sampling.roles import is_python
from torchdoctor.sizing.command import torchrun_invocation
from torchdoctor.sizing.size import JobSize
from torchdoctor.units import fmt_bytes

DEFAULT_ADDRESS = "http://127.0.0.1:8265"
EXTRA = "pip install 'torchdoctor[ray]'"
METADATA_RECORDINGS = "torchdoctor_recordings"
METADATA_ASKED = "torchdoctor_asked_"
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Ray's submission ids become file names in its logs folder: keep them plain.
_SUBMISSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,99}")


@dataclass(slots=True)
class RaySpec:
    """What is submitted: the arguments of ``JobSubmissionClient.submit_job``."""

    entrypoint: list[str]  # the words; joined with shlex.join for Ray's shell
    num_cpus: float
    num_gpus: float
    memory: int | None  # bytes
    env_vars: dict[str, str]
    submission_id: str
    recordings: Path
    comments: list[str] = field(default_factory=list)  # each figure and its source
    nodes: int = 1  # > 1: the entrypoint places one torchrun per node (handoff.ray_nodes)
    reserve: bool = True  # False: the entrypoint's workers reserve their own (ray-train)

    def metadata(self) -> dict[str, str]:
        """Ray keeps a job's metadata (text only) but does not report its entrypoint
        resources back: what was asked is kept here for `handoff status`."""
        meta = {
            METADATA_RECORDINGS: str(self.recordings),
            METADATA_ASKED + "nodes": str(self.nodes),
            METADATA_ASKED + "cpus": f"{self.num_cpus:g}",
            METADATA_ASKED + "gpus": f"{self.num_gpus:g}",
        }
        if self.memory is not None:
            meta[METADATA_ASKED + "memory"] = str(self.memory)
        return meta

    def submit_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "entrypoint": shlex.join(self.entrypoint),
            "submission_id": self.submission_id,
            "runtime_env": {"env_vars": dict(self.env_vars)},
            "metadata": self.metadata(),
        }
        if self.nodes == 1 and self.reserve:
            kwargs["entrypoint_num_cpus"] = self.num_cpus
            kwargs["entrypoint_num_gpus"] = self.num_gpus
            if self.memory is not None:
                kwargs["entrypoint_memory"] = int(self.memory)
        return kwargs


def check_submission_id(value: str) -> str:
    if not _SUBMISSION_ID.fullmatch(value):
        raise UserError(
            f"ray:{value!r}: a submission id is letters, digits, '-' and '_' (as `handoff --to "
            "ray --submit` printed it)"
        )
    return value


def new_submission_id(name: str) -> str:
    stem = re.sub(r"[^A-Za-z0-9_-]+", "-", name).strip("-")[:60] or "job"
    return f"torchdoctor-{stem}-{secrets.token_hex(4)}"


def ray_spec(
    size: JobSize,
    command: list[str],
    *,
    torchdoctor: str,
    python: str,
    recordings_root: Path,
    name: str,
    own_python: str = sys.executable,
) -> RaySpec:
    """The Ray job for ``command``, sized by ``size``: on one node, torchdoctor launch as the
    entrypoint with the node's resources; on several, handoff.ray_nodes placing one launch per
    node (``own_python`` runs it: the Python torchdoctor and Ray are installed in)."""
    torchrun_invocation(command)  # the same checks as every target: a script or -m module
    if not is_python(command[0]):
        raise UserError(
            f"--to ray takes a Python command (python script.py, python -m module), not "
            f"{command[0]!r}: the entrypoint is torchdoctor launch, which starts Python ranks"
        )
    submission_id = new_submission_id(name)
    folder = recordings_root / f"ray-{submission_id}"
    ranks = int(size.ranks_per_node.value)
    # The entrypoint runs in a folder of Ray's choosing: the script is named by its absolute
    # path (on a cluster, the same path must exist on the node; other relative paths in the
    # arguments are the job's own business).
    args = list(command[1:])
    if args and args[0] != "-m" and os.path.isfile(args[0]):  # False for a name too long
        args[0] = str(Path(args[0]).resolve())
    launch_args = [
        "--out-dir",
        str(folder),
        "--nproc-per-node",
        str(ranks),
        "--python",
        python,
        "--",
        *args,
    ]
    entrypoint = [torchdoctor, "launch", *launch_args]
    env = {"OMP_NUM_THREADS": str(size.threads_per_rank.value)}
    comments = [
        f"ranks: {ranks}: {size.ranks_per_node.source}",
        f"entrypoint CPUs: {size.cpus_per_task.source}",
        f"entrypoint GPUs: {size.gpus_per_node.value}: {size.gpus_per_node.source}",
        f"OMP_NUM_THREADS: {size.threads_per_rank.source}",
    ]
    for key, figure in sorted(size.network_env.items()):
        if not _ENV_NAME.fullmatch(key):
            comments.append(f"{key}: left out, not a variable name")
            continue
        env[key] = str(figure.value)
        comments.append(f"{key}: {figure.source}")
    memory = None
    if size.mem_per_node is not None:
        # The entrypoint's processes and the ranks' /dev/shm share the node's memory.
        shm = int(size.shm.value) if size.shm is not None else 0
        memory = int(size.mem_per_node.value) + shm
        comments.append(
            f"entrypoint memory {fmt_bytes(memory)}: {size.mem_per_node.source}; + "
            f"{fmt_bytes(shm)} shared memory ({size.shm.source if size.shm else 'none'}). "
            "Ray's memory is for placement only: it limits nothing"
        )
    else:
        comments.append("entrypoint memory: the recording has no memory figure")
    num_cpus, num_gpus = float(size.cpus_per_task.value), float(size.gpus_per_node.value)
    if size.nodes > 1:
        # One torchrun per node, placed by Ray: the entrypoint only places the nodes and
        # reserves nothing; each node's bundle holds the sized figures.
        bundle: dict[str, float] = {"CPU": num_cpus}
        if num_gpus:
            bundle["GPU"] = num_gpus
        if memory is not None:
            bundle["memory"] = float(memory)
        entrypoint = [
            own_python,
            "-m",
            "torchdoctor.handoff.ray_nodes",
            "--nodes",
            str(size.nodes),
            "--bundle",
            json.dumps(bundle, sort_keys=True),
            "--",
            torchdoctor,
            *launch_args,
        ]
        comments.append(
            f"{size.nodes} nodes: one torchrun per node in a STRICT_SPREAD placement group, "
            f"each node's bundle {bundle} (the entrypoint reserves nothing)"
        )
    return RaySpec(
        entrypoint=entrypoint,
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        memory=memory,
        nodes=size.nodes,
        env_vars=env,
        submission_id=submission_id,
        recordings=folder,
        comments=comments,
    )


def render_ray(spec: RaySpec, address: str, source: str, notes: list[str]) -> str:
    """The ``ray job submit`` line that submits the same job, with each figure's source."""
    lines = [
        "#!/bin/sh",
        f"# Written by `torchdoctor handoff --to ray`: a Ray job on {spec.nodes} node"
        + ("s." if spec.nodes > 1 else "."),
        f"# Sized from {_comment(source)}.",
        *[f"# NOTE: {_comment(n)}" for n in notes],
        *[f"# {_comment(c)}" for c in spec.comments],
        f"# recordings: {_comment(str(spec.recordings))}",
    ]
    words = [
        "ray",
        "job",
        "submit",
        "--address",
        address,
        "--submission-id",
        spec.submission_id,
    ]
    kwargs = spec.submit_kwargs()
    if "entrypoint_num_cpus" in kwargs:
        words += ["--entrypoint-num-cpus", f"{spec.num_cpus:g}"]
        words += ["--entrypoint-num-gpus", f"{spec.num_gpus:g}"]
    if "entrypoint_memory" in kwargs:
        words += ["--entrypoint-memory", str(spec.memory)]
    words += [
        "--runtime-env-json",
        json.dumps({"env_vars": spec.env_vars}, sort_keys=True),
        "--metadata-json",
        json.dumps(spec.metadata(), sort_keys=True),
        "--",
        shlex.join(spec.entrypoint),
    ]
    lines.append(" ".join(shlex.quote(w) for w in words))
    return "\n".join(lines) + "\n"


def _comment(text: str) -> str:
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _client(address: str) -> Any:
    try:
        from ray.job_submission import JobSubmissionClient
    except ImportError:
        raise UserError(f"--to ray needs Ray's job client: {EXTRA}") from None
    try:
        return JobSubmissionClient(address)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise UserError(
            f"cannot reach Ray's job API at {address}: {str(exc).splitlines()[0]} (start the head "
            "with its dashboard: `ray start --head`, or give --address)"
        ) from None


def submit(spec: RaySpec, address: str) -> str:
    client = _client(address)
    spec.recordings.mkdir(parents=True, exist_ok=True)
    return str(client.submit_job(**spec.submit_kwargs()))


@dataclass(slots=True)
class RayJobState:
    submission_id: str
    status: str
    driver_exit_code: int | None
    error_type: str | None
    message: str | None
    start_time: float | None  # seconds since the epoch
    end_time: float | None
    entrypoint_num_cpus: float | None
    entrypoint_num_gpus: float | None
    entrypoint_memory: int | None
    recordings: str | None  # the folder the job's recordings go to
    failing_rank: str | None = None  # torchrun's root cause, from the job's log, once FAILED


def job_state(address: str, submission_id: str) -> RayJobState:
    check_submission_id(submission_id)
    client = _client(address)
    try:
        info = client.get_job_info(submission_id)
    except RuntimeError as exc:
        raise UserError(f"ray:{submission_id}: {str(exc).splitlines()[0]}") from None
    metadata = info.metadata or {}
    status = str(getattr(info.status, "value", info.status))
    failing = None
    if status == "FAILED":
        try:
            failing = failing_rank(client.get_job_logs(submission_id))
        except RuntimeError:
            failing = None  # the log is gone (the cluster was restarted): the state still says

    def seconds(ms: int | None) -> float | None:
        return None if not ms else ms / 1000.0

    return RayJobState(
        submission_id=submission_id,
        status=status,
        driver_exit_code=info.driver_exit_code,
        error_type=getattr(info, "error_type", None),
        message=info.message,
        start_time=seconds(info.start_time),
        end_time=seconds(info.end_time),
        entrypoint_num_cpus=_number(metadata.get(METADATA_ASKED + "cpus")),
        entrypoint_num_gpus=_number(metadata.get(METADATA_ASKED + "gpus")),
        entrypoint_memory=_whole(metadata.get(METADATA_ASKED + "memory")),
        recordings=metadata.get(METADATA_RECORDINGS),
        failing_rank=failing,
    )


_ROOT_CAUSE = re.compile(
    r"Root Cause \(first observed failure\):.*?rank\s*:\s*(\d+) \(local_rank: (\d+)\)"
    r".*?exitcode\s*:\s*(-?\d+)",
    re.S,
)


def failing_rank(log: str) -> str | None:
    """The rank torchrun names as the root cause of a failed job ("rank 1 (local rank 1),
    exit 1"), from the error summary it prints; None when the log has none."""
    m = _ROOT_CAUSE.search(log)
    if not m:
        return None
    return f"rank {m[1]} (local rank {m[2]}), exit {m[3]}"


def _number(text: str | None) -> float | None:
    try:
        return None if text is None else float(text)
    except ValueError:
        return None


def _whole(text: str | None) -> int | None:
    value = _number(text)
    return None if value is None else int(value)


def wait(address: str, submission_id: str, timeout_s: float, poll_s: float = 1.0) -> RayJobState:
    """The job's state once it has ended, or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = job_state(address, submission_id)
        if state.status in TERMINAL or time.monotonic() >= deadline:
            return state
        time.sleep(poll_s)


@dataclass(slots=True)
class NodeRecording:
    path: str
    hostname: str | None
    ranks: int
    exit_status: int | None
    pss_peak: float | None  # bytes
    cores_peak: float | None
    findings: list[str]  # ids


@dataclass(slots=True)
class RayReport:
    state: RayJobState
    recordings: list[NodeRecording] = field(default_factory=list)
    asked_used: list[tuple[str, str, str]] = field(default_factory=list)  # figure, asked, used


def ray_report(address: str, submission_id: str) -> RayReport:
    """The job's state, its recordings (summary and findings) and what it asked against used."""
    state = job_state(address, submission_id)
    report = RayReport(state, _recordings(Path(state.recordings)) if state.recordings else [])
    pss = max((r.pss_peak for r in report.recordings if r.pss_peak), default=None)
    cores = max((r.cores_peak for r in report.recordings if r.cores_peak), default=None)
    report.asked_used = [
        (
            "memory",
            fmt_bytes(state.entrypoint_memory) if state.entrypoint_memory else "-",
            f"{fmt_bytes(pss)} peak PSS" if pss else "-",
        ),
        (
            "CPUs",
            f"{state.entrypoint_num_cpus:g}" if state.entrypoint_num_cpus is not None else "-",
            f"{cores:.2f} at peak" if cores is not None else "-",
        ),
        (
            "GPUs",
            f"{state.entrypoint_num_gpus:g}" if state.entrypoint_num_gpus is not None else "-",
            "-",
        ),
    ]
    return report


def _recordings(folder: Path) -> list[NodeRecording]:
    from torchdoctor.diagnosis.engine import diagnose
    from torchdoctor.recording.reader import open_recording
    from torchdoctor.recording.summary import summarize
    from torchdoctor.sampling import roles
    from torchdoctor.thresholds import load_thresholds

    out = []
    thresholds = load_thresholds(None)
    # os.path.isdir: False for a folder name too long, where Path.is_dir raises ENAMETOOLONG
    for path in sorted(folder.glob("*.sqlite")) if os.path.isdir(folder) else []:
        try:
            with open_recording(path) as rec:
                summary = summarize(rec)
                findings = diagnose(rec, thresholds)
                host = (rec.meta.get("host") or {}).get("hostname")
        except UserError:
            continue  # a recording still being started: not readable yet
        per_rank = (summary.steps or {}).get("per_rank") or []
        cpu = summary.job_cpu_pct.peak
        out.append(
            NodeRecording(
                path=str(path),
                hostname=host,
                ranks=len(per_rank) or summary.roles.get(roles.TRAINER, 0),
                exit_status=summary.exit_status,
                pss_peak=summary.job_pss.peak,
                cores_peak=None if cpu is None else cpu / 100.0,
                findings=[f.id for f in findings],
            )
        )
    return out
