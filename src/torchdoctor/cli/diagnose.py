"""``torchdoctor diagnose FILE...``: name the bottleneck of a recorded job, with fixes."""

from __future__ import annotations

import contextlib

import click

from torchdoctor.cli.common import thresholds_option
from torchdoctor.diagnosis.engine import diagnose_job
from torchdoctor.diagnosis.render import findings_to_json, render_findings
from torchdoctor.recording.jobs import job_recording_paths
from torchdoctor.recording.reader import open_recording
from torchdoctor.thresholds import load_thresholds


@click.command("diagnose")
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=True, path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Print the findings as JSON.")
@thresholds_option
def command(files: tuple[str, ...], as_json: bool, thresholds: str | None) -> None:
    """Name the bottleneck of the job recorded in FILES, with evidence and concrete fixes.

    Several recordings (or a folder of them) are one distributed job recorded on several
    nodes (`torchdoctor launch` on each): its ranks are compared across the nodes.

    Exits 0 whatever it finds (it is a report); non-zero only when FILES or the thresholds
    cannot be read.
    """
    thresholds = load_thresholds(thresholds)
    paths = job_recording_paths(list(files))
    with contextlib.ExitStack() as stack:
        recordings = [stack.enter_context(open_recording(p)) for p in paths]
        # What the findings rest on: a run still going, a damaged file.
        notes = [
            note if len(recordings) == 1 else f"{rec.path.name}: {note}"
            for rec in recordings
            for note in rec.notes()
        ]
        findings = diagnose_job(recordings, thresholds)
        text = findings_to_json(findings, recordings) if as_json else None
    for note in notes:
        click.echo(f"torchdoctor: {note}", err=as_json)
    if as_json:
        click.echo(text)
    else:
        render_findings(findings)
