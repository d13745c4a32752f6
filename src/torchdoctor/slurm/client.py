"""Slurm's client commands (sbatch, scontrol, sacct, sinfo), run without a shell, parsed.

A one-node Debian setup has no slurmdbd, so ``sacct`` answers "accounting storage is
disabled"; ``scontrol show job`` knows a job until MinJobAge (300 s by default) after it ends;
``jobcomp/filetxt``, where the cluster writes it, keeps one line per finished job. Each
reader returns None where its source does not know the job, and the caller tries the next.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from torchdoctor.errors import UserError

TIMEOUT_S = 60.0
_PAIR = re.compile(r"([A-Za-z][\w/:]*)=(.*?)(?=\s+[A-Za-z][\w/:]*=|\s*$)")


def require(tool: str, what: str) -> str:
    """The path of a Slurm client program, or the one-line error saying what to do."""
    path = shutil.which(tool)
    if path is None:
        raise UserError(
            f"`{tool}` is not on PATH, so {what}: install Slurm's client "
            "(Debian/Ubuntu: `apt install slurm-client`) or run this where it is installed"
        )
    return path


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise UserError(
            f"`{' '.join(argv)}` did not answer within {TIMEOUT_S:.0f} s: is slurmctld reachable?"
        ) from None


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no message"


def submit(script: Path) -> str:
    """``sbatch --parsable SCRIPT``; the job id."""
    sbatch = require("sbatch", f"the script was written but not submitted ({script})")
    res = _run([sbatch, "--parsable", str(script)])
    if res.returncode != 0:
        raise UserError(
            f"sbatch refused the job: {_last_line(res.stderr)} (the script is {script}; "
            "edit it or change the options and submit again)"
        )
    job_id = res.stdout.strip().split(";")[0]  # "ID" or "ID;cluster"
    if not job_id.isdigit():
        raise UserError(f"sbatch answered {res.stdout.strip()!r}, not a job id")
    return job_id


def parse_pairs(text: str) -> dict[str, str]:
    """``Key=Value Key2=Value 2 ...`` (scontrol's one-line form) as a dict."""
    return {m.group(1): m.group(2).strip() for m in _PAIR.finditer(text.strip())}


def show_job(job_id: str) -> dict[str, str] | None:
    """``scontrol show job -o``: the job's fields, or None once slurmctld has forgotten it."""
    scontrol = require("scontrol", "Slurm cannot be asked about the job")
    res = _run([scontrol, "show", "job", "-o", job_id])
    if res.returncode != 0:
        if "Invalid job id" in res.stderr:
            return None
        raise UserError(f"scontrol could not show job {job_id}: {_last_line(res.stderr)}")
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("JobId=")), "")
    return parse_pairs(line) or None


def batch_script(job_id: str) -> str | None:
    """The script the job was submitted with, while slurmctld still knows the job."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return None
    res = _run([scontrol, "write", "batch_script", job_id, "-"])
    return res.stdout if res.returncode == 0 and res.stdout.startswith("#!") else None


SACCT_FIELDS = ("JobID", "State", "Elapsed", "Timelimit", "NodeList", "NNodes", "ExitCode")


def sacct_job(job_id: str) -> dict[str, str] | None:
    """The job's allocation line from accounting, or None (no slurmdbd, or job unknown)."""
    sacct = shutil.which("sacct")
    if sacct is None:
        return None
    res = _run(
        [sacct, "-j", job_id, "-X", "-n", "-P", "-o", ",".join(SACCT_FIELDS)]
    )  # -X: the allocation only, not its steps
    if res.returncode != 0:
        return None
    for line in res.stdout.splitlines():
        values = line.split("|")
        if len(values) == len(SACCT_FIELDS) and values[0] == job_id:
            return dict(zip(SACCT_FIELDS, values, strict=True))
    return None


def config() -> dict[str, str]:
    """``scontrol show config`` as a dict (empty where scontrol is missing or fails)."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return {}
    res = _run([scontrol, "show", "config"])
    out: dict[str, str] = {}
    for line in res.stdout.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() and " " not in key.strip():
            out[key.strip()] = value.strip()
    return out


def jobcomp_job(job_id: str, conf: dict[str, str]) -> dict[str, str] | None:
    """The job's line in the jobcomp/filetxt log, where the cluster writes one we can read."""
    if conf.get("JobCompType") != "jobcomp/filetxt" or not conf.get("JobCompLoc"):
        return None
    try:
        text = Path(conf["JobCompLoc"]).read_text(errors="replace")
    except OSError:
        return None
    found = None
    for line in text.splitlines():
        if line.startswith(f"JobId={job_id} "):
            found = parse_pairs(line)  # a requeued job has several lines: the last one counts
    return found


def largest_node_cpus(partition: str | None = None) -> int | None:
    """CPUs of the largest node in ``partition`` (or the default one), None when unknown.

    A job asking more CPUs per task than any node has stays pending for ever
    (Reason=PartitionConfig): the sizing caps its request here.
    """
    sinfo = shutil.which("sinfo")
    if sinfo is None:
        return None
    argv = [sinfo, "-h", "-o", "%c"] + (["-p", partition] if partition else [])
    res = _run(argv)
    if res.returncode != 0:
        return None
    counts = [int(f.rstrip("+")) for f in res.stdout.split() if f.rstrip("+").isdigit()]
    return max(counts) if counts else None


def cluster_gpu_types() -> tuple[str, ...]:
    """The GPU gres the cluster's nodes declare (``gpu:a100:4``), for the script's hint."""
    sinfo = shutil.which("sinfo")
    if sinfo is None:
        return ()
    res = _run([sinfo, "-h", "-o", "%G"])
    if res.returncode != 0:
        return ()
    kinds: set[str] = set()
    for field in res.stdout.split():
        for gres in field.split(","):
            gres = gres.split("(")[0]
            if gres.startswith("gpu"):
                kinds.add(gres)
    return tuple(sorted(kinds))
