"""``torchdoctor diagnose FILE``: name the bottleneck of a recorded job, with fixes."""

from __future__ import annotations

import click

from torchdoctor.diagnosis.engine import diagnose
from torchdoctor.diagnosis.render import findings_to_json, render_findings
from torchdoctor.recording.reader import open_recording
from torchdoctor.thresholds import load_thresholds


@click.command("diagnose")
@click.argument("file", type=click.Path(dir_okay=True, path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Print the findings as JSON.")
@click.option(
    "--thresholds",
    "thresholds_file",
    type=click.Path(path_type=str),
    default=None,
    help="TOML file overriding the threshold table (default: [tool.torchdoctor.thresholds] "
    "in the nearest pyproject.toml).",
)
def command(file: str, as_json: bool, thresholds_file: str | None) -> None:
    """Name the bottleneck of the job recorded in FILE, with evidence and concrete fixes.

    Exits 0 whatever it finds (it is a report); non-zero only when FILE or the thresholds
    cannot be read.
    """
    thresholds = load_thresholds(thresholds_file)
    with open_recording(file) as recording:
        findings = diagnose(recording, thresholds)
    if as_json:
        click.echo(findings_to_json(findings))
    else:
        render_findings(findings)
