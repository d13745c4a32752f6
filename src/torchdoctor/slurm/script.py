"""The sbatch script: the DDP shape that works on Slurm, sized figures with their sources.

Shape (torchtitan's and TorchX's): one task per node; ``--gpus-per-node`` (never
``--gpus-per-task``, which binds one GPU per task and hides the others from NCCL's NVLink
detection); ``srun -c`` given explicitly (22.05 stopped passing ``--cpus-per-task`` on to srun);
one torchrun per node (started by ``torchdoctor launch``) meeting on the first node of the
allocation, on a port derived from the job id so two jobs sharing a node do not collide;
``OMP_NUM_THREADS`` per rank (Slurm sets none); ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so CUDA
numbers GPUs as Slurm does; and ``CUDA_VISIBLE_DEVICES`` left to Slurm.

Every node runs under torchdoctor's recorder, which writes one recording per node into the
job's folder: ``torchdoctor diagnose FOLDER`` and ``torchdoctor slurm status JOBID`` read them.
"""

from __future__ import annotations

import re
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

from torchdoctor.errors import UserError
from torchdoctor.sampling.roles import is_python
from torchdoctor.sizing.command import torchrun_invocation
from torchdoctor.sizing.size import JobSize
from torchdoctor.slurm.notation import format_duration, format_memory
from torchdoctor.units import fmt_bytes

# The marker `slurm status` reads back (from the spooled script) to find the job's recordings.
RECORDINGS_MARKER = "# torchdoctor-recordings: "
# Seconds before the time limit that Slurm signals the job, so it can checkpoint.
CHECKPOINT_SIGNAL = "USR1@90"
PORT_BASE, PORT_SPAN = 20000, 40000


# Characters an #SBATCH value cannot hold: sbatch reads the line word by word (a space ends the
# value, quotes and backslashes are its own syntax, # starts a comment), and a newline ends the
# directive: what follows it is a shell command in the job script, and sbatch stops reading
# directives at the first line that is not one, so every later #SBATCH line is dropped.
_NOT_IN_A_DIRECTIVE = frozenset("\"'#\\")
_VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def fits_a_directive(value: str) -> bool:
    """Whether ``value`` can stand as it is after ``#SBATCH --option=``."""
    return bool(value) and not any(
        c.isspace() or not c.isprintable() or c in _NOT_IN_A_DIRECTIVE for c in value
    )


def check_name(value: str, option: str) -> str:
    """``value`` (a partition, account, job or GPU type name) when it fits an #SBATCH line;
    otherwise one line naming ``option``."""
    if not fits_a_directive(value):
        raise UserError(f"{option} {value!r}: give one name without spaces or newlines")
    return value


def check_recordings_folder(folder: Path, option: str = "--recordings") -> Path:
    """``folder`` when its path fits the script's ``#SBATCH --output`` line and marker comment."""
    if not fits_a_directive(str(folder)):
        raise UserError(
            f"{option} {str(folder)!r}: the job's output folder goes into an #SBATCH line, which "
            "cannot hold spaces, quotes, # or newlines; choose a folder whose path has none"
        )
    return folder


def comment(text: str) -> str:
    """``text`` safe inside a ``#`` comment line: a newline or other control character in a
    recorded command (``python -c`` code) would end the comment and run the rest."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


@dataclass(slots=True)
class ScriptOptions:
    """What the script needs besides the sizes; every value that goes into an #SBATCH line is
    checked when the options are made."""

    command: list[str]
    job_name: str
    recordings: Path  # absolute; the job writes into <recordings>/slurm-<job id>/
    torchdoctor: str  # the torchdoctor executable the nodes run
    source: str  # one line: the recording the sizes come from
    partition: str | None = None
    account: str | None = None
    signal_checkpoint: bool = False
    cluster_gpu_types: tuple[str, ...] = ()  # gres the cluster names, for the GPU hint

    def __post_init__(self) -> None:
        check_name(self.job_name, "--job-name")
        for value, option in ((self.partition, "--partition"), (self.account, "--account")):
            if value is not None:
                check_name(value, option)
        check_recordings_folder(self.recordings)


def job_folder(recordings: Path, job_id: str) -> Path:
    """Where a job's recordings (one per node) and its script copy go."""
    return recordings / f"slurm-{job_id}"


