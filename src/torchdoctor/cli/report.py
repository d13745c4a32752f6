"""``torchdoctor report FILE [-o report.html] [--thresholds FILE]``."""

from __future__ import annotations

import click

from torchdoctor.report.units import BYTES, fmt_value


@click.command("report")
@click.argument("recording", type=click.Path(dir_okay=True, path_type=str))
@click.option(
    "-o",
    "--out",
    type=click.Path(path_type=str),
    default=None,
    help="Where to write the HTML file (default: beside the recording, ending in .html).",
)
@click.option(
    "--thresholds",
    "thresholds_file",
    type=click.Path(path_type=str),
    default=None,
    help="TOML file overriding the threshold table (default: [tool.torchdoctor.thresholds] "
    "in the nearest pyproject.toml, else the built-in table).",
)
def command(recording: str, out: str | None, thresholds_file: str | None) -> None:
    """Write a self-contained HTML report of RECORDING: timelines, processes, settings, findings.

    The file opens offline in any browser: nothing is fetched from the network.
    """
    from torchdoctor.report.html import write_report
    from torchdoctor.thresholds import load_thresholds

    thresholds = load_thresholds(thresholds_file)
    path, data = write_report(recording, out, thresholds)
    severe = sum(1 for f in data.findings if f.severity in ("critical", "warning"))
    size = fmt_value(path.stat().st_size, BYTES)
    click.echo(f"report written to {path} ({size})")
    click.echo(f"  {data.verdict}")
    if data.diagnosis_note is None and data.findings:
        click.echo(f"  {len(data.findings)} finding(s), {severe} to act on")
