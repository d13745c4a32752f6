"""``torchdoctor queue``: list, inspect, cancel, pause and wait for queued jobs: this user's
own queue, or the machine-wide one where it is installed (``queue serve --system``)."""

from __future__ import annotations

import dataclasses
import json
import sys
import time

import click

from torchdoctor.cli.parsing import HelpfulGroup
from torchdoctor.errors import UserError
from torchdoctor.units import fmt_bytes, fmt_cpu_list, fmt_duration


class JobId(click.ParamType):
    """A queued job's id, the one definition every queue command and ``submit --after`` read:
    a whole number the queue can hold (an SQLite rowid), checked before any command runs, so a
    number past the store's INTEGER is a usage error with the range, never an OverflowError
    from deep in a query. ``several``: a comma-separated list of them (``--after 3,4``)."""

    name = "job_id"

    def __init__(self, several: bool = False) -> None:
        self.several = several

    def convert(
        self, value: object, param: click.Parameter | None, ctx: click.Context | None
    ) -> int | list[int]:
        from torchdoctor.queue.model import JOB_ID_MAX

        if isinstance(value, int) or (isinstance(value, list) and self.several):
            return value  # a default, or already converted
        ids = []
        for word in str(value).split(",") if self.several else [str(value)]:
            if self.several and not word.strip():
                continue
            try:
                job_id = int(word)
            except ValueError:
                self.fail(f"{word!r} is not a job id: give a whole number, e.g. 3", param, ctx)
            if not 1 <= job_id <= JOB_ID_MAX:
                self.fail(
                    f"job id {job_id} is out of range: ids go from 1 to {JOB_ID_MAX}", param, ctx
                )
            ids.append(job_id)
        return ids if self.several else ids[0]


JOB_ID = JobId()
JOB_IDS = JobId(several=True)


def _queue(reading: int | None = None, say_mode: bool = False):
    """The machine-wide queue where one is installed, else this user's own (with ``say_mode``,
    which one is said once). ``reading``: a read-only command about job ``reading`` (or 0:
    about all), which must not create a user's queue files where nothing was ever queued."""
    from torchdoctor.queue.paths import queue_paths
    from torchdoctor.queue.system import open_queue, system_queue_installed

    never_queued = not system_queue_installed() and not queue_paths().db.exists()
    if reading is not None and never_queued:
        if reading == 0:
            return None
        raise UserError(
            f"there is no job {reading} in your queue: nothing was ever queued here "
            "(`torchdoctor submit -- CMD` queues one)"
        )
    return open_queue(say_mode)


def complete_job_ids(ctx: click.Context, param: click.Parameter, incomplete: str):
    """Shell completion of job ids: the queue's jobs, newest first, read without creating it."""
    from click.shell_completion import CompletionItem

    try:
        queue = _queue(reading=0)
        if queue is None:
            return []
        with queue:
            jobs = queue.jobs()
    except Exception:  # noqa: BLE001 - completion must never print an error into the shell
        return []
    return [
        CompletionItem(str(j.id), help=f"{j.state} {j.name}")
        for j in sorted(jobs, key=lambda j: -j.id)
        if str(j.id).startswith(incomplete)
    ]


@click.group("queue", cls=HelpfulGroup, invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="The jobs as JSON.")
@click.pass_context
def command(ctx: click.Context, as_json: bool) -> None:
    """Without a sub-command: list the jobs (owner, state, asked vs used, wait and run time):
    yours, or on a machine-wide queue everyone's (commands and logs only to their owner)."""
    if ctx.invoked_subcommand is not None:
        return
    jobs, paused, everyone = [], None, False
    queue = _queue(reading=0, say_mode=not as_json)
    if queue is not None:
        with queue:
            jobs = queue.jobs()
            paused = queue.paused
            everyone = queue.system
    if as_json:
        click.echo(json.dumps({"paused": paused, "jobs": [_plain(j) for j in jobs]}, indent=2))
        return
    if paused:
        click.echo(f"queue paused: {paused}")
    if not jobs:
        click.echo("no jobs; queue one with `torchdoctor submit -- CMD ARGS...`")
        return
    click.echo(_table(jobs, time.time(), owners=everyone))


