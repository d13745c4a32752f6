"""`torchdoctor handoff --to slurm|ray|trainjob|pytorchjob|job -- CMD`: the job handed to
another engine, sized from its recording; `torchdoctor handoff status ray:ID`.

One sizing (``torchdoctor.sizing``) for every target; the target only renders it. ``--to
slurm`` is `torchdoctor sbatch` itself, with the same options.
"""

from __future__ import annotations

import os
from typing import Any

import click

from torchdoctor.cli import sbatch
from torchdoctor.cli.common import job_name as default_job_name
from torchdoctor.cli.json_output import dump_json
from torchdoctor.cli.parsing import WrapperCommand
from torchdoctor.errors import UserError
from torchdoctor.output_files import check_output_file, write_output_file
from torchdoctor.terminal import make_console
from torchdoctor.units import fmt_duration

TARGETS = ("slurm", "ray", "ray-train", "trainjob", "pytorchjob", "job")
KUBE = ("trainjob", "pytorchjob", "job")
_STATUS = "torchdoctor.handoff.status"
# Options that mean something for some targets only: said in one line when given to another.
ONLY_FOR: dict[str, tuple[str, ...]] = {
    "gpu_type": ("slurm",),
    "partition": ("slurm",),
    "account": ("slurm",),
    "signal_checkpoint": ("slurm",),
    "recordings": ("slurm", "ray", "ray-train"),
    "image": KUBE,
    "namespace": KUBE,
    "trainer_version": ("trainjob",),
    "runtime": ("trainjob",),
    "address": ("ray", "ray-train"),
}
_FLAG = {
    "gpu_type": "--gpu-type",
    "partition": "--partition",
    "account": "--account",
    "signal_checkpoint": "--signal-checkpoint",
    "recordings": "--recordings",
    "image": "--image",
    "namespace": "--namespace",
    "trainer_version": "--trainer-version",
    "runtime": "--runtime",
    "address": "--address",
}


