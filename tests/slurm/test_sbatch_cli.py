"""`torchdoctor sbatch` on a real recording, without a cluster: the script and bad input."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import run_td
from tests.queue.conftest import queue_env  # noqa: F401 - the fixture
from tests.slurm.conftest import DDP_CMD, TRAIN
from torchdoctor.recording import open_recording
from torchdoctor.recording.summary import summarize
from torchdoctor.slurm.notation import MIB, parse_memory

# The session fixtures record real jobs before the first test: slow on a loaded machine.
pytestmark = pytest.mark.timeout(600)


def test_script_is_sized_from_the_recording(train_recording: Path) -> None:
    res = run_td(
        "sbatch", "--from", str(train_recording), "--steps", "500",
        "--", sys.executable, str(TRAIN), "--steps", "500",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    text = res.stdout
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)
    with open_recording(train_recording) as rec:
        summary = summarize(rec)
    mem = parse_memory(re.search(r"^#SBATCH --mem=(\S+)$", text, re.M).group(1))
    assert summary.job_pss.peak < mem <= summary.job_pss.peak * 1.25 + 1024 * MIB
    assert f"peak PSS of the whole job {_fmt(summary.job_pss.peak)}" in text
    assert re.search(r"^# time: 500 steps x .* per step", text, re.M)
    assert "--gpus-per-node" not in text.replace("# ", "")  # a CPU run asks for no GPU
    assert f"Sized from recording {train_recording}" in text


def test_no_recording_says_how_to_make_one() -> None:
    res = run_td("sbatch", "--", sys.executable, "train.py")
    assert res.returncode == 2
    assert res.stderr.startswith("torchdoctor: error: no recording to size the job from")
    assert "torchdoctor run --" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_submit_without_sbatch_keeps_the_script_and_says_what_to_do(
    train_recording: Path, tmp_path: Path
) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    out = tmp_path / "job.sbatch"
    env = dict(os.environ, PATH=str(empty))
    res = run_td(
        "sbatch", "--from", str(train_recording), "--submit", "--out", str(out),
        "--recordings", str(tmp_path / "runs"), "--", sys.executable, str(TRAIN), env=env,
    )  # fmt: skip
    assert res.returncode == 2
    error = [line for line in res.stderr.splitlines() if "error" in line]
    assert len(error) == 1
    assert "`sbatch` is not on PATH" in error[0] and "install Slurm's client" in error[0]
    assert str(out) in error[0]  # the script is kept, and where it is is said
    assert out.read_text().startswith("#!/bin/bash")


def test_a_recording_of_another_command_is_warned_about(train_recording: Path) -> None:
    res = run_td("sbatch", "--from", str(train_recording), "--", sys.executable, "eval.py")
    assert res.returncode == 0
    warning = next(line for line in res.stderr.splitlines() if "recording is of" in line)
    assert warning.startswith("torchdoctor: warning:")
    assert str(Path(TRAIN)).lstrip("/") in warning or "examples/train.py" in warning
    assert "not of `eval.py`" in warning


def test_more_ranks_than_recorded_are_sized_per_rank_and_said(train_recording: Path) -> None:
    res = run_td(
        "sbatch", "--from", str(train_recording), "--nodes", "4", "--gpus-per-node", "8",
        "--", sys.executable, str(TRAIN),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "per-node sizes are the recording's per-rank figures x ranks per node" in res.stderr
    assert "#SBATCH --gpus-per-node=8" in res.stdout
    assert "the recorded run used no GPU: its GPU memory need is unknown" in res.stdout
    with open_recording(train_recording) as rec:
        pss = summarize(rec).job_pss.peak
    mem = parse_memory(re.search(r"^#SBATCH --mem=(\S+)$", res.stdout, re.M).group(1))
    assert mem >= 8 * pss  # eight ranks' worth per node


def _fmt(n: float) -> str:
    from torchdoctor.units import fmt_bytes

    return fmt_bytes(n)


def test_a_torchrun_recording_sizes_per_rank(ddp_recording: Path) -> None:
    """A 2-rank torchrun recording: 2 ranks per node, steps counted per rank, agent included."""
    res = run_td("sbatch", "--from", str(ddp_recording), "--", *DDP_CMD)
    assert res.returncode == 0, res.stderr
    assert "--nproc-per-node 2" in res.stdout
    assert re.search(r"^# time: 30 steps x ", res.stdout, re.M)
    assert "for the recorder, +" in res.stdout  # torchrun's agent was recorded: not added twice
    assert "recording is of" not in res.stderr  # torchrun ... ddp_train.py is this job


def test_without_from_the_queues_last_run_of_the_command_is_used(queue_env) -> None:  # noqa: F811
    q = queue_env()
    cmd = [sys.executable, str(TRAIN), "--steps", "5", "--batch-size", "4"]
    job_id = q.submit("--", *cmd)
    assert q.wait(job_id) == 0
    recording = q.job(job_id).recording
    res = q.td("sbatch", "--", *cmd)
    assert res.returncode == 0, res.stderr
    assert f"sizing from the queue's last run of it: {recording}" in res.stderr
    assert f"# Sized from recording {recording} " in res.stdout
    # another command has no run in the queue: the error says how to get a recording
    res = q.td("sbatch", "--", sys.executable, str(TRAIN), "--steps", "6")
    assert res.returncode == 2 and "no recording to size the job from" in res.stderr


def test_doctors_network_fix_goes_into_the_script(train_recording: Path, tmp_path: Path) -> None:
    """A real `doctor --json` that finds the interface settings wrong: its fix is exported."""
    env = dict(os.environ, NCCL_SOCKET_IFNAME="nosuch0", GLOO_SOCKET_IFNAME="nosuch0")
    doctor = run_td("doctor", "--json", "--only", "network", env=env)
    report = tmp_path / "doctor.json"
    report.write_text(doctor.stdout)
    checks = {c["name"]: c for c in json.loads(doctor.stdout)["checks"]}
    fixed = re.search(r"GLOO_SOCKET_IFNAME=(\S+)", checks["network.gloo_socket_ifname"]["fix"])
    res = run_td(
        "sbatch", "--from", str(train_recording), "--doctor", str(report),
        "--", sys.executable, str(TRAIN),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert f"export GLOO_SOCKET_IFNAME={fixed.group(1)}" in res.stdout
    assert "# GLOO_SOCKET_IFNAME: torchdoctor doctor (network.gloo_socket_ifname)" in res.stdout
    assert "NCCL_SOCKET_IFNAME=nosuch0" not in res.stdout
    bad = tmp_path / "not-doctor.json"
    bad.write_text("{}")
    res = run_td("sbatch", "--from", str(train_recording), "--doctor", str(bad), "--", "x.py")
    assert res.returncode == 2 and "is not the output of `torchdoctor doctor --json`" in res.stderr
