"""Doctor results for people (grouped by family, one line per check, the fix under it) and for
programs (the JSON documented in the README).

JSON form::

    {"checks": [{"name": "network.route", "family": "network",
                 "status": "ok" | "warning" | "error" | "skipped",
                 "saw": str, "fix": str, "details": {...}}],
     "summary": {"ok": int, "warning": int, "error": int, "skipped": int},
     "exit_status": 0 | 1,
     "plan": {"master_addr": str | null, "master_port": int | null, "nnodes": int,
              "nproc_per_node": int | null, "workers": int | null}}
"""

from __future__ import annotations

import json
import shutil
import textwrap
from typing import Any

import click

from torchdoctor.doctor.check import ERROR, OK, SKIPPED, STATUSES, WARNING, Check, Plan
from torchdoctor.doctor.runner import exit_status

COLOURS = {OK: "green", WARNING: "yellow", ERROR: "red", SKIPPED: "bright_black"}


def summary(checks: list[Check]) -> dict[str, int]:
    return {status: sum(c.status == status for c in checks) for status in STATUSES}


def to_dict(checks: list[Check], plan: Plan) -> dict[str, Any]:
    return {
        "checks": [
            {
                "name": c.name,
                "family": c.family,
                "status": c.status,
                "saw": c.saw,
                "fix": c.fix,
                "details": c.details,
            }
            for c in checks
        ],
        "summary": summary(checks),
        "exit_status": exit_status(checks),
        "plan": {
            "master_addr": plan.master_addr,
            "master_port": plan.master_port,
            "nnodes": plan.nnodes,
            "nproc_per_node": plan.nproc_per_node,
            "workers": plan.workers,
        },
    }


def to_json(checks: list[Check], plan: Plan) -> str:
    return json.dumps(to_dict(checks, plan), indent=2, default=str)


def render(checks: list[Check], width: int | None = None) -> None:
    """One line per check (wrapped under its own column), the fix under it, a summary last."""
    width = width or min(max(shutil.get_terminal_size((100, 24)).columns, 60), 120)
    name_width = max((len(c.name.split(".", 1)[-1]) for c in checks), default=10)
    indent = " " * (2 + 8 + name_width + 2)
    family = None
    for c in checks:
        if c.family != family:
            family = c.family
            click.echo(click.style(family, bold=True))
        head = f"  {click.style(f'{c.status:<8}', fg=COLOURS.get(c.status))}"
        head += f"{c.name.split('.', 1)[-1]:<{name_width}}  "
        body = textwrap.wrap(c.saw, width - len(indent)) or [""]
        click.echo(head + body[0])
        for line in body[1:]:
            click.echo(indent + line)
        if c.fix:
            label = "fix: " if c.status != OK else "tip: "
            for i, line in enumerate(textwrap.wrap(label + c.fix, width - len(indent))):
                click.echo(click.style(indent + ("" if i == 0 else "     ") + line, fg="cyan"))
    counts = summary(checks)
    verdict = "errors found" if counts[ERROR] else "no errors"
    click.echo(
        click.style(
            f"{counts[OK]} ok, {counts[WARNING]} warning(s), {counts[ERROR]} error(s), "
            f"{counts[SKIPPED]} skipped: {verdict} (exit status {exit_status(checks)})",
            bold=True,
        )
    )
