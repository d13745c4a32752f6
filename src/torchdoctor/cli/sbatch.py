"""`torchdoctor sbatch --from REC -- CMD`: a Slurm script sized from a recording; --submit."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import click

from torchdoctor.cli.common import job_name
from torchdoctor.cli.force import force_option
from torchdoctor.cli.json_output import dump_json
from torchdoctor.cli.parsing import WrapperCommand
from torchdoctor.cli.recordings import RECORDING
from torchdoctor.errors import UserError
from torchdoctor.output_files import check_output_file, write_output_file
from torchdoctor.recording.paths import prepare_folder, runs_dir
from torchdoctor.sizing.network import doctor_network_env
from torchdoctor.sizing.recorded import read_recorded_job
from torchdoctor.sizing.size import JobRequest, size_job
from torchdoctor.slurm import client
from torchdoctor.slurm.notation import require_duration
from torchdoctor.slurm.script import (
    ScriptOptions,
    check_name,
    check_recordings_folder,
    job_folder,
    render_script,
)
from torchdoctor.units import fmt_duration


@click.command(
    "sbatch",
    cls=WrapperCommand,
)
@click.option(
    "--from",
    "recording",
    type=RECORDING,
    default=None,
    metavar="RECORDING",
    help="Recording of this job (from `torchdoctor run`; `last`: the newest) to size the "
    "request from.",
)
@click.option("--nodes", type=int, default=1, show_default=True, metavar="N")
@click.option(
    "--gpus-per-node",
    type=int,
    default=None,
    metavar="G",
    help="GPUs (and ranks) per node (default: the GPUs the recorded run used).",
)
@click.option(
    "--ranks-per-node",
    type=int,
    default=None,
    metavar="R",
    help="Ranks per node for CPU jobs (default: one per GPU, else as recorded).",
)
@click.option("--gpu-type", default=None, metavar="TYPE", help="GPU gres type, e.g. a100.")
@click.option(
    "--time",
    "time_text",
    default="auto",
    show_default=True,
    metavar="auto|TIME",
    help="Time limit, e.g. 90m, 1h30m, 01:30:00 (a bare number is refused: Slurm reads it as "
    "minutes); auto: measured step time x steps, plus margin.",
)
@click.option(
    "--steps",
    type=int,
    default=None,
    metavar="K",
    help="Steps the job will run, for --time auto (default: as many as recorded).",
)
@click.option("--partition", default=None, metavar="P")
@click.option("--account", default=None, metavar="A")
@click.option("--job-name", default=None, metavar="NAME", help="Default: from the command.")
@click.option(
    "--signal-checkpoint",
    is_flag=True,
    help="Have Slurm send SIGUSR1 to every rank 90 s before the time limit (--signal=USR1@90).",
)
@click.option(
    "--recordings",
    type=click.Path(file_okay=False),
    default=None,
    metavar="DIR",
    help="Folder (shared by the nodes) for the job's output and its slurm-<id>/ recordings "
    "(default: the recordings folder, $TORCHDOCTOR_RUNS_DIR or ./torchdoctor-runs).",
)
@click.option(
    "-o",
    "--out",
    type=click.Path(dir_okay=False),
    default=None,
    metavar="FILE",
    help="Write the script here (default: stdout; with --submit, DIR/<name>.sbatch).",
)
@force_option("the -o file")
@click.option(
    "--doctor",
    "doctor_json",
    type=click.Path(dir_okay=False, exists=True),
    default=None,
    metavar="FILE",
    help="`torchdoctor doctor --json` output from a cluster node: its network fixes "
    "(NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME) go into the script.",
)
@click.option("--submit", is_flag=True, help="Submit with `sbatch --parsable`; print the job id.")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print the script, where it went and the job id as JSON.",
)
@click.argument("argv", nargs=-1, required=True, type=click.UNPROCESSED, metavar="-- CMD [ARGS]...")
def command(
    recording: str | None,
    nodes: int,
    gpus_per_node: int | None,
    ranks_per_node: int | None,
    gpu_type: str | None,
    time_text: str,
    steps: int | None,
    partition: str | None,
    account: str | None,
    job_name: str | None,
    signal_checkpoint: bool,
    recordings: str | None,
    out: str | None,
    force: bool,
    doctor_json: str | None,
    submit: bool,
    as_json: bool,
    argv: tuple[str, ...],
) -> None:
    """Write an sbatch script for CMD, sized from its recording: memory, CPUs, GPUs, time.

    Without --from, the recording of the local queue's last successful run of exactly this
    command is used.

    Each figure is commented in the script with where it came from. Every node runs its
    torchrun under torchdoctor's recorder, one recording per node in DIR/slurm-<job id>/,
    which `torchdoctor diagnose` and `torchdoctor slurm status JOBID` read afterwards.
    """
    args = list(argv)
    # Every value bound for an #SBATCH line is checked before anything is read or asked of
    # Slurm (a newline in --partition made the rest of the value a command in the script).
    for value, option in (
        (partition, "--partition"),
        (account, "--account"),
        (gpu_type, "--gpu-type"),
    ):
        if value is not None:
            check_name(value, option)
    name = _job_name(job_name, args)
    folder = check_recordings_folder(runs_dir(recordings).resolve())
    time_limit_s = None if time_text == "auto" else require_duration(time_text, "--time")
    if steps is not None and steps < 1:
        raise UserError(f"--steps {steps}: give the number of steps the job runs (1 or more)")
    path = Path(out) if out else folder / f"{name}.sbatch" if submit else None
    if out is not None:  # checked now, not after sizing; the default place once it exists
        check_output_file(out, "-o", force=force, ours=is_sbatch_script)
    recording = recording or _last_recording_of(args)
    request = JobRequest(
        command=args,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        ranks_per_node=ranks_per_node,
        time_limit_s=time_limit_s,
        steps=steps,
        gpu_type=gpu_type,
        network_env=doctor_network_env(doctor_json) if doctor_json else {},
        node_cpus=client.largest_node_cpus(partition),
    )
    recorded = read_recorded_job(recording)
    size = size_job(recorded, request)
    opts = ScriptOptions(
        command=args,
        job_name=name,
        recordings=folder,
        torchdoctor=_torchdoctor_executable(),
        source=_source_line(recorded),
        partition=partition,
        account=account,
        signal_checkpoint=signal_checkpoint,
        cluster_gpu_types=client.cluster_gpu_types() if size.gpus_per_node.value else (),
    )
    text = render_script(size, opts)
    for note in size.notes:
        click.echo(f"torchdoctor: warning: {note}", err=True)
    if out is None and not submit:
        if as_json:
            dump_json("sbatch", _document(text, None, None, size.notes))
        else:
            click.echo(text, nl=False)
        return
    prepare_folder(folder, "--recordings")  # sbatch writes the job's output there
    assert path is not None  # out or submit
    # Executable when torchdoctor creates it; a file replaced with --force keeps its mode.
    write_output_file(path, text, "-o", force=force, ours=is_sbatch_script, mode=0o755)
    click.echo(f"torchdoctor: wrote {path}", err=True)
    job_id = client.submit(path) if submit else None
    if as_json:
        dump_json("sbatch", _document(text, path, job_id, size.notes))
    elif job_id is not None:
        click.echo(job_id)
    if job_id is not None:
        click.echo(
            f"torchdoctor: submitted job {job_id}; recordings go to {job_folder(folder, job_id)}; "
            f"follow it with `torchdoctor slurm status {job_id}`",
            err=True,
        )


def _document(text: str, path: Path | None, job_id: str | None, notes: list[str]) -> dict:
    return {
        "script": text,
        "path": str(path) if path else None,
        "job_id": job_id,
        "notes": list(notes),
    }


def _last_recording_of(argv: list[str]) -> str:
    """Without --from: the recording of the local queue's last successful run of this command."""
    from torchdoctor.queue.client import last_run_of

    job = last_run_of(argv)
    if job is not None and job.recording and Path(job.recording).exists():
        click.echo(
            f"torchdoctor: sizing from the queue's last run of it: {job.recording}", err=True
        )
        return job.recording
    raise UserError(
        "no recording to size the job from: give --from RECORDING (record it first with "
        f"`torchdoctor run -- {' '.join(argv)}`, or run it once with `torchdoctor submit`)"
    )


def _job_name(given: str | None, argv: list[str]) -> str:
    return check_name(given or job_name(argv), "--job-name")


def is_sbatch_script(head: bytes) -> bool:
    """Whether a file starting with ``head`` is a script this command wrote."""
    return head.startswith(b"#!/bin/bash\n# Written by `torchdoctor sbatch`")


def _torchdoctor_executable() -> str:
    """This torchdoctor, by absolute path: the nodes run the same one (on a shared file system)."""
    beside = Path(sys.executable).parent / "torchdoctor"
    if beside.exists():
        return str(beside)
    return shutil.which("torchdoctor") or "torchdoctor"


def _source_line(job) -> str:
    status = "" if job.exit_status is None else f", exit {job.exit_status}"
    where = f" on {job.hostname}" if job.hostname else ""
    return (
        f"recording {job.path} (`{' '.join(job.command)}`{where}, "
        f"{fmt_duration(job.duration_s)}{status})"
    )