def node_command(command: list[str], ranks: int) -> tuple[str, list[str], str]:
    """How each node starts the job under the recorder - the one place this is chosen.

    Returns the ``bash -c`` line run on each node, the words after it (the user's command,
    reaching that line as "$@"), and a comment saying what runs. srun runs no shell, so what
    differs per node ($SLURM_NODEID, $SLURMD_NODENAME) is expanded there, by that bash.

    A Python script or module goes through ``torchdoctor launch``: torchrun with every rank
    recorded and instrumented, one recording per node in the job's folder, rendezvous on the
    first node (launch's static one: node rank $SLURM_NODEID). Anything else runs as
    ``torchdoctor run -- torchrun --no-python CMD`` with a c10d rendezvous there.
    """
    if is_python(command[0]) and torchdoctor_has("launch"):
        script = command[1:]
        torchrun_invocation(command)  # the same checks: a script or -m module after python
        line = (
            'exec "$TORCHDOCTOR" launch --out "$JOB_RECORDINGS" --nnodes "$SLURM_NNODES" '
            '--node-rank "$SLURM_NODEID" --master-addr "$MASTER_ADDR" '
            f'--master-port "$MASTER_PORT" --nproc-per-node {ranks} -- "$@"'
        )
        return line, script, "torchdoctor launch: torchrun with every rank recorded"
    launcher, rest = torchrun_invocation(command)
    line = (
        'exec "$TORCHDOCTOR" run --out "$JOB_RECORDINGS/$SLURMD_NODENAME.sqlite" -- '
        + " ".join(shlex.quote(w) for w in launcher)
        + f' --nnodes "$SLURM_NNODES" --nproc-per-node {ranks} --rdzv-backend c10d'
        ' --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$SLURM_JOB_ID" "$@"'
    )
    return line, rest, "torchdoctor run around torchrun: every rank recorded"


def torchdoctor_has(command: str) -> bool:
    """Whether this torchdoctor has a command (the CLI's modules appear as they are built)."""
    import importlib.util

    return importlib.util.find_spec(f"torchdoctor.cli.{command}") is not None


def render_script(size: JobSize, opts: ScriptOptions) -> str:
    """The whole script text."""
    lines = [
        "#!/bin/bash",
        f"# Written by `torchdoctor sbatch` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        f"# Sized from {comment(opts.source)}.",
        "# Sizes are per node: one task per node runs torchrun, which starts the ranks.",
    ]
    lines += [f"# NOTE: {comment(note)}" for note in size.notes]
    lines += _sbatch_lines(size, opts)
    lines += _body(size, opts)
    return "\n".join(lines) + "\n"


def _sbatch_lines(size: JobSize, opts: ScriptOptions) -> list[str]:
    out: list[str] = []

    def opt(text: str, why: str | None = None) -> None:
        # sbatch reads an #SBATCH line's whole remainder as the option: comments go above.
        if why:
            out.append(f"# {comment(why)}")
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
        kind = f"{check_name(size.gpu_type, '--gpu-type')}:" if size.gpu_type else ""
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
    node_line, node_args, what = node_command(opts.command, ranks)
    lines = [
        "",
        f"{RECORDINGS_MARKER}{opts.recordings}",
        "set -eu",
        "# the torchdoctor every node runs (set TORCHDOCTOR to use another)",
        f'export TORCHDOCTOR="${{TORCHDOCTOR:-{_in_double_quotes(opts.torchdoctor)}}}"',
        f'export JOB_RECORDINGS={shlex.quote(str(opts.recordings))}/slurm-"$SLURM_JOB_ID"',
        'mkdir -p "$JOB_RECORDINGS"',
        "# a copy of this script beside the recordings: `slurm status` reads what was asked",
        'cp "$0" "$JOB_RECORDINGS/job.sbatch"',
        "",
        "# rendezvous on the allocation's first node, on a port derived from the job id",
        'nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))',
        "export MASTER_ADDR=${nodes[0]}",
        f"export MASTER_PORT=$(( {PORT_BASE} + SLURM_JOB_ID % {PORT_SPAN} ))",
        "",
        f"# threads per rank: {comment(size.threads_per_rank.source)}",
        f"export OMP_NUM_THREADS={size.threads_per_rank.value}",
        "# CUDA numbers GPUs as Slurm and NVML do; CUDA_VISIBLE_DEVICES is Slurm's to set",
        "export CUDA_DEVICE_ORDER=PCI_BUS_ID",
    ]
    if opts.signal_checkpoint:
        lines += [
            "# torchrun passes SIGUSR1 on to the ranks instead of dying of it (PET_*: its options)",
            "export PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
        ]
    if size.network_env:
        lines.append(
            "# network: which interface the ranks use (check on a node: torchdoctor doctor)"
        )
        for key, figure in sorted(size.network_env.items()):
            if not _VARIABLE.fullmatch(key):
                # A recorded environment can hold any name; bash exports only identifiers,
                # and an unquoted name is shell code.
                lines.append(f"# {comment(key)}: left out, not a variable name bash exports")
                continue
            lines.append(f"# {key}: {comment(figure.source)}")
            lines.append(f"export {key}={shlex.quote(str(figure.value))}")
    lines += [
        "",
        f"# {ranks} rank{'s' if ranks != 1 else ''} per node: {comment(size.ranks_per_node.source)}",
        f"# each node: {what}",
        "# -c again on srun: since 22.05 srun does not inherit --cpus-per-task",
        'srun --ntasks-per-node=1 -c "$SLURM_CPUS_PER_TASK" --kill-on-bad-exit=1 \\',
        f"  bash -c {shlex.quote(node_line)} node \\",
        "  " + " ".join(shlex.quote(a) for a in node_args),
    ]
    return lines


def _in_double_quotes(text: str) -> str:
    """``text`` as it reads literally inside bash's double quotes."""
    return "".join("\\" + c if c in '"$`\\' else c for c in text)
