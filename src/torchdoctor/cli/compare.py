"""``torchdoctor compare A B``: did B get faster or slower than A, which phase moved, and why."""

from __future__ import annotations

import contextlib
import math
from typing import Any

import click
from rich.table import Table
from rich.text import Text

from torchdoctor.cli.exit_codes import REGRESSED
from torchdoctor.cli.json_output import dump_json
from torchdoctor.cli.recordings import RECORDING, RECORDING_OR_VERSUS, VERSUS, versus_sides
from torchdoctor.compare.runs import RunFigures, run_figures
from torchdoctor.compare.verdict import (
    BY_RUNS,
    FASTER,
    LETTERS,
    SLOWER,
    Comparison,
    compare_runs,
    headline,
)
from torchdoctor.errors import UserError
from torchdoctor.recording.reader import open_recording
from torchdoctor.units import fmt_bytes, fmt_duration, one_line


def _percentage(ctx: click.Context, param: click.Parameter, value: float | None):
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a percentage", ctx, param)
    return value


@click.command("compare")
@click.argument("a", type=RECORDING)
@click.argument(
    "others",
    nargs=-1,
    required=True,
    type=RECORDING_OR_VERSUS,
    metavar="B [C ...] | A2 ... vs B1 B2 ...",
)
@click.option("--json", "as_json", is_flag=True, help="Print the comparison as JSON.")
@click.option(
    "--force",
    is_flag=True,
    help="Compare runs that are not the same workload (another script, batch size or model "
    "size); refused without it.",
)
@click.option(
    "--fail-if-slower",
    "fail_slower",
    type=click.FloatRange(min=0),
    callback=_percentage,
    metavar="PCT",
    help="Exit 4 when B's (or any later run's) step is slower than A's by more than PCT "
    "percent with 95 % confidence (the interval's low end above it), for CI.",
)
@click.option(
    "--fail-if-more-memory",
    "fail_memory",
    type=click.FloatRange(min=0),
    callback=_percentage,
    metavar="PCT",
    help="Exit 4 when B's peak RSS is above A's by more than PCT percent.",
)
@click.pass_context
def command(
    ctx: click.Context,
    a: str,
    others: tuple[str, ...],
    as_json: bool,
    force: bool,
    fail_slower: float | None,
    fail_memory: float | None,
) -> None:
    """Compare run B with run A (the baseline): faster, slower or no significant change,
    with the ratio of their step times and its 95 % interval; each phase of the step
    (data wait, compute); the settings, environment and command line that differ and which
    of them explains the phase that moved; memory peaks; findings that appeared or went.

    A and B are recordings, or `last`, `last~1` (the one before it), ... Steps of each
    process's warm-up are left out, as in `show`. Runs that are not the same workload are
    refused unless --force. Exits 4 when a --fail-if-... limit is passed, 2 on bad input.

    With more runs (`compare A B C ...`) each is compared with A, one section each, and the
    limits apply to every one of them.

    Several runs a side (`compare A1 A2 A3 vs B1 B2 B3`, at least 2 each): each run counts
    as one observation, so the interval holds the spread between runs of the same command
    too, which one run a side cannot see; use it where a few percent matter (a CI gate).
    """
    from torchdoctor.thresholds import load_thresholds

    thresholds = load_thresholds(None)
    if VERSUS in others:
        sides = versus_sides(a, others, "compare")
    elif len(others) + 1 > len(LETTERS):
        raise UserError(f"compare takes at most {len(LETTERS)} recordings")
    else:
        sides = [[path] for path in (a, *others)]
    complaints: list[str] = []
    figures: list[list[RunFigures]] = [[] for _ in sides]
    findings: list[list[list[str]]] = [[] for _ in sides]
    for side, paths in enumerate(sides):
        for path in paths:
            with open_recording(path) as rec:
                figures[side].append(run_figures(rec))
                findings[side].append(_finding_ids(rec, thresholds, complaints.append))
    # Every comparison is made (and a refusal raised) before anything is printed: each side
    # after the first against it (A B C...: one run a side; A1 .. vs B1 ..: two sides).
    comparisons = [
        compare_runs(figures[0], fig, findings[0], found, force=force)
        for fig, found in zip(figures[1:], findings[1:], strict=True)
    ]
    letters = LETTERS[1 : len(comparisons) + 1]
    per_run = [
        _regressions(c, fail_slower, fail_memory, b)
        for b, c in zip(letters, comparisons, strict=True)
    ]
    regressions = [line for lines in per_run for line in lines]
    for line in complaints:
        click.echo(f"torchdoctor: {line}", err=True)
    if as_json:
        documents = []
        for c, lines in zip(comparisons, per_run, strict=True):
            document = c.to_dict()
            document["regressions"] = lines
            documents.append(document)
        if len(documents) == 1:
            dump_json("compare", documents[0])
        else:
            dump_json(
                "compare",
                {
                    "a": a,
                    "runs": list(others),
                    "comparisons": documents,
                    "regressions": regressions,
                },
            )
    else:
        for i, (b, c) in enumerate(zip(letters, comparisons, strict=True)):
            if len(comparisons) > 1:
                if i:
                    click.echo()
                click.echo(f"== {b} vs A " + "=" * 60)
            render(c, b)
    if regressions:
        for line in regressions:
            click.echo(f"torchdoctor: {line}", err=True)
        ctx.exit(REGRESSED)


def _finding_ids(rec: Any, thresholds: Any, complain: Any) -> list[str]:
    from torchdoctor.diagnosis.engine import diagnose

    with contextlib.suppress(UserError):
        return [f.id for f in diagnose(rec, thresholds, complain=complain)]
    return []


