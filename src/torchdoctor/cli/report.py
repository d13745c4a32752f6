"""``torchdoctor report FILE [-o report.html] [--thresholds FILE]``."""

from __future__ import annotations

import click

from torchdoctor.cli.common import thresholds_option
from torchdoctor.cli.force import force_option
from torchdoctor.cli.json_output import dump_json
from torchdoctor.cli.recordings import RECORDING
from torchdoctor.report.scales import BYTES, fmt_value


@click.command("report")
@click.argument("recording", type=RECORDING)
@click.option(
    "-o",
    "--out",
    type=click.Path(path_type=str),
    default=None,
    metavar="FILE",
    help="Where to write the HTML file (default: beside the recording, ending in .html).",
)
@force_option("the -o file")
@thresholds_option
@click.option("--json", "as_json", is_flag=True, help="Print what was written as JSON.")
def command(
    recording: str, out: str | None, force: bool, thresholds: str | None, as_json: bool
) -> None:
    """Write a self-contained HTML report of RECORDING: timelines, processes, settings, findings.

    The file opens offline in any browser: nothing is fetched from the network. An existing
    report of the same name is replaced; any other existing file only with --force.
    """
    from torchdoctor.report.html import write_report
    from torchdoctor.thresholds import load_thresholds

    path, data = write_report(recording, out, load_thresholds(thresholds), force=force)
    severe = sum(1 for f in data.findings if f.severity in ("critical", "warning"))
    if as_json:
        dump_json(
            "report",
            {
                "path": str(path),
                "bytes": path.stat().st_size,
                "verdict": data.verdict,
                "findings": len(data.findings) if data.diagnosis_note is None else None,
                "to_act_on": severe if data.diagnosis_note is None else None,
            },
        )
        return
    size = fmt_value(path.stat().st_size, BYTES)
    click.echo(f"report written to {path} ({size})")
    click.echo(f"  {data.verdict}")
    if data.diagnosis_note is None and data.findings:
        click.echo(f"  {len(data.findings)} finding(s), {severe} to act on")
