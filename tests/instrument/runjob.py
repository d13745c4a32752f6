"""Run a real child process under the real Collector and RecordingWriter; read the recording."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from torchdoctor.instrument.collector import Collector, bootstrap_env
from torchdoctor.recording import RecordingWriter, open_recording

JOBS = Path(__file__).resolve().parent / "jobs"
TRAIN = str(JOBS / "train_job.py")
TABLES = ("steps", "dataloaders", "settings", "events")


@dataclass
class JobRun:
    returncode: int
    stdout: str
    stderr: str
    rows: dict[str, list[dict]]

    def settings_of(self, pid: int) -> dict[str, str]:
        return {r["key"]: r["value"] for r in self.rows["settings"] if r["pid"] == pid}

    def events(self, kind: str) -> list[dict]:
        return [e for e in self.rows["events"] if e["kind"] == kind]


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHDOCTOR_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra or {})
    return env


def run_job(
    argv: list[str],
    out: Path,
    *,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float = 120,
    force_bootstrap: bool = False,
) -> JobRun:
    """Run ``argv`` instrumented through the collector, as ``torchdoctor run`` does.

    ``force_bootstrap`` injects the bootstrap even where ``child_env`` would not (to test the
    agent's own checks, as in a process started inside an instrumented job)."""
    writer = RecordingWriter(out, {"command": argv})
    collector = Collector(writer)
    job_env = child_env(env)
    job_env = (
        bootstrap_env(job_env, collector.address)
        if force_bootstrap
        else collector.child_env(job_env)
    )
    try:
        proc = subprocess.run(
            argv,
            env=job_env,
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    finally:
        collector.close(timeout=2.0)
        writer.close({"exit_status": None})
    with open_recording(out) as rec:
        rows = {t: rec.rows(t) for t in TABLES}
    return JobRun(proc.returncode, proc.stdout, proc.stderr, rows)


def run_plain(argv: list[str], *, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The same command without torchdoctor at all."""
    return subprocess.run(argv, env=child_env(env), capture_output=True, text=True, timeout=120)


PY = sys.executable
