"""`torchdoctor show FILE [--json]`: the summary of a recording."""

from __future__ import annotations

import dataclasses

import click

from torchdoctor.cli.json_output import dump_json
from torchdoctor.cli.recordings import RECORDING
from torchdoctor.recording import open_recording
from torchdoctor.recording.summary import summarize


@click.command("show")
@click.argument("file", type=RECORDING)
@click.option(
    "--json", "as_json", is_flag=True, help="Print the summary as JSON (documented in README)."
)
def command(file: str, as_json: bool) -> None:
    """Print the summary of the recording FILE: duration, peaks and means, steps, settings."""
    with open_recording(file) as rec:
        summary = summarize(rec)
    if as_json:
        dump_json("show", dataclasses.asdict(summary))
        return
    from torchdoctor.run.end_report import render_summary
    from torchdoctor.terminal import make_console

    render_summary(summary, make_console(soft_wrap=True))
