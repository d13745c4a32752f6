"""`torchdoctor slurm status JOBID`: a Slurm job's state, asked vs used, summary and findings."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click
from rich.console import Console
from rich.text import Text

from torchdoctor.cli.common import thresholds_option
from torchdoctor.cli.json_output import dump_json
from torchdoctor.cli.parsing import HelpfulGroup
from torchdoctor.slurm.status import JobReport, job_report
from torchdoctor.terminal import make_console, styled
from torchdoctor.units import fmt_duration


@click.group("slurm", cls=HelpfulGroup)
def command() -> None:
    """Slurm jobs written by `torchdoctor sbatch`."""


@command.command("status")
@click.argument("job_id", metavar="JOBID")
@click.option(
    "--recordings",
    type=click.Path(file_okay=False),
    default=None,
    metavar="DIR",
    help="The folder given to `sbatch --recordings` (default: the one the job's script names "
    "while Slurm knows the job, else the recordings folder).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@thresholds_option
def status(job_id: str, recordings: str | None, as_json: bool, thresholds: str | None) -> None:
    """State, elapsed time and nodes of JOBID; what it asked for against what it used; and,
    once the nodes' recordings exist, their summary and findings."""
    report = job_report(job_id, Path(recordings) if recordings else None)
    if as_json:
        dump_json("slurm-status", _to_json(report))
        return
    render_report(report, make_console(soft_wrap=True))


def render_report(report: JobReport, console: Console) -> None:
    from torchdoctor.diagnosis.render import render_findings
    from torchdoctor.run.end_report import render_summary

    s = report.state
    exit_code = f", exit {s.exit_code}" if s.exit_code else ""
    console.print(
        Text.assemble(
            (f"job {s.job_id}", "bold"),
            (f" ({s.name})" if s.name else "") + f": {s.state}{exit_code} - from {s.source}",
        )
    )
    if s.reason:
        console.print(f"reason: {s.reason}")
    nodes = s.node_list or "not yet allocated"
    count = f"{s.num_nodes} node{'s' if s.num_nodes != 1 else ''}: " if s.num_nodes else ""
    console.print(f"nodes: {count}{nodes}; elapsed {fmt_duration(s.elapsed_s)}")
    for note in report.notes:
        console.print(f"note: {note}")
    console.print(f"asked vs used (asked: {report.asked.source}):")
    width = max(len(row.figure) for row in report.asked_used)
    for row in report.asked_used:
        console.print(f"  {row.figure:<{width}}  {row.text()}")
    console.print(f"recordings: {report.folder}")
    for node in report.recordings:
        console.print("")
        console.print(styled(f"node {node.hostname or '?'}", "bold"))
        render_summary(node.summary, console)
        render_findings(node.findings, console)


def _to_json(report: JobReport) -> dict:
    data = dataclasses.asdict(report)
    for row, plain in zip(report.asked_used, data["asked_used"], strict=True):
        plain["share"] = row.share
    return data
