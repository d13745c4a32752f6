"""``torchdoctor queue``: list, inspect, cancel, pause and wait for this user's queued jobs."""

from __future__ import annotations

import dataclasses
import json
import sys
import time

import click

from torchdoctor.errors import UserError
from torchdoctor.units import fmt_bytes, fmt_cpu_list, fmt_duration


def _queue():
    from torchdoctor.queue import Queue

    return Queue()


@click.group("queue", invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="The jobs as JSON.")
@click.pass_context
def command(ctx: click.Context, as_json: bool) -> None:
    """Without a sub-command: list your jobs (state, asked vs used, wait and run time)."""
    if ctx.invoked_subcommand is not None:
        return
    with _queue() as queue:
        jobs = queue.jobs()
        paused = queue.paused
    if as_json:
        click.echo(json.dumps({"paused": paused, "jobs": [_plain(j) for j in jobs]}, indent=2))
        return
    if paused:
        click.echo(f"queue paused: {paused}")
    if not jobs:
        click.echo("no jobs; queue one with `torchdoctor submit -- CMD ARGS...`")
        return
    click.echo(_table(jobs, time.time()))


def _plain(job) -> dict:
    data = dataclasses.asdict(job)
    data.pop("env")  # the whole environment is for the job, not for listings
    return data


_HEADER = (
    "ID",
    "STATE",
    "NAME",
    "GPUS",
    "VRAM asked/used",
    "CORES asked/used",
    "RAM asked/used",
    "WAITED",
    "RAN",
    "NOTE",
)


def _table(jobs, now: float) -> str:
    rows = [_HEADER] + [_row(j, now) for j in jobs]
    widths = [max(len(r[i]) for r in rows) for i in range(len(_HEADER) - 1)]
    lines = []
    for r in rows:
        cells = [c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)]
        lines.append("  ".join([*cells, r[-1]]).rstrip())
    return "\n".join(lines)


def _row(job, now: float) -> tuple[str, ...]:
    gpus = "-"
    if job.gpus:
        gpus = str(job.gpus)
        if job.assigned_gpus:
            gpus += ": " + ",".join(u[:12] for u in job.assigned_gpus)
    vram = "-"
    if job.gpus:
        asked = fmt_bytes(job.vram) if job.vram is not None else "whole"
        vram = f"{asked}/{fmt_bytes(job.used_vram, '-')}"
    cores = str(job.cpus)
    if job.assigned_cpus:
        cores += f" [{fmt_cpu_list(job.assigned_cpus)}]"
    cores += "/" + (f"{job.used_cores:.2f}" if job.used_cores is not None else "-")
    ram = f"{fmt_bytes(job.mem, '-')}/{fmt_bytes(job.used_rss, '-')}"
    waited = ran = "-"
    if job.started_at is not None:
        waited = fmt_duration(job.started_at - job.submitted_at)
        ran = fmt_duration((job.ended_at or now) - job.started_at)
    elif not job.ended:
        waited = fmt_duration(now - job.submitted_at)
    return (str(job.id), job.state, job.name, gpus, vram, cores, ram, waited, ran, _note(job))


def _note(job) -> str:
    if job.state == "done":
        return "exit 0"
    if job.reason:
        return job.reason
    if job.exit_status is not None:
        return f"exit {job.exit_status}"
    return ""


