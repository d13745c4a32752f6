"""Sizing from recorded figures and the script text: the DDP shape, each figure with its source."""

from __future__ import annotations

import dataclasses
import re
import subprocess
from pathlib import Path

import pytest

from torchdoctor.errors import UserError
from torchdoctor.sizing.command import job_identity, torchrun_invocation
from torchdoctor.sizing.recorded import RecordedJob
from torchdoctor.sizing.size import (
    MEM_MARGIN,
    MEM_ROUND,
    RECORDER_MEM,
    TORCHRUN_AGENT_MEM,
    JobRequest,
    size_job,
)
from torchdoctor.slurm.notation import (
    MIB,
    format_duration,
    format_memory,
    parse_duration,
    parse_memory,
)
from torchdoctor.slurm.script import ScriptOptions, render_script

GIB = 1024 * MIB
CMD = ["python", "train.py", "--epochs", "3"]


def recorded(**changes) -> RecordedJob:
    """A recorded single-GPU run: 10 GiB peak PSS, 3.4 cores at peak, 0.5 s per step."""
    base = RecordedJob(
        path="/runs/train.sqlite",
        command=list(CMD),
        hostname="ws1",
        duration_s=60.0,
        exit_status=0,
        ranks=1,
        launcher_recorded=False,
        pss_peak=10 * GIB,
        rss_peak=11 * GIB,
        cores_peak=3.4,
        cores_mean=2.9,
        usable_cpus=16.0,
        step_count=100,
        step_s=0.5,
        overhead_s=10.0,
        num_workers=2,
        advised_workers=None,
        torch_threads=4,
        contended=False,
        gpus_used=1,
        gpu_memory_peak=30 * GIB,
        gpu_name="NVIDIA A100-SXM4-40GB",
        gpu_memory_total=40 * GIB,
    )
    return dataclasses.replace(base, **changes)


def script_for(job: RecordedJob, **request) -> tuple[str, list[str]]:
    signal = request.pop("signal", False)
    req = JobRequest(command=request.pop("command", list(CMD)), **request)
    size = size_job(job, req)
    opts = ScriptOptions(
        command=req.command,
        job_name="train",
        recordings=Path("/shared/runs"),
        torchdoctor="/opt/venv/bin/torchdoctor",
        source="recording /runs/train.sqlite",
        signal_checkpoint=signal,
    )
    return render_script(size, opts), size.notes


def sbatch_lines(text: str) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)$", text, re.M))


def comment_above(text: str, option: str) -> str:
    lines = text.splitlines()
    i = next(n for n, line in enumerate(lines) if line.startswith(f"#SBATCH --{option}="))
    return lines[i - 1]


def test_ddp_shape_one_task_per_node_all_gpus_visible_srun_c_explicit() -> None:
    text, _ = script_for(recorded(), nodes=2, gpus_per_node=4)
    opts = sbatch_lines(text)
    assert opts["nodes"] == "2" and opts["ntasks-per-node"] == "1"
    assert opts["gpus-per-node"] == "4"
    assert not re.search(r"^#SBATCH --gpus-per-task", text, re.M)
    assert "export CUDA_VISIBLE_DEVICES" not in text  # Slurm's to set
    assert "export CUDA_DEVICE_ORDER=PCI_BUS_ID" in text
    assert re.search(r'^srun .*-c "\$SLURM_CPUS_PER_TASK"', text, re.M)
    assert 'nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))' in text
    assert "export MASTER_ADDR=${nodes[0]}" in text
    assert "export MASTER_PORT=$(( 20000 + SLURM_JOB_ID % 40000 ))" in text
    # every node: torchdoctor launch (torchrun with every rank recorded), its node rank and
    # the job's folder expanded on that node, the user's script and arguments after it
    node = next(line for line in text.splitlines() if line.startswith("  bash -c "))
    for part in (
        '"$TORCHDOCTOR" launch --out "$JOB_RECORDINGS"',
        '--nnodes "$SLURM_NNODES"',
        '--node-rank "$SLURM_NODEID"',
        '--master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"',
        "--nproc-per-node 4",
    ):
        assert part in node
    assert text.rstrip().endswith("  train.py --epochs 3")
    assert 'export JOB_RECORDINGS=/shared/runs/slurm-"$SLURM_JOB_ID"' in text
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)  # valid bash


