"""``torchdoctor diagnose FILE...``: name the bottleneck of a recorded job, with fixes."""

from __future__ import annotations

import contextlib

import click

from torchdoctor.cli.common import thresholds_option
from torchdoctor.cli.exit_codes import FOUND
from torchdoctor.cli.json_output import dump_json
from torchdoctor.cli.recordings import RECORDING
from torchdoctor.diagnosis.engine import diagnose_job
from torchdoctor.diagnosis.findings import SEVERITIES
from torchdoctor.diagnosis.render import findings_to_dict, render_findings
from torchdoctor.recording.jobs import job_recording_paths
from torchdoctor.recording.reader import open_recording
from torchdoctor.thresholds import load_thresholds


@click.command("diagnose")
@click.argument("files", nargs=-1, required=True, type=RECORDING)
@click.option("--json", "as_json", is_flag=True, help="Print the findings as JSON.")
@thresholds_option
@click.option(
    "--fail-on",
    type=click.Choice(["warning", "critical"]),
    default=None,
    help="Exit 1 when a finding is at least this severe (for CI); default: exit 0 whatever "
    "is found.",
)
@click.pass_context
def command(
    ctx: click.Context,
    files: tuple[str, ...],
    as_json: bool,
    thresholds: str | None,
    fail_on: str | None,
) -> None:
    """Name the bottleneck of the job recorded in FILES, with evidence and concrete fixes.

    Several recordings (or a folder of them) are one distributed job recorded on several
    nodes (`torchdoctor launch` on each): its ranks are compared across the nodes.

    `last` (or `@last`) is the newest recording of the recordings folder. Exits 0 whatever
    it finds (it is a report), unless --fail-on says which findings fail; 2 when FILES or
    the thresholds cannot be read.
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
        failed: list[str] = []  # what each rule that failed said, for the verdict below

        def complain(text: str) -> None:
            click.echo(text, err=True)
            failed.append(text)

        findings = diagnose_job(recordings, thresholds, complain=complain)
        document = findings_to_dict(findings, recordings) if as_json else None
    for note in notes:
        click.echo(f"torchdoctor: {note}", err=as_json)
    if as_json:
        dump_json("diagnose", document)
    else:
        render_findings(findings, failed_rules=len(failed))
    if fail_on is not None:
        limit = SEVERITIES.index(fail_on)
        if any(SEVERITIES.index(f.severity) <= limit for f in findings):
            ctx.exit(FOUND)
