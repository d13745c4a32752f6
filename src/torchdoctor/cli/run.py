"""`torchdoctor run -- CMD ARGS...`: run a command and record everything it uses."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import click

from torchdoctor.cli.common import (
    check_interval,
    default_recording_path,
    interval_option,
    job_name,
    out_option,
    print_end_report,
    stderr_console,
    thresholds_option,
)
from torchdoctor.launcher import ChildProcess, hold_signals, release_signals, resolve_command
from torchdoctor.recording import RecordingWriter, prepare_output
from torchdoctor.recording.metadata import run_metadata
from torchdoctor.recording.recorder import Recorder
from torchdoctor.sampling.sampler import Sampler


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
    path = prepare_output(out or default_recording_path(job_name(args)))
    console = stderr_console()
    status = record_command(
        executable, args, path, interval, instrument=not no_instrument, outputs=outputs, quiet=quiet
    )
    if not quiet:
        print_end_report(path, console, thresholds)
    ctx.exit(status)


def record_command(
    executable: str,
    argv: list[str],
    path: Path,
    interval: float,
    *,
    instrument: bool,
    outputs=None,
    quiet: bool = False,
) -> int:
    """Start the command, sample it until it exits, close the recording; its exit status."""
    from torchdoctor.sampling.gpus import GpuReader
    from torchdoctor.sampling.hostinfo import read_host_info

    held = hold_signals()  # before any thread starts, so no thread swallows a Ctrl-C
    try:
        gpus = GpuReader()
        env = dict(os.environ)
        writer = _create_writer(
            path, argv, interval, env, read_host_info(), gpus.status, instrument
        )
        collector = _start_collector(writer, env) if instrument else None
        if collector is not None:
            env = collector.child_env(env)
        elif not instrument:
            # An outer `torchdoctor run` may have left its bootstrap on PYTHONPATH.
            env["TORCHDOCTOR_NO_INSTRUMENT"] = "1"
        served = _start_outputs(path, outputs, quiet)
        try:
            child = ChildProcess(executable, argv, env)
        except BaseException:
            if served is not None:
                _safely(served.close)
            writer.close({"ended_at": time.time(), "exit_status": None, "start_error": True})
            path.unlink(missing_ok=True)
            raise
        # From here on the job runs: nothing of ours may stop us from waiting for it and
        # returning its status. Each step fails alone, says so once, and the rest goes on.
        recorder = _safely(lambda: _start_recorder(child.pid, gpus, writer, interval))
        registered = _safely(lambda: register_recording(child.pid, path))
        status = child.wait()
        if recorder is not None:
            _safely(recorder.stop)
        if collector is not None:
            _safely(lambda: collector.close(timeout=2.0))
        if served is not None:
            _safely(writer.flush)
            _safely(served.close)
        if registered:
            _safely(lambda: unregister_recording(child.pid))
        _safely(lambda: writer.close({"ended_at": time.time(), "exit_status": status}))
        _safely(gpus.close)
        return status
    finally:
        release_signals(held)


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

    return _safely(lambda: RunOutputs(path, outputs, quiet=quiet))


def _start_recorder(pid: int, gpus, writer: RecordingWriter, interval: float) -> Recorder:
    from torchdoctor.sampling.host import HostReader
    from torchdoctor.sampling.job import JobReader

    writer.set_meta({"root_pid": pid})
    recorder = Recorder(Sampler(HostReader(pid=pid), JobReader(pid), gpus), writer, interval)
    recorder.start()
    return recorder


def _safely(action):
    """Run one of our own steps; a failure is reported once and never reaches the job."""
    try:
        return action()
    except Exception as exc:  # noqa: BLE001
        print(
            f"torchdoctor: internal error, recording may be incomplete ({type(exc).__name__}: {exc})",
            file=sys.stderr,
        )
        return None


def _create_writer(path, argv, interval, env, host_info, gpu_status, instrument) -> RecordingWriter:
    meta = run_metadata(
        mode="run",
        command=argv,
        root_pid=None,
        interval_s=interval,
        env=env,
        host_info=host_info,
        gpu_status=gpu_status,
        instrumented=instrument,
    )
    return RecordingWriter(path, meta)


def _start_collector(writer: RecordingWriter, env: dict[str, str]):
    try:
        from torchdoctor.instrument.collector import Collector
    except ImportError:
        return None
    return Collector(writer)


def register_recording(pid: int, path: Path) -> bool:
    """Let `torchdoctor top` find this job's recording; best effort."""
    try:
        from torchdoctor.live.registry import register
    except ImportError:
        return False
    try:
        register(pid, str(path.resolve()))
        return True
    except OSError:
        return False


def unregister_recording(pid: int) -> None:
    try:
        from torchdoctor.live.registry import unregister

        unregister(pid)
    except (ImportError, OSError):
        pass
