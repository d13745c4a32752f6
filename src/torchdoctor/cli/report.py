"""``torchdoctor report FILE [B ...] [-o report.html] [--thresholds FILE]``, and
``torchdoctor report A1 A2 ... vs B1 B2 ...``."""

from __future__ import annotations

from typing import Any

import click

from torchdoctor.cli.common import thresholds_option
from torchdoctor.cli.force import force_option
from torchdoctor.cli.json_output import dump_json
from torchdoctor.cli.recordings import RECORDING_OR_VERSUS, VERSUS, versus_sides
from torchdoctor.report.scales import BYTES, fmt_value


@click.command("report")
@click.argument(
    "recordings",
    nargs=-1,
    required=True,
    type=RECORDING_OR_VERSUS,
    metavar="RECORDING [B ...] | A1 A2 ... vs B1 B2 ...",
)
@click.option(
    "-o",
    "--out",
    type=click.Path(path_type=str),
    default=None,
    metavar="FILE",
    help="Where to write the HTML file (default: beside the recording, ending in .html; "
    "for several, beside the last: LAST-vs-FIRST.html).",
)
@force_option("the -o file")
@thresholds_option
@click.option("--json", "as_json", is_flag=True, help="Print what was written as JSON.")
def command(
    recordings: tuple[str, ...],
    out: str | None,
    force: bool,
    thresholds: str | None,
    as_json: bool,
) -> None:
    """Write a self-contained HTML report of RECORDING: timelines, processes, settings, findings.

    With two recordings or more (`report A B`, or `last~1 last`), one page compares each with
    the first as `torchdoctor compare` does: the verdict with its interval, every run's curves
    overlaid on one time axis from each run's start, the phases of a step side by side and the
    settings and environment that differ.

    Several runs a side (`report A1 A2 A3 vs B1 B2 B3`, at least 2 each): one verdict, B's
    runs against A's, each run one observation as in `compare A1 A2 vs B1 B2`; every run is
    drawn.

    The file opens offline in any browser: nothing is fetched from the network. An existing
    report of the same name is replaced; any other existing file only with --force.
    """
    from torchdoctor.report.html import write_report
    from torchdoctor.thresholds import load_thresholds

    if VERSUS in recordings:
        side_a, side_b = versus_sides(recordings[0], recordings[1:], "report")
        flat = side_a + side_b
        _compare(flat, out, force, load_thresholds(thresholds), as_json, versus=len(side_a))
        return
    if len(recordings) > 1:
        _compare(list(recordings), out, force, load_thresholds(thresholds), as_json)
        return
    recording = recordings[0]
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


def _compare(
    recordings: list[str],
    out: str | None,
    force: bool,
    thresholds: Any,
    as_json: bool,
    versus: int | None = None,
) -> None:
    from torchdoctor.compare.verdict import headline
    from torchdoctor.report.comparison import LETTERS, write_comparison_report

    path, comparisons = write_comparison_report(
        recordings, out, thresholds, force=force, versus=versus
    )
    if as_json:
        dump_json(
            "report",
            {
                "path": str(path),
                "bytes": path.stat().st_size,
                "verdict": "; ".join(c.verdict for c in comparisons),
                "findings": None,
                "to_act_on": None,
                "comparisons": [
                    {
                        "a": c.a,
                        "b": c.b,
                        "verdict": c.verdict,
                        "ratio": c.to_dict()["ratio"],
                        "a_runs": c.a_runs,
                        "b_runs": c.b_runs,
                        "method": c.method,
                    }
                    for c in comparisons
                ],
            },
        )
        return
    click.echo(f"report written to {path} ({fmt_value(path.stat().st_size, BYTES)})")
    for letter, c in zip(LETTERS[1:], comparisons, strict=False):
        click.echo(f"  {letter} vs A: {headline(c)}")
