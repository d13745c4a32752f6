"""`torchdoctor profile JOB --steps N`: profile a few steps of a job being recorded now."""

from __future__ import annotations

import click

from torchdoctor.cli.common import stderr_console
from torchdoctor.cli.recordings import RECORDING
from torchdoctor.units import fmt_bytes


@click.command("profile")
@click.argument("job", type=RECORDING, metavar="JOB")
@click.option(
    "--steps",
    type=int,
    default=5,
    show_default=True,
    help="Active steps to profile (at most 50), after one warm-up step.",
)
@click.option(
    "--wait/--no-wait",
    default=True,
    show_default=True,
    help="Wait for the window to end and say where its trace is.",
)
@click.option(
    "--timeout",
    type=float,
    default=300.0,
    show_default=True,
    metavar="SECONDS",
    help="How long --wait waits.",
)
def command(job: str, steps: int, wait: bool, timeout: float) -> None:
    """Profile N steps of JOB with torch.profiler, without restarting it.

    JOB is the recording of a job that `run`, `launch` or the queue is recording now (a path,
    `last`), or the PID `torchdoctor top` shows for it. Every process of the job starts its
    window at the same step, a few seconds of steps ahead; the traces go next to the recording
    (<recording>.profile/) and `diagnose` reads them.
    """
    from torchdoctor.run.profile_request import job_recording, request_window, wait_for_windows

    console = stderr_console()
    recording = job_recording(job)
    request = request_window(recording, steps)
    console.print(
        f"torchdoctor: asked {recording} for a profiler window of steps "
        f"{request.first_step}-{request.last_step} (a step takes {request.step_s * 1e3:.1f} ms)"
    )
    if not wait:
        return
    windows = wait_for_windows(request, timeout)
    if not windows:
        raise click.ClickException(
            f"no window ended within {timeout:.0f} s: the job may have ended or stopped "
            "stepping; `torchdoctor show` says what the recording holds"
        )
    for window in windows:
        who = f"rank {window.rank}" if window.rank is not None else f"pid {window.pid}"
        if window.trace_path is None:
            console.print(f"torchdoctor: {who}: no trace ({window.reason})")
            continue
        size = fmt_bytes(window.trace_bytes or 0)
        line = f"torchdoctor: {who}: steps {window.first_step}-{window.last_step} {window.state}"
        console.print(f"{line}, {size}: {window.trace_path}")
        if window.reason:
            console.print(f"  {window.reason}")
