"""`torchdoctor run -- CMD ARGS...`: run a command and record everything it uses."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import click

from torchdoctor.cli.common import (
    auto_profile_env,
    check_interval,
    interval_option,
    job_name,
    keep_option,
    no_auto_profile_option,
    out_option,
    profile_steps_env,
    stderr_console,
    thresholds_option,
)
from torchdoctor.cli.parsing import WrapperCommand
from torchdoctor.instrument.agent.cuda import ENV_MEMORY_HISTORY
from torchdoctor.run.end_report import print_end_report
from torchdoctor.run.process import resolve_command
from torchdoctor.run.session import claim_file, record_command
from torchdoctor.units import shell_line


@click.command(
    "run",
    cls=WrapperCommand,
)
@interval_option
@keep_option
@out_option
@click.option("--quiet", is_flag=True, help="Print nothing of our own (errors aside).")
@click.option(
    "--no-instrument",
    is_flag=True,
    help="Do not inject the in-process instrumentation (no steps, data wait or settings).",
)
@thresholds_option
@click.option(
    "--prometheus",
    metavar="[ADDR:]PORT",
    default=None,
    help="Serve the job's metrics for Prometheus on ADDR:PORT (ADDR defaults to 127.0.0.1).",
)
@click.option(
    "--tensorboard",
    metavar="DIR",
    default=None,
    help="Write TensorBoard scalars during the run into DIR/<recording name>/.",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="When CMD ends, print the recording's summary line and findings as one line of JSON "
    "on stdout, on a line of its own after CMD's own output (`tail -n 1` reads it).",
)
@click.option(
    "--memory-history",
    is_flag=True,
    help="Record CUDA allocations (torch.cuda.memory._record_memory_history) and write the "
    "memory snapshot next to the recording at a CUDA out-of-memory error "
    "(<recording>.cuda-oom-<pid>.pickle), else when the process ends "
    "(<recording>.cuda-memory-<pid>.pickle): diagnose and show say what was live at the peak "
    "by line and phase; pytorch.org/memory_viz opens them.",
)
@click.option(
    "--profile-steps",
    metavar="A-B",
    default=None,
    help="Profile steps A to B with torch.profiler (one warm-up step before, at most 50 steps; "
    "A >= 3): the trace goes next to the recording (<recording>.profile/rank<R>-steps<A>-<B>"
    ".pt.trace.json.gz) and those steps leave the step figures.",
)
@no_auto_profile_option
@click.argument("argv", nargs=-1, required=True, type=click.UNPROCESSED, metavar="-- CMD [ARGS]...")
@click.pass_context
def command(
    ctx: click.Context,
    interval: float,
    keep: str,
    out: str | None,
    quiet: bool,
    no_instrument: bool,
    thresholds: str | None,
    prometheus: str | None,
    tensorboard: str | None,
    as_json: bool,
    memory_history: bool,
    profile_steps: str | None,
    no_auto_profile: bool,
    argv: tuple[str, ...],
) -> None:
    """Run CMD, record the job it starts, and exit with CMD's own exit status.

    CMD runs without a shell with your stdin, stdout and stderr. SIGINT, SIGTERM and SIGHUP
    sent to torchdoctor are passed on; one sent to the whole process group (Ctrl-C, timeout)
    reaches CMD once. When CMD ends, a summary and the findings are printed on stderr.
    """
    check_interval(interval)
    profile_env = {
        **profile_steps_env(profile_steps, no_instrument),
        **auto_profile_env(no_auto_profile),
    }
    outputs = _output_options(prometheus, tensorboard)
    args = list(argv)
    executable = resolve_command(args)
    path = claim_file(out, job_name(args))
    console = stderr_console()
    if not quiet:
        console.print(f"torchdoctor: recording {shell_line(args)} into {path}")
    env = None
    if memory_history:
        template = f"{path.with_suffix('')}.cuda-{{what}}-{{pid}}.pickle"
        env = {**os.environ, ENV_MEMORY_HISTORY: template}
    if profile_env:
        env = {**(env or os.environ), **profile_env}
    status = record_command(
        executable,
        args,
        path,
        interval,
        instrument=not no_instrument,
        env=env,
        start_outputs=(lambda: _start_outputs(path, outputs, quiet)) if outputs else None,
        keep=keep,
        say=(lambda line: None) if quiet else console.print,
    )
    try:
        if not quiet or as_json:
            report = print_end_report(path, None if quiet else console, thresholds)
            if report is not None:
                from torchdoctor.cli.recordings import line_of, remember

                remember(path, line_of(path, *report))  # `torchdoctor ls` need not redo it
            if as_json:
                _print_json(path, status, report)
    except Exception as exc:  # noqa: BLE001 - the job has ended: its status is what we return
        click.echo(f"torchdoctor: internal error after the job ended ({exc!r})", err=True)
    ctx.exit(status)


def _print_json(path: Path, status: int, report) -> None:
    from torchdoctor.cli.json_output import dump_json
    from torchdoctor.cli.recordings import line_of
    from torchdoctor.diagnosis.render import findings_to_dict

    document: dict = {"recording": str(path), "exit_status": status}
    if report is not None:
        summary, findings = report
        line = line_of(path, summary, findings)
        document.update(
            command=line.command,
            started_at=line.started_at,
            duration_s=line.duration_s,
            status=line.status,
            steps_per_s=line.steps_per_s,
            worst_finding=line.worst_finding,
            worst_severity=line.worst_severity,
            findings=findings_to_dict(findings)["findings"],
        )
    if not _stdout_ends_a_line():
        click.echo("")  # the JSON on a line of its own: `tail -n 1` reads it
    dump_json("run", document, indent=None)


def _stdout_ends_a_line() -> bool:
    """Whether the job's output so far ends with a newline (or is empty). Only a regular file
    can be read back; what went into a pipe or a terminal cannot, so there the JSON always
    starts on a new line (an empty line where the job's output did end one)."""
    try:
        sys.stdout.flush()
        fd = sys.stdout.fileno()
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return False
        if info.st_size == 0:
            return True
        # Opened anew for reading: stdout itself is write-only (`> file`).
        with open(f"/proc/self/fd/{fd}", "rb") as written:
            written.seek(info.st_size - 1)
            return written.read(1) == b"\n"
    except (OSError, ValueError):
        return False


def _output_options(prometheus: str | None, tensorboard: str | None):
    """--prometheus / --tensorboard checked before anything starts; None when neither is set."""
    if prometheus is None and tensorboard is None:
        return None
    from torchdoctor.exporters.run_outputs import check_options

    return check_options(prometheus, tensorboard)


def _start_outputs(path: Path, outputs, quiet: bool):
    """The Prometheus endpoint and TensorBoard writer, in this (the recorder) process."""
    if outputs is None:
        return None
    from torchdoctor.exporters.run_outputs import RunOutputs

    return RunOutputs(path, outputs, quiet=quiet)