@command.command("show")
@click.argument("job_id", type=int)
@click.option(
    "--thresholds",
    type=click.Path(dir_okay=False),
    metavar="FILE",
    help="TOML threshold overrides.",
)
def show(job_id: int, thresholds: str | None) -> None:
    """One job: what it asked and got, where each figure came from, how it ended; then the
    summary and findings of its recording."""
    from pathlib import Path

    from rich.console import Console

    from torchdoctor.units import one_line

    with _queue() as queue:
        job = queue.job(job_id)
    lines = [
        f"job {job.id}: {job.name}  ({job.state})",
        f"  command    {one_line(job.argv)}",
        f"  folder     {job.cwd}",
    ]
    if job.after:
        lines.append(f"  after      {', '.join(map(str, job.after))}")
    if job.priority:
        lines.append(f"  priority   {job.priority}")
    gpus = "none"
    if job.gpus:
        gpus = f"{job.gpus} asked" + (
            f"; got {', '.join(job.assigned_gpus)}" if job.assigned_gpus else ""
        )
    lines.append(f"  GPUs       {gpus}")
    if job.gpus:
        asked = (
            f"{fmt_bytes(job.vram)} per GPU ({job.vram_source})"
            if job.vram is not None
            else "whole GPUs"
        )
        lines.append(f"  VRAM       {asked}; peak used {fmt_bytes(job.used_vram, 'unknown')}")
    got = f"; got CPUs {fmt_cpu_list(job.assigned_cpus)}" if job.assigned_cpus else ""
    used = f"; used {job.used_cores:.2f} on average" if job.used_cores is not None else ""
    lines.append(f"  cores      {job.cpus} asked{got}{used}")
    asked_mem = (
        f"{fmt_bytes(job.mem)} ({job.mem_source})" if job.mem is not None else "not reserved"
    )
    lines.append(f"  RAM        {asked_mem}; peak used {fmt_bytes(job.used_rss, 'unknown')}")
    if job.master_port is not None:
        lines.append(f"  port       MASTER_PORT={job.master_port}")
    if job.started_at is not None:
        lines.append(f"  waited     {fmt_duration(job.started_at - job.submitted_at)}")
        lines.append(f"  ran        {fmt_duration((job.ended_at or time.time()) - job.started_at)}")
    if job.exit_status is not None:
        lines.append(f"  exit       {job.exit_status}")
    if job.reason:
        lines.append(f"  note       {job.reason}")
    lines.append(f"  log        {job.log}")
    recording = Path(job.recording) if job.recording else None
    has_recording = recording is not None and recording.exists()
    lines.append(f"  recording  {recording if has_recording else 'none (the job did not start)'}")
    click.echo("\n".join(lines))
    if has_recording and job.ended:
        from torchdoctor.run.end_report import print_end_report

        click.echo("")
        print_end_report(
            recording, Console(file=sys.stdout, highlight=False, soft_wrap=True), thresholds
        )


@command.command("cancel")
@click.argument("job_id", type=int)
@click.option(
    "--grace",
    type=float,
    default=10.0,
    show_default=True,
    metavar="S",
    help="Seconds between TERM and KILL.",
)
def cancel(job_id: int, grace: float) -> None:
    """Cancel a job: a waiting one never starts; a running one's whole process group gets
    TERM, then KILL after the grace period."""
    with _queue() as queue:
        job = queue.cancel(job_id, grace_s=grace)
    status = f", exit status {job.exit_status}" if job.exit_status is not None else ""
    click.echo(f"job {job.id} {job.state}{status}")


@command.command("logs")
@click.argument("job_id", type=int)
@click.option("-f", "--follow", is_flag=True, help="Keep printing until the job ends.")
def logs(job_id: int, follow: bool) -> None:
    """What the job wrote (stdout and stderr)."""
    with _queue() as queue:
        job = queue.job(job_id)
        out = sys.stdout.buffer
        offset = 0
        while True:
            offset = _copy_from(job.log, offset, out)
            if not follow or job.ended:
                break
            time.sleep(0.2)
            job = queue.job(job_id)
        offset = _copy_from(job.log, offset, out)
        if job.state == "queued" and offset == 0 and not follow:
            click.echo(f"job {job_id} has not started yet ({job.reason or 'queued'})", err=True)


def _copy_from(path: str | None, offset: int, out) -> int:
    if path is None:
        return offset
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return offset
    out.write(data)
    out.flush()
    return offset + len(data)


@command.command("pause")
def pause() -> None:
    """Start nothing new; running jobs finish."""
    with _queue() as queue:
        queue.pause()
    click.echo(
        "queue paused: running jobs go on, nothing new starts until `torchdoctor queue resume`"
    )


@command.command("resume")
def resume() -> None:
    """Start jobs again."""
    with _queue() as queue:
        queue.resume()
    click.echo("queue resumed")


@command.command("wait")
@click.argument("job_id", type=int)
@click.pass_context
def wait(ctx: click.Context, job_id: int) -> None:
    """Wait for a job to end; exit with its exit status (1 when it has none)."""
    with _queue() as queue:
        job = queue.wait(job_id)
    if job.state != "done":
        click.echo(f"job {job.id} {job.state}: {_note(job)}", err=True)
    ctx.exit(job.exit_status if job.exit_status is not None else 1)


@command.command("recover")
def recover() -> None:
    """Keep an unreadable state file aside and start an empty queue."""
    from torchdoctor.queue.paths import queue_paths
    from torchdoctor.queue.store import CorruptStateError, QueueStore

    paths = queue_paths()
    try:
        QueueStore(paths.db).close()
    except CorruptStateError:
        pass
    else:
        raise UserError(f"the queue state {paths.db} is readable; there is nothing to recover")
    kept = paths.db.with_name(
        f"{paths.db.name}.unreadable-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    )
    paths.db.rename(kept)
    for suffix in ("-wal", "-shm"):
        side = paths.db.with_name(paths.db.name + suffix)
        if side.exists():
            side.rename(kept.with_name(kept.name + suffix))
    QueueStore(paths.db).close()
    click.echo(f"kept the unreadable state as {kept}; the queue starts empty")
