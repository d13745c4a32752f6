"""`torchdoctor attach PID`: record a running process tree until it exits or Ctrl-C."""

from __future__ import annotations

import os

import click

from torchdoctor.cli.common import (
    check_interval,
    interval_option,
    out_option,
    stderr_console,
    thresholds_option,
)
from torchdoctor.errors import UserError
from torchdoctor.run.attach import look_inside
from torchdoctor.run.process import hold_signals, release_signals, wait_for_signal
from torchdoctor.run.session import RecordingSession, claim_file
from torchdoctor.sampling.procfs import parse_cmdline, parse_environ, read_path
from torchdoctor.units import one_line


@click.command("attach")
@click.argument("pid", type=int)
@interval_option
@out_option
@click.option("--quiet", is_flag=True, help="Print nothing of our own (errors aside).")
@thresholds_option
def command(
    pid: int, interval: float, out: str | None, quiet: bool, thresholds: str | None
) -> None:
    """Record the running process PID and all its descendants until it exits or Ctrl-C.

    Its steps and data wait are seen by sampling its main thread's Python stack from outside
    (py-spy, read-only: the job is never stopped); where that is not allowed one line says why
    and only the process tree is recorded. PyTorch settings are not seen (start the job with
    `torchdoctor run` or use torchdoctor.watch() for those).
    """
    check_interval(interval)
    if pid <= 0 or not os.path.exists(f"/proc/{pid}"):
        raise UserError(f"no such process: {pid} (check the PID with `ps` or `torchdoctor top`)")
    if _kernel_thread(pid):
        raise UserError(
            f"PID {pid} is a kernel thread, not a job: attach to the Python process that "
            "trains (`torchdoctor top` or `ps` shows it)"
        )
    argv = _cmdline(pid) or [f"pid-{pid}"]
    path = claim_file(out, f"pid{pid}-{os.path.basename(argv[0])}")
    console = stderr_console()
    if not quiet:
        console.print(
            f"torchdoctor: recording PID {pid} ({one_line(argv, 80)}) into {path}; Ctrl-C stops."
        )
    held = hold_signals()
    try:
        session = RecordingSession(
            path,
            mode="attach",
            command=argv,
            interval=interval,
            env=_process_env(pid),
            instrumented=False,
            root_pid=pid,
            host_pid=pid,
        )
        session.start_recorder(pid)
        inside = look_inside(pid, session.writer, _say(console, quiet))
        session.announce(pid)
        stopped_by = None
        while session.job_alive():
            signum = wait_for_signal(min(interval, 0.5))
            if signum is not None:
                stopped_by = signum
                break
        inside.stop()
        session.end(None, stopped_by_signal=stopped_by)
    finally:
        release_signals(held)
    if not quiet:
        session.end_report(console, thresholds)


def _kernel_thread(pid: int) -> bool:
    from torchdoctor.sampling.procfs import is_kernel_thread

    try:
        return is_kernel_thread(pid)
    except (OSError, ValueError, IndexError):  # gone, or a stat file cut short: attach says so
        return False


def _cmdline(pid: int) -> list[str]:
    try:
        return parse_cmdline(read_path(f"/proc/{pid}/cmdline"))
    except OSError:
        return []


def _process_env(pid: int) -> dict[str, str]:
    """The job's own environment where we may read it (our own processes), else ours."""
    try:
        raw = read_path(f"/proc/{pid}/environ", 65536)
    except OSError:
        return dict(os.environ)
    return parse_environ(raw, None)


def _say(console, quiet: bool):
    """One unwrapped line on stderr (a refusal must stay one line), nothing when quiet."""
    if quiet:
        return lambda _line: None
    return lambda line: console.print(line, soft_wrap=True)
