"""The sbatch script: the DDP shape that works on Slurm, sized figures with their sources.

Shape (torchtitan's and TorchX's): one task per node; ``--gpus-per-node`` (never
``--gpus-per-task``, which binds one GPU per task and hides the others from NCCL's NVLink
detection); ``srun -c`` given explicitly (22.05 stopped passing ``--cpus-per-task`` on to srun);
one torchrun per node meeting through a c10d rendezvous on the first node of the allocation,
on a port derived from the job id so two jobs sharing a node do not collide;
``OMP_NUM_THREADS`` per rank (Slurm sets none); ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so CUDA
numbers GPUs as Slurm does; and ``CUDA_VISIBLE_DEVICES`` left to Slurm.

Every node runs under torchdoctor's recorder, which writes one recording per node into the
job's folder: ``torchdoctor diagnose FOLDER`` and ``torchdoctor slurm status JOBID`` read them.
"""

from __future__ import annotations

import shlex
import time
from dataclasses import dataclass
from pathlib import Path

from torchdoctor.coordination.slurm.command import torchrun_invocation
from torchdoctor.coordination.slurm.notation import format_duration, format_memory
from torchdoctor.coordination.slurm.sizing import JobSize
from torchdoctor.units import fmt_bytes

# The marker `slurm status` reads back (from the spooled script) to find the job's recordings.
RECORDINGS_MARKER = "# torchdoctor-recordings: "
# Seconds before the time limit that Slurm signals the job, so it can checkpoint.
CHECKPOINT_SIGNAL = "USR1@90"
PORT_BASE, PORT_SPAN = 20000, 40000


@dataclass(slots=True)
class ScriptOptions:
    """What the script needs besides the sizes."""

    command: list[str]
    job_name: str
    recordings: Path  # absolute; the job writes into <recordings>/slurm-<job id>/
    torchdoctor: str  # the torchdoctor executable the nodes run
    source: str  # one line: the recording the sizes come from
    partition: str | None = None
    account: str | None = None
    signal_checkpoint: bool = False
    cluster_gpu_types: tuple[str, ...] = ()  # gres the cluster names, for the GPU hint


def job_folder(recordings: Path, job_id: str) -> Path:
    """Where a job's recordings (one per node) and its script copy go."""
    return recordings / f"slurm-{job_id}"


def node_command() -> list[str]:
    """The recorder each node runs, up to the command it records (the one place this is chosen).

    ``torchdoctor run --out FILE -- CMD`` records CMD's whole process tree - torchrun and the
    ranks it starts - into one file per node.
    """
    return ['"$TORCHDOCTOR"', "run", "--out", '"$JOB_RECORDINGS/$SLURMD_NODENAME.sqlite"', "--"]


def render_script(size: JobSize, opts: ScriptOptions) -> str:
    """The whole script text."""
    lines = [
        "#!/bin/bash",
        f"# Written by `torchdoctor sbatch` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        f"# Sized from {opts.source}.",
        "# Sizes are per node: one task per node runs torchrun, which starts the ranks.",
    ]
    lines += [f"# NOTE: {note}" for note in size.notes]
    lines += _sbatch_lines(size, opts)
    lines += _body(size, opts)
    return "\n".join(lines) + "\n"


def _sbatch_lines(size: JobSize, opts: ScriptOptions) -> list[str]:
    out: list[str] = []

    def opt(text: str, comment: str | None = None) -> None:
        # sbatch reads an #SBATCH line's whole remainder as the option: comments go above.
        if comment:
            out.append(f"# {comment}")
        out.append(f"#SBATCH {text}")

    opt(f"--job-name={opts.job_name}")
    if opts.partition:
        opt(f"--partition={opts.partition}")
    if opts.account:
        opt(f"--account={opts.account}")
    opt(f"--nodes={size.nodes}")
    opt("--ntasks-per-node=1", "one task per node: torchrun, which starts the node's ranks")
    gpus = size.gpus_per_node.value
    if gpus:
        hint = _gpu_hint(size, opts)
        kind = f"{size.gpu_type}:" if size.gpu_type else ""
        opt(
            f"--gpus-per-node={kind}{gpus}",
            f"GPUs per node: {size.gpus_per_node.source}. Not --gpus-per-task: every rank "
            f"must see all the node's GPUs (NCCL's NVLink detection).{hint}",
        )
    opt(f"--cpus-per-task={size.cpus_per_task.value}", f"CPUs: {size.cpus_per_task.source}")
    if size.mem_per_node is not None:
        opt(
            f"--mem={format_memory(size.mem_per_node.value)}", f"memory: {size.mem_per_node.source}"
        )
    else:
        out.append("# memory: the recording has no memory figure; the cluster's default applies")
    opt(
        f"--time={format_duration(size.time_limit_s.value)}",
        f"time: {size.time_limit_s.source}",
    )
    opt(f"--output={opts.recordings / 'slurm-%j.out'}", "the job's output, beside its recordings")
    if opts.signal_checkpoint:
        opt(
            f"--signal={CHECKPOINT_SIGNAL}",
            "SIGUSR1 to every rank 90 s before the time limit: checkpoint on it",
        )
    return out