def test_each_figure_is_commented_with_its_source() -> None:
    text, _ = script_for(recorded(), steps=1000)
    assert "peak PSS of the whole job 10.0 GiB" in comment_above(text, "mem")
    assert "peak CPU use 3.40 cores per rank" in comment_above(text, "cpus-per-task")
    assert "1 + 2 DataLoader workers per rank (as the job ran)" in comment_above(
        text, "cpus-per-task"
    )
    assert "1000 steps x 500 ms per step + 10.0 s start-up" in comment_above(text, "time")
    assert "# 1 rank per node: one rank per GPU" in text
    assert "GPUs holding the job's memory in the recording" in comment_above(text, "gpus-per-node")
    assert "Each GPU needs 30.0 GiB" in comment_above(text, "gpus-per-node")
    assert "# threads per rank:" in text


def test_memory_is_peak_pss_plus_agent_recorder_and_margin() -> None:
    text, _ = script_for(recorded())
    need = 10 * GIB + TORCHRUN_AGENT_MEM + RECORDER_MEM
    expected = -(-int(need * (1 + MEM_MARGIN)) // MEM_ROUND) * MEM_ROUND
    assert parse_memory(sbatch_lines(text)["mem"]) == expected
    # a recording that already holds torchrun's agent does not get it twice
    text, _ = script_for(recorded(launcher_recorded=True))
    need = 10 * GIB + RECORDER_MEM
    assert (
        parse_memory(sbatch_lines(text)["mem"])
        == -(-int(need * (1 + MEM_MARGIN)) // MEM_ROUND) * MEM_ROUND
    )


def test_cpus_count_advised_workers_and_threads_leave_them_room() -> None:
    text, _ = script_for(recorded(num_workers=0, advised_workers=6, cores_peak=1.0))
    assert sbatch_lines(text)["cpus-per-task"] == "7"  # 1 + 6 workers, 1 rank
    assert "advised by diagnose" in comment_above(text, "cpus-per-task")
    assert "export OMP_NUM_THREADS=1" in text  # 7 CPUs less 6 workers


def test_cpus_never_exceed_the_largest_node() -> None:
    # 1 + 6 advised workers on a cluster of 2-CPU nodes: asking 7 would stay pending for ever
    text, notes = script_for(
        recorded(num_workers=0, advised_workers=6, cores_peak=1.0), node_cpus=2
    )
    assert sbatch_lines(text)["cpus-per-task"] == "2"
    assert "largest node" in comment_above(text, "cpus-per-task")
    assert any("largest node has 2" in n for n in notes)
    assert "export OMP_NUM_THREADS=1" in text


def test_a_contended_recording_is_sized_from_the_threads_it_ran() -> None:
    # other programs left the job 0.6 cores of the 16 it could use; it ran 4 torch threads
    text, notes = script_for(recorded(contended=True, cores_peak=0.6, num_workers=0))
    assert sbatch_lines(text)["cpus-per-task"] == "4"
    assert "export OMP_NUM_THREADS=4" in text
    assert any("cpu-contention" in n for n in notes)


def test_time_is_steps_times_step_time_plus_margin_rounded_to_minutes() -> None:
    text, _ = script_for(recorded(), steps=1000)
    # 10 s + 1000 x 0.5 s = 510 s, + max(50 %, 5 min) = 810 s -> 14 minutes
    assert sbatch_lines(text)["time"] == "00:14:00"
    text, _ = script_for(recorded(), time_limit_s=7200)
    assert sbatch_lines(text)["time"] == "02:00:00"
    assert "asked with --time" in comment_above(text, "time")


def test_nodes_times_gpus_beyond_the_recording_sizes_from_per_rank_figures() -> None:
    text, notes = script_for(recorded(), nodes=8, gpus_per_node=8)
    assert any("per-rank figures x ranks per node" in n for n in notes)
    assert "# NOTE: the recording ran 1 rank on one machine" in text
    need = 8 * 10 * GIB + TORCHRUN_AGENT_MEM + RECORDER_MEM
    assert parse_memory(sbatch_lines(text)["mem"]) >= need * (1 + MEM_MARGIN)
    assert sbatch_lines(text)["cpus-per-task"] == str(8 * 4)  # 4 per rank (peak 3.4) x 8
    assert any("across nodes each step also waits for the network" in n for n in notes)


def test_a_recording_of_another_command_is_said() -> None:
    _, notes = script_for(recorded(), command=["python", "eval.py"])
    assert any("the recording is of `train.py`, not of `eval.py`" in n for n in notes)
    # the same script under another interpreter path or with other arguments is the same job
    _, notes = script_for(recorded(), command=["/venv/bin/python3", "train.py", "--epochs", "9"])
    assert not any("recording is of" in n for n in notes)


def test_checkpoint_signal_only_when_asked() -> None:
    text, _ = script_for(recorded())
    assert "--signal" not in text and "PET_SIGNALS_TO_HANDLE" not in text
    text, _ = script_for(recorded(), signal=True)
    assert sbatch_lines(text)["signal"] == "USR1@90"
    # torchrun's own option, by its environment form: it reaches torchrun through launch
    assert "export PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" in text


def test_network_settings_of_the_recorded_run_are_carried_over() -> None:
    text, _ = script_for(recorded(network_env={"NCCL_SOCKET_IFNAME": "ib0"}))
    assert "export NCCL_SOCKET_IFNAME=ib0" in text


def test_cpu_job_gets_no_gpu_request() -> None:
    text, _ = script_for(
        recorded(gpus_used=0, gpu_memory_peak=None, ranks=2, cores_peak=2.0, num_workers=0)
    )
    opts = sbatch_lines(text)
    assert "gpus-per-node" not in opts
    assert opts["cpus-per-task"] == "2"
    assert "--nproc-per-node 2" in text


def test_a_non_python_command_runs_under_run_and_torchrun_with_c10d() -> None:
    text, _ = script_for(recorded(command=["./train.sh"]), command=["./train.sh", "--fast"])
    node = next(line for line in text.splitlines() if line.startswith("  bash -c "))
    assert '"$TORCHDOCTOR" run --out "$JOB_RECORDINGS/$SLURMD_NODENAME.sqlite" -- torchrun' in node
    assert "--rdzv-backend c10d" in node and '--rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"' in node
    assert text.rstrip().endswith("--no-python ./train.sh --fast")
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)


def test_bad_requests_say_what_to_do() -> None:
    with pytest.raises(UserError, match="at least one node"):
        size_job(recorded(), JobRequest(command=CMD, nodes=0))
    with pytest.raises(UserError, match="--steps needs the recording's step times"):
        size_job(recorded(step_s=None, step_count=None), JobRequest(command=CMD, steps=10))


@pytest.mark.parametrize(
    ("argv", "launcher", "rest"),
    [
        (["python", "train.py", "-x"], ["python", "-m", "torch.distributed.run"], ["train.py", "-x"]),
        (["python3", "-m", "pkg.train"], ["python3", "-m", "torch.distributed.run"], ["-m", "pkg.train"]),
        (["./train.sh", "a"], ["torchrun"], ["--no-python", "./train.sh", "a"]),
    ],
)  # fmt: skip
def test_command_as_torchrun_runs_it(argv, launcher, rest) -> None:
    assert torchrun_invocation(argv) == (launcher, rest)


def test_torchrun_itself_is_refused() -> None:
    with pytest.raises(UserError, match="not `torchrun ...`"):
        torchrun_invocation(["torchrun", "--nproc-per-node=2", "train.py"])


def test_job_identity_sees_through_launchers() -> None:
    assert job_identity(["python", "-u", "train.py", "--lr", "1"]) == "train.py"
    assert job_identity(["torchrun", "--standalone", "--nproc-per-node", "2", "train.py"]) == (
        "train.py"
    )
    assert job_identity(["python", "-m", "torch.distributed.run", "--nnodes=1", "t.py"]) == "t.py"
    assert job_identity(["torchdoctor", "run", "--out", "x.sqlite", "--", "python", "t.py"]) == (
        "t.py"
    )
    assert job_identity(["python", "-m", "pkg.train"]) == "-m pkg.train"


def test_slurm_notation() -> None:
    assert parse_memory("1280M") == 1280 * MIB and parse_memory("64G") == 64 * GIB
    assert parse_memory("500") == 500 * MIB and parse_memory("UNLIMITED") is None
    assert format_memory(1024 * MIB) == "1G" and format_memory(1280 * MIB) == "1280M"
    assert parse_duration("00:06:00") == 360 and parse_duration("1-02:00:00") == 93600
    assert parse_duration("5") == 300 and parse_duration("5:30") == 330
    assert parse_duration("UNLIMITED") is None and parse_duration("soon") is None
    assert format_duration(93600) == "26:00:00"
