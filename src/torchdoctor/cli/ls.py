"""``torchdoctor ls [DIR] [--json]``: the recordings, newest first, one line each."""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path

import click

from torchdoctor.cli.json_output import dump_json
from torchdoctor.recording.paths import runs_dir
from torchdoctor.units import fmt_duration, one_line


@click.command("ls")
@click.argument("folder", required=False, type=click.Path(file_okay=False), metavar="[DIR]")
@click.option("-n", "--limit", type=click.IntRange(1), default=None, help="Only the N newest.")
@click.option("--json", "as_json", is_flag=True, help="Print the list as JSON.")
def command(folder: str | None, limit: int | None, as_json: bool) -> None:
    """List the recordings in DIR (default: the recordings folder: $TORCHDOCTOR_RUNS_DIR,
    runs_dir in the config, else ./torchdoctor-runs), newest first: when each started, its
    command, duration, status, steps/s and worst finding. `last` names the first of them
    wherever a recording is asked for (`torchdoctor diagnose last`)."""
    from torchdoctor.cli.recordings import listed

    where = runs_dir(folder)
    lines = listed(where)[:limit]
    if as_json:
        rows = [{k: v for k, v in dataclasses.asdict(x).items() if k != "key"} for x in lines]
        dump_json("ls", {"folder": str(where), "recordings": rows})
        return
    if not lines:
        click.echo(f"no recordings in {where}", err=True)
        return
    from rich.table import Table

    from torchdoctor.terminal import make_console

    table = Table(show_edge=False, pad_edge=False, box=None)
    for name, justify in [
        ("when", "left"),
        ("command", "left"),
        ("duration", "right"),
        ("status", "left"),
        ("steps/s", "right"),
        ("worst finding", "left"),
    ]:
        table.add_column(name, justify=justify, no_wrap=name != "command")
    for x in lines:
        when = (
            time.strftime("%Y-%m-%d %H:%M", time.localtime(x.started_at)) if x.started_at else "-"
        )
        worst = f"{x.worst_severity} {x.worst_finding}" if x.worst_finding else "-"
        table.add_row(
            when,
            _short(x.command) if x.command else x.name,
            fmt_duration(x.duration_s, "-"),
            x.status,
            f"{x.steps_per_s:.2f}" if x.steps_per_s is not None else "-",
            worst,
        )
    width = None if sys.stdout.isatty() else 160
    make_console(sys.stdout, width=width).print(table)
    click.echo(f"in {Path(where)}; newest is `last`", err=True)


def _short(command: list[str]) -> str:
    """The command as a listing shows it: the program by its name, not its path (a venv's
    python under a long folder would push the script out of the column)."""
    return one_line([os.path.basename(command[0]), *command[1:]], 60)
