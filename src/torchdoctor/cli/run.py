"""`torchdoctor run -- CMD ARGS...`: run a command and record everything it uses."""

from __future__ import annotations

from pathlib import Path

import click

from torchdoctor.cli.common import (
    check_interval,
    interval_option,
    job_name,
    out_option,
    stderr_console,
    thresholds_option,
)
from torchdoctor.run.end_report import print_end_report
from torchdoctor.run.process import resolve_command
from torchdoctor.run.session import claim_file, record_command


@click.command(
    "run",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@interval_option
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
@click.argument("argv", nargs=-1, required=True, type=click.UNPROCESSED, metavar="-- CMD [ARGS]...")
@click.pass_context
def command(
    ctx: click.Context,
    interval: float,
    out: str | None,
    quiet: bool,
    no_instrument: bool,
    thresholds: str | None,
    prometheus: str | None,
    tensorboard: str | None,
    argv: tuple[str, ...],
) -> None:
    """Run CMD, record the job it starts, and exit with CMD's own exit status.

    CMD runs without a shell with your stdin, stdout and stderr. SIGINT, SIGTERM and SIGHUP
    sent to torchdoctor are passed on. When CMD ends, a summary and the findings are printed
    on stderr.
    """
    check_interval(interval)
    outputs = _output_options(prometheus, tensorboard)
    args = list(argv)
    executable = resolve_command(args)
    path = claim_file(out, job_name(args))
    console = stderr_console()
    status = record_command(
        executable,
        args,
        path,
        interval,
        instrument=not no_instrument,
        start_outputs=(lambda: _start_outputs(path, outputs, quiet)) if outputs else None,
    )
    if not quiet:
        print_end_report(path, console, thresholds)
    ctx.exit(status)


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