def _gpu_hint(size: JobSize, opts: ScriptOptions) -> str:
    need = size.gpu_memory_per_gpu
    if need is None or need.value is None:
        return f" {need.source}." if need is not None else ""
    text = (
        f" Each GPU needs {fmt_bytes(need.value)}, {need.source}: pick a GPU type with more"
        " (--gpus-per-node=TYPE:N, or --constraint=FEATURE where the cluster has one)"
    )
    if opts.cluster_gpu_types:
        text += f"; this cluster names {', '.join(opts.cluster_gpu_types)}"
    return text + "."


def _body(size: JobSize, opts: ScriptOptions) -> list[str]:
    ranks = size.ranks_per_node.value
    launcher, script_args = torchrun_invocation(opts.command)
    torchrun = [
        *launcher,
        '--nnodes="$SLURM_NNODES"',
        f"--nproc-per-node={ranks}",
        "--rdzv-backend=c10d",
        '--rdzv-endpoint="$head:$port"',
        '--rdzv-id="$SLURM_JOB_ID"',
    ]
    if opts.signal_checkpoint:
        torchrun.append("--signals-to-handle=SIGTERM,SIGINT,SIGUSR1")
    recorder = node_command()
    # srun runs no shell: the per-node file name ($SLURMD_NODENAME) must be expanded on each
    # node, so the recorder starts through `bash -c` and the command follows as "$@".
    node_shell = "exec " + " ".join(_shell_word(w) for w in recorder) + ' "$@"'
    lines = [
        "",
        f"{RECORDINGS_MARKER}{opts.recordings}",
        "set -eu",
        "# the torchdoctor every node runs (set TORCHDOCTOR to use another)",
        f'export TORCHDOCTOR="${{TORCHDOCTOR:-{opts.torchdoctor}}}"',
        f'export JOB_RECORDINGS={shlex.quote(str(opts.recordings))}/slurm-"$SLURM_JOB_ID"',
        'mkdir -p "$JOB_RECORDINGS"',
        "# a copy of this script beside the recordings: `slurm status` reads what was asked",
        'cp "$0" "$JOB_RECORDINGS/job.sbatch"',
        "",
        "# rendezvous on the allocation's first node, on a port derived from the job id",
        'nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))',
        "head=${nodes[0]}",
        f"port=$(( {PORT_BASE} + SLURM_JOB_ID % {PORT_SPAN} ))",
        "",
        f"# threads per rank: {size.threads_per_rank.source}",
        f"export OMP_NUM_THREADS={size.threads_per_rank.value}",
        "# CUDA numbers GPUs as Slurm and NVML do; CUDA_VISIBLE_DEVICES is Slurm's to set",
        "export CUDA_DEVICE_ORDER=PCI_BUS_ID",
    ]
    if size.network_env:
        lines.append(
            "# network: which interface the ranks use (check on a node: torchdoctor doctor)"
        )
        for key, figure in sorted(size.network_env.items()):
            lines.append(f"# {key}: {figure.source}")
            lines.append(f"export {key}={shlex.quote(str(figure.value))}")
    lines += [
        "",
        f"# {ranks} rank{'s' if ranks != 1 else ''} per node: {size.ranks_per_node.source}",
        "# -c again on srun: since 22.05 srun does not inherit --cpus-per-task",
        'srun --ntasks-per-node=1 -c "$SLURM_CPUS_PER_TASK" --kill-on-bad-exit=1 \\',
        f"  bash -c {shlex.quote(node_shell)} node \\",
        "  " + " ".join(torchrun) + " \\",
        "  " + " ".join(shlex.quote(a) for a in script_args),
    ]
    return lines


def _shell_word(word: str) -> str:
    """A word of the node's `bash -c` line: our "$VAR" expansions kept, the rest quoted."""
    return word if word.startswith('"$') else shlex.quote(word)