def _regressions(
    c: Comparison, slower_pct: float | None, memory_pct: float | None, b: str = "B"
) -> list[str]:
    """What passed a --fail-if-... limit, one line each."""
    out = []
    if slower_pct is not None:
        low = c.slowdown.low
        if math.isfinite(low) and low * 100 > slower_pct:
            out.append(
                f"{b} is slower than A by {_pct(c.slowdown.estimate)} (at least {_pct(low)} with "
                f"95 % confidence), beyond --fail-if-slower {slower_pct:g}"
            )
    if memory_pct is not None:
        if c.a_peak_rss is None or c.b_peak_rss is None or c.a_peak_rss <= 0:
            raise UserError("--fail-if-more-memory: peak RSS was not recorded in both runs")
        grew = c.b_peak_rss / c.a_peak_rss - 1
        if grew * 100 > memory_pct:
            out.append(
                f"{b}'s peak RSS {fmt_bytes(c.b_peak_rss)} is {_pct(grew)} above A's "
                f"{fmt_bytes(c.a_peak_rss)}, beyond --fail-if-more-memory {memory_pct:g}"
            )
    return out


def _pct(share: float) -> str:
    return f"{share * 100:.1f} %"


def _ms(seconds: float) -> str:
    return fmt_duration(seconds)


def _signed(seconds: float) -> str:
    return ("+" if seconds > 0 else "-" if seconds < 0 else "") + fmt_duration(abs(seconds))


def render(c: Comparison, b: str = "B") -> None:
    """Print the comparison for a person; ``b`` names the run compared with A."""
    from torchdoctor.terminal import make_console

    console = make_console(soft_wrap=True)
    style = {FASTER: "bold green", SLOWER: "bold red"}.get(c.verdict, "bold")
    console.print(Text(headline(c, "A", b), style=style))
    console.print(
        Text(
            f"compared: {c.a_steps} steady steps of A's {c.a_step_count}, {c.b_steps} of {b}'s "
            f"{c.b_step_count} ({c.warmup_rule}); a run's figure is the median of the means "
            "of its blocks of consecutive steps"
            + (
                f"; {len(c.a_runs)} runs against {len(c.b_runs)}, each one observation "
                "(Welch's t interval over the runs)"
                if c.method == BY_RUNS
                else ""
            ),
            style="dim",
        )
    )
    if c.method == BY_RUNS:
        for side, paths in (("A", c.a_runs), (b, c.b_runs)):
            for i, path in enumerate(paths, 1):
                console.print(Text(f"{side}{i}: {path}"))
    else:
        console.print(Text(f"A: {c.a}"))
        console.print(Text(f"{b}: {c.b}"))
    if b != "B":  # the reasons below are worded for a pair
        console.print(Text(f"(in the lines below, B is {b})", style="dim"))
    for note in c.notes:
        console.print(Text(f"note: {note}", style="yellow"))
    if c.mismatch:
        console.print(Text("not the same workload (--force): " + "; ".join(c.mismatch), "yellow"))

    table = Table(box=None, pad_edge=False, title_justify="left")
    for name in ("per step", "A", b, f"{b} - A", "95 % interval"):
        table.add_column(name, justify="left" if name == "per step" else "right")
    for p in c.phases:
        table.add_row(
            Text(p.label, style="bold" if p.moved else ""),
            _ms(p.a_per_step_s),
            _ms(p.b_per_step_s),
            Text(_signed(p.delta.estimate), style="bold" if p.moved else ""),
            f"{_signed(p.delta.low)} to {_signed(p.delta.high)}",
        )
    console.print()
    console.print(table)

    if c.explanations:
        console.print()
        console.print(Text("Why", style="bold"))
        for line in c.explanations:
            console.print(Text(f"  {line}"))
    for title, diffs in (("Settings that differ", c.settings), ("Environment", c.environment)):
        if not diffs:
            continue
        console.print()
        console.print(Text(title, style="bold"))
        grid = Table(box=None, pad_edge=False, show_header=True)
        grid.add_column("")
        grid.add_column("A")
        grid.add_column(b)
        for d in diffs:
            grid.add_row(d.key, _value(d.a), _value(d.b))
        console.print(grid)
    if c.command is not None:
        console.print()
        console.print(Text("Command lines differ", style="bold"))
        console.print(Text(f"  A: {one_line(c.command.a)}"))
        console.print(Text(f"  {b}: {one_line(c.command.b)}"))
    console.print()
    console.print(Text("Memory and machine", style="bold"))
    console.print(Text(f"  peak RSS  A {fmt_bytes(c.a_peak_rss)}, {b} {fmt_bytes(c.b_peak_rss)}"))
    console.print(Text(f"  peak PSS  A {fmt_bytes(c.a_peak_pss)}, {b} {fmt_bytes(c.b_peak_pss)}"))
    if c.a_peak_vram is not None or c.b_peak_vram is not None:
        console.print(
            Text(f"  peak VRAM  A {fmt_bytes(c.a_peak_vram)}, {b} {fmt_bytes(c.b_peak_vram)}")
        )
    if c.a_other_cpus is not None and c.b_other_cpus is not None:
        console.print(
            Text(
                f"  other programs' CPU use  A {c.a_other_cpus:.1f} CPUs, "
                f"{b} {c.b_other_cpus:.1f} CPUs on average"
                + (f" ({b}'s machine was busier)" if c.busier else ""),
            )
        )
    if c.findings_appeared or c.findings_disappeared:
        console.print()
        console.print(Text("Findings", style="bold"))
        if c.findings_appeared:
            console.print(Text(f"  new in {b}: " + ", ".join(c.findings_appeared)))
        if c.findings_disappeared:
            console.print(Text(f"  gone in {b}: " + ", ".join(c.findings_disappeared)))


def _value(value: Any) -> str:
    return "unset" if value is None else str(value)
