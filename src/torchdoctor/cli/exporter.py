"""`torchdoctor exporter [--listen ADDR:PORT] [--print-dashboard]`: Prometheus metrics for the
machine and every job recorded on it."""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

import click

from torchdoctor.cli.common import thresholds_option
from torchdoctor.errors import UserError


@click.command("exporter")
@click.option(
    "--listen",
    metavar="[ADDR:]PORT",
    default=None,
    help="Where to serve /metrics (default 127.0.0.1:9842; ADDR defaults to 127.0.0.1).",
)
@click.option(
    "--print-dashboard",
    is_flag=True,
    help="Print the Grafana dashboard (JSON, for Dashboards > Import) and exit.",
)
@click.option(
    "--no-findings",
    is_flag=True,
    help="Leave out the torchdoctor_finding_active series (no diagnosis is run).",
)
@click.option(
    "--no-host",
    is_flag=True,
    help="Leave out the host series (CPU, memory, disks...) node_exporter already serves.",
)
@click.option(
    "--no-gpus",
    is_flag=True,
    help="Leave out the GPU series dcgm-exporter already serves (they join on `uuid`).",
)
@click.option(
    "--all-users",
    is_flag=True,
    help="Every user's recorded jobs, each labelled `user` (run by root, or by a service "
    "user allowed to read the users' registry folders; the systemd unit does this).",
)
@thresholds_option
def command(
    listen: str | None,
    print_dashboard: bool,
    no_findings: bool,
    no_host: bool,
    no_gpus: bool,
    all_users: bool,
    thresholds: str | None,
) -> None:
    """Serve the machine (CPU, memory, swap, disks, pressure, GPUs) and every job recorded by
    `torchdoctor run` or `attach` on this machine, for Prometheus or any OpenMetrics scraper.

    Values are read at each scrape: the host from /proc and NVML, the jobs from their
    recordings. Runs until interrupted (Ctrl-C, SIGTERM).
    """
    if print_dashboard:
        from torchdoctor.exporters.dashboard import dashboard_text

        click.echo(dashboard_text(), nl=False)
        return
    from torchdoctor import config
    from torchdoctor.exporters.prometheus import (
        DEFAULT_ADDRESS,
        DEFAULT_EXPORTER_PORT,
        HostCollector,
        bind_error,
        parse_listen,
        serve,
        stop,
    )
    from torchdoctor.sampling.gpus import GpuReader
    from torchdoctor.sampling.host import HostReader

    # --listen > $TORCHDOCTOR_EXPORTER_LISTEN > config; a bad value is named as its setter
    listen, where = config.exporter_listen(listen)
    address, port = (
        parse_listen(listen, where) if listen else (DEFAULT_ADDRESS, DEFAULT_EXPORTER_PORT)
    )
    gpus = None if no_gpus else GpuReader()
    jobs = _every_users_jobs if all_users else _recorded_jobs
    collector = HostCollector(
        None if no_host else HostReader(), gpus, jobs, findings=not no_findings, warn=_warn
    )
    try:
        server = serve(collector, address, port)
    except OSError as exc:
        if gpus is not None:
            gpus.close()
        raise UserError(f"{bind_error(exc, address, port)}; choose another with --listen") from None
    done = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: done.set()) for sig in _STOP_SIGNALS}
    host, bound = server.server_address[:2]
    shown = f"[{host}]" if ":" in host else host
    print(
        f"torchdoctor: serving the machine and its recorded jobs at "
        f"http://{shown}:{bound}/metrics (Ctrl-C stops)",
        file=sys.stderr,
        flush=True,
    )
    try:
        done.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        stop(server)
        collector.close()
        if gpus is not None:
            gpus.close()


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _warn(line: str) -> None:
    """A job left out of the metrics (its recording cannot be read): one line, once a job."""
    print(f"torchdoctor: {line}", file=sys.stderr, flush=True)


def _recorded_jobs() -> list[Path]:
    """Recordings of the jobs running now, as `torchdoctor run` and `attach` announce them."""
    from torchdoctor.recording.registry import active

    try:
        return [entry.recording_path for entry in active()]
    except OSError:
        return []  # no private registry folder (yet): no recorded job to serve


def _every_users_jobs() -> list[Path]:
    """The machine's exporter: every user's recorded jobs (see registry.every_users_active)."""
    from torchdoctor.recording.registry import every_users_active

    paths = _recorded_jobs()  # ours, wherever our own registry is
    return paths + [
        entry.recording_path
        for _uid, entry in every_users_active()
        if entry.recording_path not in paths
    ]