def _plain(job) -> dict:
    data = dataclasses.asdict(job)
    data.pop("env")  # the whole environment is for the job, not for listings
    return data


_HEADER = (
    "ID",
    "OWNER",
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


def _table(jobs, now: float, owners: bool = False) -> str:
    """One row a job; the OWNER column on a machine-wide queue (everyone's jobs)."""
    rows = [_HEADER] + [_row(j, now) for j in jobs]
    if not owners:
        rows = [r[:1] + r[2:] for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
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
    owner = job.user or (str(job.uid) if job.uid is not None else "-")
    return (
        str(job.id),
        owner,
        job.state,
        job.name,
        gpus,
        vram,
        cores,
        ram,
        waited,
        ran,
        _note(job),
    )


def _note(job) -> str:
    if job.state == "done":
        return "exit 0"
    if job.reason:
        return job.reason
    if job.exit_status is not None:
        return f"exit {job.exit_status}"
    return ""


@command.command("show")
@click.argument("job_id", type=JOB_ID, shell_complete=complete_job_ids)
@click.option(
    "--thresholds",
    type=click.Path(dir_okay=False),
    metavar="FILE",
    help="TOML threshold overrides.",
)
@click.option("--json", "as_json", is_flag=True, help="The job as JSON (no environment).")
def show(job_id: int, thresholds: str | None, as_json: bool) -> None:
    """One job: what it asked and got, where each figure came from, how it ended (or why it
    waits); then the summary and findings of its recording."""
    from pathlib import Path

    from torchdoctor.terminal import make_console
    from torchdoctor.units import one_line

    with _queue(reading=job_id) as queue:
        job = queue.job(job_id)
    if as_json:
        click.echo(json.dumps({"schema_version": 1, "job": _plain(job)}, indent=2))
        return
    hidden = "(only its owner and root see it)"
    lines = [
        f"job {job.id}: {job.name}  ({job.state})",
        f"  owner      {job.user or job.uid}",
        f"  command    {one_line(job.argv) if job.argv else hidden}",
        f"  folder     {job.cwd or hidden}",
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
        lines.append(f"  {'waits' if job.state == 'queued' else 'note '}      {job.reason}")
    lines.append(f"  log        {job.log or hidden}")
    recording = Path(job.recording) if job.recording else None
    has_recording = recording is not None and recording.exists()
    if not job.argv:
        lines.append(f"  recording  {hidden}")
    else:
        lines.append(
            f"  recording  {recording if has_recording else 'none (the job did not start)'}"
        )
    click.echo("\n".join(lines))
    if has_recording and job.ended:
        from torchdoctor.run.end_report import print_end_report

        click.echo("")
        print_end_report(recording, make_console(sys.stdout, soft_wrap=True), thresholds)


@command.command("cancel")
@click.argument("job_id", type=JOB_ID, shell_complete=complete_job_ids)
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
@click.argument("job_id", type=JOB_ID, shell_complete=complete_job_ids)
@click.option("-f", "--follow", is_flag=True, help="Keep printing until the job ends.")
def logs(job_id: int, follow: bool) -> None:
    """What the job wrote (stdout and stderr); only its owner (and root) may read it."""
    with _queue(reading=job_id) as queue:
        job = queue.own(job_id, "read the logs of")
        out = sys.stdout.buffer
        offset = 0
        while True:
            offset = _copy_from(job.log, offset, out)
            if not follow or job.ended:
                break
            time.sleep(0.2)
            job = queue.own(job_id, "read the logs of")
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
@click.argument("job_id", type=JOB_ID, required=False)
def pause(job_id: int | None) -> None:
    """Start nothing new (running jobs finish); with JOB_ID: keep that waiting job of yours
    from starting. A machine-wide queue is paused as a whole by root only."""
    with _queue() as queue:
        if job_id is not None:
            queue.hold(job_id)
            click.echo(
                f"job {job_id} paused: it does not start until `torchdoctor queue resume {job_id}`"
            )
            return
        queue.pause()
    click.echo(
        "queue paused: running jobs go on, nothing new starts until `torchdoctor queue resume`"
    )


@command.command("resume")
@click.argument("job_id", type=JOB_ID, required=False)
def resume(job_id: int | None) -> None:
    """Start jobs again; with JOB_ID: let that paused job of yours start."""
    with _queue() as queue:
        if job_id is not None:
            queue.release(job_id)
            click.echo(f"job {job_id} resumed")
            return
        queue.resume()
    click.echo("queue resumed")


# A negative priority (`queue priority 20 -5`) is a value, not an option, as `submit
# --priority -5` already reads it; the command has no options besides --help.
@command.command("priority", context_settings={"ignore_unknown_options": True})
@click.argument("job_id", type=JOB_ID)
@click.argument("priority", type=int)
def priority(job_id: int, priority: int) -> None:
    """Change a waiting job's priority (higher starts first among its owner's jobs)."""
    with _queue() as queue:
        job = queue.set_priority(job_id, priority)
    click.echo(f"job {job.id} priority {job.priority}")


@command.command("restart")
@click.argument("job_id", type=JOB_ID)
def restart(job_id: int) -> None:
    """Queue an ended job again as a new job (same command, folder, environment, needs)."""
    with _queue() as queue:
        job = queue.restart(job_id)
    click.echo(f"job {job.id} queued: a restart of job {job_id}")


@command.command("clean")
@click.option(
    "--older-than",
    metavar="DURATION",
    help="Only jobs that ended longer ago than this, e.g. 90s, 30m, 2h, 7d.",
)
@click.option(
    "--state",
    "states",
    multiple=True,
    type=click.Choice(["done", "failed", "cancelled", "lost"]),
    help="Only jobs that ended so (repeatable; default: every ended job).",
)
def clean(older_than: str | None, states: tuple[str, ...]) -> None:
    """Forget ended jobs (yours; root: everyone's). Their logs and recordings stay."""
    from torchdoctor.queue.model import TERMINAL

    age = _duration(older_than) if older_than is not None else None
    with _queue() as queue:
        gone = queue.clean(age, tuple(states) or TERMINAL)
    click.echo(
        f"removed {len(gone)} ended job(s)" + (f": {', '.join(map(str, gone))}" if gone else "")
    )


def _duration(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    body, unit = text.strip()[:-1], text.strip()[-1:].lower()
    if unit.isdigit():
        body, unit = text.strip(), "s"
    try:
        value = float(body) * units[unit]
    except (KeyError, ValueError):
        raise UserError(
            f"--older-than {text}: give a duration such as 90s, 30m, 2h or 7d"
        ) from None
    if value < 0:
        raise UserError(f"--older-than {text}: a duration is not negative")
    return value


@command.command("serve")
@click.option(
    "--system",
    is_flag=True,
    required=True,
    help="The machine-wide scheduler (root): every user's jobs, each run as its submitter.",
)
def serve(system: bool) -> None:
    """Run the machine-wide scheduler in the foreground (what the systemd unit runs)."""
    from torchdoctor.queue.scheduler import serve_system

    serve_system()


@command.command("install")
@click.option(
    "--dir",
    "folder",
    default="/etc/systemd/system",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Where the unit files go.",
)
def install(folder: str) -> None:
    """Write systemd units for the machine-wide scheduler and the exporter."""
    from torchdoctor.queue.service import write_units

    for path in write_units(folder):
        click.echo(f"wrote {path}")
    click.echo(
        "then: systemctl daemon-reload && systemctl enable --now torchdoctor-queue "
        "torchdoctor-exporter"
    )


@command.command("wait")
@click.argument("job_id", type=JOB_ID, shell_complete=complete_job_ids)
@click.pass_context
def wait(ctx: click.Context, job_id: int) -> None:
    """Wait for a job to end; exit with its exit status (1 when it has none)."""
    with _queue(reading=job_id) as queue:
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
    # No file is no damage: opening the store here would fail on the missing folder, read as
    # an unreadable file, and the rename below would find nothing to keep aside.
    if not paths.db.exists():
        click.echo(f"nothing to recover: no queue state at {paths.db}")
        return
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