class HandoffCommand(WrapperCommand):
    """``handoff [OPTIONS] -- CMD``, and ``handoff status TARGET:ID``: a first word ``status``
    (before any option or ``--``) reads a job back instead of handing one off."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args[:1] == ["status"]:
            ctx.meta[_STATUS] = args[1:]
            return []
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context) -> Any:
        if _STATUS in ctx.meta:
            return status_command.main(
                ctx.meta[_STATUS], prog_name="torchdoctor handoff status", standalone_mode=False
            )
        return super().invoke(ctx)


def _is_manifest(head: bytes) -> bool:
    """Whether a file starting with ``head`` is one this command wrote (replaced without
    --force, as sbatch replaces its own scripts)."""
    return any(
        head.startswith(first + b"# Written by `torchdoctor handoff")
        for first in (b"", b"#!/bin/sh\n", b"#!/usr/bin/env python\n")
    )


_SHARED = {"recording", "nodes", "gpus_per_node", "ranks_per_node", "gpu_type", "time_text"}
_SHARED |= {"steps", "partition", "account", "job_name", "signal_checkpoint", "recordings"}
_SHARED |= {"doctor_json", "submit", "as_json", "force"}


@click.command("handoff", cls=HandoffCommand)
@click.option(
    "--to",
    "target",
    type=click.Choice(TARGETS),
    required=True,
    help="Where the job goes: slurm (an sbatch script, as `torchdoctor sbatch`), ray (a Ray "
    "job: torchrun under torchdoctor launch, one per node), ray-train (a TorchTrainer file, "
    "opt-in), trainjob (Kubeflow Trainer v2), pytorchjob (training-operator 1.9), "
    "job (a batch/v1 Job, one node).",
)
@click.option(
    "--image",
    default=None,
    metavar="IMG",
    help="Container image with the script and torch (Kubernetes targets; required there).",
)
@click.option("--namespace", default=None, metavar="NS", help="Kubernetes namespace.")
@click.option(
    "--trainer-version",
    type=click.Choice(("2.2", "2.3")),
    default="2.3",
    show_default=True,
    help="Kubeflow Trainer release whose TrainJob schema to write.",
)
@click.option(
    "--runtime",
    default="torch-distributed",
    show_default=True,
    metavar="NAME",
    help="The ClusterTrainingRuntime a TrainJob refers to.",
)
@click.option(
    "--address",
    default=None,
    metavar="URL",
    help="Ray's job API (default: $RAY_ADDRESS when it is an http URL, else "
    "http://127.0.0.1:8265).",
)
@click.option(
    "-o",
    "--out",
    type=click.Path(dir_okay=False),
    default=None,
    metavar="FILE",
    help="Write the script or manifest here (default: stdout; slurm with --submit: "
    "DIR/<name>.sbatch).",
)
@click.pass_context
def command(ctx: click.Context, **params: Any) -> None:
    """Hand CMD to Slurm, Ray or Kubernetes, sized from its recording: cores, memory (recorded
    peak + margin), shared memory, GPUs, ranks, threads, time and the network settings
    `doctor` found, each figure commented with where it came from.

    Kubernetes manifests are checked strictly against the API models the projects publish
    (torchdoctor[kubernetes]); --to ray --submit submits to Ray's job API (torchdoctor[ray]).
    `torchdoctor handoff status ray:ID [--address URL] [--wait S] [--json]` shows a Ray job:
    state, driver exit code, asked vs used, and its recordings.
    """
    target: str = params["target"]
    _check_address(params["address"])
    for name, targets in ONLY_FOR.items():
        value = params.get(name)
        given = value not in (None, False) and (
            ctx.get_parameter_source(name) != click.core.ParameterSource.DEFAULT
        )
        if given and target not in targets:
            raise UserError(f"{_FLAG[name]} is for --to {' or '.join(targets)}, not --to {target}")
    if target == "slurm":
        ctx.invoke(
            sbatch.command,
            **{k: v for k, v in params.items() if k in _SHARED},
            out=params["out"],
            argv=params["argv"],
        )
        return
    if params["gpu_type"] is not None:
        raise UserError("--gpu-type is for --to slurm")
    _handoff(target, params)


# sbatch's own options (sizing, Slurm, -o/--force, --doctor, --submit, --json), then the argv.
command.params[1:1] = [p for p in sbatch.command.params if p.name in _SHARED and p.name != "force"]
command.params += [p for p in sbatch.command.params if p.name in ("force", "argv")]


def _handoff(target: str, params: dict[str, Any]) -> None:
    from torchdoctor.recording.paths import runs_dir
    from torchdoctor.sizing.network import doctor_network_env
    from torchdoctor.sizing.recorded import read_recorded_job
    from torchdoctor.sizing.size import JobRequest, size_job
    from torchdoctor.slurm.notation import require_duration

    args = list(params["argv"])
    out, force, submit = params["out"], params["force"], params["submit"]
    if target in KUBE and submit:
        raise UserError(
            f"--submit with --to {target}: torchdoctor reaches no Kubernetes cluster; write the "
            "manifest with -o FILE and apply it with `kubectl create -f FILE`"
        )
    if target in KUBE and not params["image"]:
        raise UserError(f"--to {target} needs --image IMG: the container image to run CMD in")
    time_text = params["time_text"]
    time_limit_s = None if time_text == "auto" else require_duration(time_text, "--time")
    if params["steps"] is not None and params["steps"] < 1:
        raise UserError(f"--steps {params['steps']}: give the number of steps the job runs")
    if out is not None:
        check_output_file(out, "-o", force=force, ours=_is_manifest)
    recording = params["recording"] or sbatch._last_recording_of(args)
    request = JobRequest(
        command=args,
        nodes=params["nodes"],
        gpus_per_node=params["gpus_per_node"],
        ranks_per_node=params["ranks_per_node"],
        time_limit_s=time_limit_s,
        steps=params["steps"],
        network_env=doctor_network_env(params["doctor_json"]) if params["doctor_json"] else {},
    )
    recorded = read_recorded_job(recording)
    size = size_job(recorded, request)
    name = params["job_name"] or default_job_name(args)
    source = sbatch._source_line(recorded)
    document: dict[str, Any] = {"target": target, "notes": list(size.notes)}
    if target in KUBE:
        text, notes = _kube_text(target, size, args, name, source, recorded, params)
    elif target == "ray-train":
        text, notes, spec, address, out = _ray_train_text(size, args, name, source, params, out)
        document["submission_id"] = spec.submission_id
    else:
        text, notes, spec, address = _ray_text(size, args, name, source, params, runs_dir)
        document["submission_id"] = spec.submission_id
        document["recordings"] = str(spec.recordings)
    document["notes"] += notes
    for note in size.notes + notes:
        click.echo(f"torchdoctor: warning: {note}", err=True)
    if out is not None:
        write_output_file(out, text, "-o", force=force, ours=_is_manifest)
        click.echo(f"torchdoctor: wrote {out}", err=True)
    document["text"], document["path"] = text, out
    if target in ("ray", "ray-train") and submit:
        from torchdoctor.handoff.ray_job import submit as submit_job

        job_id = submit_job(spec, address)
        document["job_id"] = job_id
        click.echo(
            f"torchdoctor: submitted Ray job {job_id}; recordings go to {spec.recordings}; follow "
            f"it with `torchdoctor handoff status ray:{job_id}`",
            err=True,
        )
        if not params["as_json"]:
            click.echo(job_id)
    if params["as_json"]:
        dump_json("handoff", document)
    elif out is None and not submit:
        click.echo(text, nl=False)


def _kube_text(
    target: str, size: Any, args: list[str], name: str, source: str, recorded: Any, params: dict
) -> tuple[str, list[str]]:
    from torchdoctor.handoff.kube import KubeOptions, check_label, label_from, render_manifest
    from torchdoctor.handoff.validate import EXTRA, models_available, validate_text

    label = (
        check_label(params["job_name"], "--job-name") if params["job_name"] else label_from(name)
    )
    opts = KubeOptions(
        target=target,
        name=label,
        image=params["image"],
        source=source,
        namespace=params["namespace"],
        trainer_version=params["trainer_version"],
        runtime=params["runtime"],
        num_workers=recorded.num_workers or 0,
    )
    manifest = render_manifest(size, args, opts)
    text = manifest.text
    notes = list(manifest.notes)
    if models_available():
        problems = validate_text(text)
        if problems:
            raise UserError(f"the manifest does not validate: {problems[0]}")
    else:
        notes.append(f"the manifest was not checked against the API models: {EXTRA}")
    return text, notes


def _ray_text(size: Any, args: list[str], name: str, source: str, params: dict, runs_dir: Any):
    from torchdoctor.handoff.ray_job import DEFAULT_ADDRESS, ray_spec, render_ray
    from torchdoctor.run.interpreter import find_job_python

    address = params["address"] or _ray_address()
    python = find_job_python(args).executable
    spec = ray_spec(
        size,
        args,
        torchdoctor=sbatch._torchdoctor_executable(),
        python=python,
        recordings_root=runs_dir(params["recordings"]).resolve(),
        name=name,
    )
    notes = []
    if address == DEFAULT_ADDRESS and params["address"] is None:
        notes.append(f"Ray's job API at {DEFAULT_ADDRESS} (give --address for another cluster)")
    return render_ray(spec, address, source, []), notes, spec, address


def _ray_train_text(
    size: Any, args: list[str], name: str, source: str, params: dict, out: str | None
):
    """The TorchTrainer file; with --submit it is written (-o, else beside the recordings) and
    submitted as a Ray job `python FILE`, whose workers reserve the sized resources."""
    import sys
    from pathlib import Path

    from torchdoctor.handoff.ray_job import RaySpec, new_submission_id
    from torchdoctor.handoff.ray_train import render_ray_train
    from torchdoctor.recording.paths import runs_dir

    text = render_ray_train(size, args, source, [])
    address = params["address"] or _ray_address()
    submission_id = new_submission_id(name)
    folder = runs_dir(params["recordings"]).resolve()
    if params["submit"] and out is None:
        folder.mkdir(parents=True, exist_ok=True)
        out = str(folder / f"{submission_id}.py")
    spec = RaySpec(
        entrypoint=[sys.executable, str(Path(out).resolve()) if out else "FILE"],
        num_cpus=0.0,
        num_gpus=0.0,
        memory=None,
        env_vars={},
        submission_id=submission_id,
        recordings=folder,
        reserve=False,
    )
    notes = ["--to ray-train: the ranks run in Ray Train's workers, not under the recorder"]
    return text, notes, spec, address, out


def _check_address(address: str | None) -> str | None:
    """--address as Ray's job client takes it: the dashboard's http(s) URL."""
    if address is not None and (
        not address.startswith(("http://", "https://"))
        or any(c.isspace() or not c.isprintable() for c in address)
    ):
        raise UserError(
            f"--address {address!r}: give the URL of Ray's job API, e.g. http://127.0.0.1:8265"
        )
    return address


def _ray_address() -> str:
    from torchdoctor.handoff.ray_job import DEFAULT_ADDRESS

    env = os.environ.get("RAY_ADDRESS", "")
    return env if env.startswith(("http://", "https://")) else DEFAULT_ADDRESS


@click.command("status")
@click.argument("job", metavar="ray:ID")
@click.option("--address", default=None, metavar="URL", help="Ray's job API.")
@click.option(
    "--wait",
    "wait_s",
    type=float,
    default=None,
    metavar="S",
    help="Wait up to S seconds for the job to end; exit with its driver's exit code.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def status_command(job: str, address: str | None, wait_s: float | None, as_json: bool) -> int:
    """State, driver exit code, asked vs used and the recordings of a job handed off."""
    import dataclasses

    from torchdoctor.handoff.ray_job import TERMINAL, check_submission_id, ray_report, wait

    kind, _, job_id = job.partition(":")
    if kind != "ray" or not job_id:
        raise UserError(
            f"{job!r}: give ray:ID (a Slurm job: `torchdoctor slurm status JOBID`; Kubernetes "
            "jobs: kubectl get trainjob|pytorchjob|job NAME)"
        )
    check_submission_id(job_id)
    url = _check_address(address) or _ray_address()
    if wait_s is not None:
        wait(url, job_id, wait_s)
    report = ray_report(url, job_id)
    s = report.state
    if as_json:
        dump_json("handoff-status", dataclasses.asdict(report))
    else:
        console = make_console(soft_wrap=True)
        exit_text = "" if s.driver_exit_code is None else f", driver exit {s.driver_exit_code}"
        console.print(f"ray:{s.submission_id}: {s.status}{exit_text}")
        if s.failing_rank:
            console.print(f"failed first: {s.failing_rank}")
        if s.error_type or s.message:
            console.print(f"message: {s.error_type or ''} {(s.message or '').splitlines()[0]}")
        if s.start_time and s.end_time:
            console.print(f"elapsed: {fmt_duration(s.end_time - s.start_time)}")
        console.print("asked vs used:")
        for figure, asked, used in report.asked_used:
            console.print(f"  {figure:<7} asked {asked:<12} used {used}")
        console.print(f"recordings: {s.recordings or 'none named'}")
        for r in report.recordings:
            findings = ", ".join(r.findings) or "no findings"
            console.print(
                f"  {r.path}: {r.hostname or '?'}, {r.ranks} ranks, exit {r.exit_status}; "
                f"{findings}"
            )
    if wait_s is not None:
        if s.status not in TERMINAL:
            raise UserError(f"ray:{job_id} is still {s.status} after {wait_s:g} s")
        return int(s.driver_exit_code or (0 if s.status == "SUCCEEDED" else 1))
    return 0
