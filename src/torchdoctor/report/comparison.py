"""The report of several runs of one workload (``torchdoctor report A B [C ...]``): each run
against the first, as ``torchdoctor compare`` sees it, in ONE self-contained HTML file. With
several runs a side (``report A1 A2 vs B1 B2``) the page holds one verdict, side B against
side A, each run one observation (compare's ``A1 A2 vs B1 B2``), and draws every run.

What it draws: the verdict of each comparison (compare's ratio and interval, its one
definition), the timelines of every run overlaid on one time axis (seconds from each run's
start, so a run that started later is not shifted), the phases of a step side by side as bars,
and the settings, environment and command lines that differ. The page is made of the same
parts as the one-run report (its CSS, its chart drawing and hover script), so it reads alike.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from html import escape
from pathlib import Path
from typing import Any

import torchdoctor
from torchdoctor.compare.runs import RunFigures, run_figures
from torchdoctor.compare.verdict import (
    BY_RUNS,
    FASTER,
    LETTERS,
    SLOWER,
    Comparison,
    compare_runs,
    headline,
    run_names,
)
from torchdoctor.errors import UserError
from torchdoctor.output_files import check_output_file, write_output_file
from torchdoctor.recording.reader import open_recording, require_regular_file
from torchdoctor.report.data import Diagnose, build_report_data
from torchdoctor.report.html import _chart, is_report, page
from torchdoctor.report.model import Chart, ReportData
from torchdoctor.report.scales import fmt_utc, fmt_value
from torchdoctor.report.svg import PALETTE_SIZE
from torchdoctor.thresholds import Thresholds

MAX_RUNS = len(LETTERS)


@dataclass(slots=True)
class Run:
    letter: str  # how the page names the run: A, B, C... or A1, A2, B1... with several a side
    side: str  # the side it is compared as: its letter, or A or B with several a side
    source: str
    data: ReportData
    figures: RunFigures


def write_comparison_report(
    recordings: list[str | os.PathLike[str]],
    out: str | os.PathLike[str] | None = None,
    thresholds: Thresholds | None = None,
    *,
    diagnose: Diagnose | None = None,
    force: bool = False,
    versus: int | None = None,
) -> tuple[Path, list[Comparison]]:
    """Write the report of ``recordings`` (two or more: each compared with the first) to
    ``out`` (default: beside the last, ``<last>-vs-<first>.html``), through
    :mod:`torchdoctor.output_files` as the one-run report is. Runs that are not the same
    workload are drawn with compare's reasons in a banner (a picture is asked for, not a
    verdict); a run with too few steady steps is refused in one line, as compare does.

    ``versus``: several runs a side. The first ``versus`` recordings are side A, the rest side
    B (at least 2 each), and one comparison is made, by runs, as ``compare A1 A2 vs B1 B2``."""
    if len(recordings) < 2:
        raise UserError("a comparison report needs two recordings or more")
    if len(recordings) > MAX_RUNS:
        raise UserError(f"a comparison report draws at most {MAX_RUNS} recordings")
    if versus is not None and min(versus, len(recordings) - versus) < 2:
        raise UserError(
            f"{versus} run(s) on side A and {len(recordings) - versus} on side B: with several "
            "runs a side each side needs at least 2"
        )
    sources = [Path(r) for r in recordings]
    for source in sources:  # files, before two of their names name the report (as report A)
        require_regular_file(source)
    target = (
        Path(out)
        if out is not None
        else sources[-1].with_name(f"{sources[-1].stem}-vs-{sources[0].stem}.html")
    )
    for source in sources:
        if target.resolve() == source.resolve():
            raise UserError(
                f"the report would overwrite the recording {str(source)!r}; choose -o FILE.html"
            )
    check_output_file(target, "-o", force=force, ours=is_report)
    if versus is None:
        names = list(LETTERS[: len(sources)])
        sides = names
    else:
        b_count = len(sources) - versus
        names = run_names("A", versus) + run_names("B", b_count)
        sides = ["A"] * versus + ["B"] * b_count
    runs = []
    for name, side, source in zip(names, sides, sources, strict=True):
        with open_recording(source) as rec:
            data = build_report_data(rec, thresholds or Thresholds(), diagnose=diagnose)
            runs.append(Run(name, side, str(source), data, run_figures(rec)))
    # Each side after the first against it, as `torchdoctor compare` makes them.
    groups = [[r for r in runs if r.side == side] for side in _sides(runs)]
    comparisons = [
        compare_runs(
            [r.figures for r in groups[0]],
            [r.figures for r in group],
            [[f.id for f in r.data.findings] for r in groups[0]],
            [[f.id for f in r.data.findings] for r in group],
            force=True,
        )
        for group in groups[1:]
    ]
    page = render_comparison(runs, comparisons)
    write_output_file(target, page, "-o", force=force, ours=is_report, errors="backslashreplace")
    return target, comparisons


def _sides(runs: list[Run]) -> list[str]:
    """The sides compared, in order: A, B, C... (one run each) or A and B (several each);
    each side after the first has its comparison with the first."""
    return list(dict.fromkeys(r.side for r in runs))


def render_comparison(runs: list[Run], comparisons: list[Comparison]) -> str:
    """The whole page."""
    letters = " vs ".join(" ".join(r.letter for r in runs if r.side == s) for s in _sides(runs))
    title = f"compare {letters}: " + " | ".join(r.data.title for r in runs[:2])
    span = max(r.data.span_s for r in runs)
    body = "".join(
        [
            "<header><h1>torchdoctor report <span>· runs of one workload side by side</span></h1>",
            "".join(
                f'<p class="command">{r.letter}: {escape(r.data.command or r.source)}</p>'
                for r in runs
            ),
            "</header>",
            '<nav><a href="#verdict">Verdict</a><a href="#phases">Phases</a>'
            '<a href="#differences">Differences</a><a href="#timelines">Timelines</a></nav>',
            "<main>",
            _verdicts(runs, comparisons),
            _phases(runs, comparisons),
            _differences(runs, comparisons),
            _timelines(runs, span),
            "</main>",
            f"<footer>Written by torchdoctor {escape(torchdoctor.__version__)} on "
            f"{escape(fmt_utc(time.time()))} from "
            f"{escape(', '.join(f'{r.letter}: {r.source}' for r in runs))}.</footer>",
        ]
    )
    return page(title, body, _CSS)


# Bars and the diff table; the run colours are the charts' palette (s0, s1...), so a run's bar
# and its curves share a colour where each run draws one series.
_CSS = """
.phase-bars td.bars { width: 60%; }
.phase-bars .bar { height: 14px; border-radius: 3px; margin: 2px 0; min-width: 1px; }
.phase-bars .bar-row { display: flex; align-items: center; gap: 8px; font-size: 12px; }
.phase-bars .bar-row .who { width: 14px; color: var(--muted); }
.phase-bars tr.moved td.phase { font-weight: 600; }
table.diff td.changed { background: var(--warn-bg); }
"""


def _how(c: Comparison, a: str, b: str) -> str:
    """What the verdict was computed from, under it."""
    steps = (
        f"{c.a_steps} steady steps of {a}'s {c.a_step_count}, {c.b_steps} of {b}'s "
        f"{c.b_step_count} ({c.warmup_rule})"
    )
    if c.method == BY_RUNS:
        return (
            f"{len(c.a_runs)} runs of {a}, {len(c.b_runs)} of {b}; {steps}. Each run is one "
            "observation, its figure the median of the means of its blocks of consecutive "
            "steps; the interval is Welch's t over the runs' figures, so it holds the spread "
            "between runs of the same command."
        )
    return (
        f"{steps}; a run's figure is the median of the means of its blocks of consecutive "
        "steps, the interval a block bootstrap."
    )


def _verdicts(runs: list[Run], comparisons: list[Comparison]) -> str:
    parts = ['<section id="verdict"><h2>Verdict</h2>']
    sides = _sides(runs)
    base = sides[0]
    for side, c in zip(sides[1:], comparisons, strict=True):
        level = {FASTER: "ok", SLOWER: "alert"}.get(c.verdict, "none")
        text = headline(c, base, side)
        parts.append(
            f'<div class="verdict level-{level}" data-run="{side}">'
            f"{side} vs {base}: {escape(text)}<small>{escape(_how(c, base, side))}</small></div>"
        )
        if c.mismatch:
            whose = "the runs are not all" if c.method == BY_RUNS else f"{side} is not"
            parts.append(
                f'<div class="banner">{whose} the same workload as '
                f"{runs[0].letter}: {escape('; '.join(c.mismatch))}.</div>"
            )
        for note in c.notes:
            parts.append(f'<div class="banner">{escape(note)}</div>')
        if c.explanations:
            parts.append(
                '<ul class="why">'
                + "".join(f"<li>{escape(line)}</li>" for line in c.explanations)
                + "</ul>"
            )
    parts.append("</section>")
    return "".join(parts)


def _phases(runs: list[Run], comparisons: list[Comparison]) -> str:
    """Per phase of a step, one bar per side (per run with one run a side), on one scale (the
    longest figure)."""
    sides = _sides(runs)
    per_side: dict[str, dict[str, float]] = {}
    moved: set[str] = set()
    labels: dict[str, str] = {}
    for c in comparisons:
        for p in c.phases:
            labels[p.phase] = p.label
            per_side.setdefault(p.phase, {})[sides[0]] = p.a_per_step_s
            moved |= {p.phase} if p.moved else set()
    for side, c in zip(sides[1:], comparisons, strict=True):
        for p in c.phases:
            per_side[p.phase][side] = p.b_per_step_s
    top = max((v for d in per_side.values() for v in d.values()), default=0.0) or 1.0
    of_runs = " (with several runs a side, the mean of its runs')" if len(sides) < len(runs) else ""
    parts = [
        '<section id="phases"><h2>Phases of a step</h2><p class="lead">Each side\'s figure per '
        f"step: the median of its block means{of_runs}. Bold: a phase that moved beyond the "
        'verdict\'s band.</p><table class="phase-bars"><thead><tr><th>phase</th><th>per step</th>'
        "<th></th></tr></thead><tbody>"
    ]
    for phase, values in per_side.items():
        bars = "".join(
            f'<div class="bar-row" data-run="{side}"><span class="who">{side}</span>'
            f'<div class="bar" style="width:{100 * max(values.get(side, 0.0), 0.0) / top:.1f}%;'
            f'background:var(--c{i % PALETTE_SIZE})"></div></div>'
            for i, side in enumerate(sides)
        )
        figures = "<br>".join(
            f"{side} {fmt_value(values[side], 's')}" for side in sides if side in values
        )
        cls = ' class="moved"' if phase in moved else ""
        parts.append(
            f'<tr{cls} data-phase="{escape(phase)}"><td class="phase">{escape(labels[phase])}'
            f'</td><td class="num">{figures}</td><td class="bars">{bars}</td></tr>'
        )
    parts.append("</tbody></table></section>")
    return "".join(parts)


def _differences(runs: list[Run], comparisons: list[Comparison]) -> str:
    """Settings, environment and command lines where any run differs from another."""
    parts = ['<section id="differences"><h2>What differs</h2>']
    head = "".join(f"<th>{r.letter}</th>" for r in runs)
    no_settings = [r.letter for r in runs if not r.figures.settings]
    for title, attr in (("Settings", "settings"), ("Environment", "environment")):
        if attr == "settings" and no_settings:
            parts.append(
                f'<h3>{title}</h3><p class="lead">{", ".join(no_settings)} holds no captured '
                "settings: settings not compared.</p>"
            )
            continue
        tables: list[dict[str, Any]] = [getattr(r.figures, attr) for r in runs]
        keys = sorted({k for t in tables for k in t})
        rows = [k for k in keys if len({repr(t.get(k)) for t in tables}) > 1]
        parts.append(f"<h3>{title}</h3>")
        if not rows:
            parts.append(f'<p class="lead">No {title.lower()} differ.</p>')
            continue
        parts.append(
            f'<table class="diff" data-diff="{attr}"><thead><tr><th>{title.lower()}</th>{head}'
            "</tr></thead><tbody>"
        )
        for key in rows:
            first = repr(tables[0].get(key))
            cells = "".join(
                f'<td class="mono{" changed" if repr(t.get(key)) != first else ""}">'
                f"{escape(_show(t.get(key)))}</td>"
                for t in tables
            )
            parts.append(f'<tr><td class="mono">{escape(key)}</td>{cells}</tr>')
        parts.append("</tbody></table>")
    commands = [r.data.command or "" for r in runs]
    if len(set(commands)) > 1:
        parts.append('<h3>Command lines</h3><table class="diff" data-diff="command"><tbody>')
        for r, command in zip(runs, commands, strict=True):
            parts.append(f'<tr><th>{r.letter}</th><td class="mono">{escape(command)}</td></tr>')
        parts.append("</tbody></table>")
    memory = "".join(
        f'<tr><th>{r.letter}</th><td class="num">{fmt_value(r.figures.peak_rss, "B")}</td>'
        f'<td class="num">{fmt_value(r.figures.peak_pss, "B")}</td>'
        f'<td class="num">{fmt_value(r.figures.peak_vram, "B")}</td></tr>'
        for r in runs
    )
    parts.append(
        '<h3>Memory</h3><table><thead><tr><th>run</th><th class="num">peak RSS</th>'
        f'<th class="num">peak PSS</th><th class="num">peak VRAM</th></tr></thead><tbody>{memory}'
        "</tbody></table>"
    )
    sides = _sides(runs)
    findings = [
        f"{side}: new {', '.join(c.findings_appeared)}"
        for side, c in zip(sides[1:], comparisons, strict=True)
        if c.findings_appeared
    ] + [
        f"{side}: gone {', '.join(c.findings_disappeared)}"
        for side, c in zip(sides[1:], comparisons, strict=True)
        if c.findings_disappeared
    ]
    if findings:
        parts.append(
            f"<h3>Findings against {sides[0]}</h3><ul>"
            + "".join(f"<li>{escape(line)}</li>" for line in findings)
            + "</ul>"
        )
    parts.append("</section>")
    return "".join(parts)


def _show(value: Any) -> str:
    return "unset" if value is None else str(value)


def overlay(chart_id: str, runs: list[Run]) -> Chart | None:
    """One chart with the series of every run that drew it, each labelled with its run (the
    first side's series solid, the others dashed); the first run's threshold bands and limits.
    None when no run drew it."""
    charts = [(r, c) for r in runs for c in r.data.charts if c.id == chart_id and not c.unavailable]
    if not charts:
        return None
    base = charts[0][1]
    series = [
        replace(s, label=f"{r.letter}: {s.label}", dashed=r.side != runs[0].side)
        for r, c in charts
        for s in c.series
    ]
    y_max = (
        None if any(c.y_max is None for _, c in charts) else max(c.y_max or 0 for _, c in charts)
    )
    return replace(
        base,
        series=series,
        markers=[],
        alerts=[],
        y_max=y_max,
        y_min_top=max(c.y_min_top for _, c in charts),
        note=f"{base.note} Time from each run's start; "
        + ", ".join(f"{r.letter}: {r.data.span_s:.0f} s" for r in runs)
        + ".",
    )


def _timelines(runs: list[Run], span: float) -> str:
    parts = [
        '<section id="timelines"><h2>Timelines</h2><p class="lead">Every run on one time axis, '
        "in seconds from its own start. Solid: "
        + ", ".join(r.letter for r in runs if r.side == runs[0].side)
        + "; dashed: "
        + ", ".join(r.letter for r in runs if r.side != runs[0].side)
        + ". Hover a chart to read values.</p>"
    ]
    seen: list[str] = []
    for run in runs:
        for chart in run.data.charts:
            if chart.id not in seen:
                seen.append(chart.id)
    for chart_id in seen:
        chart = overlay(chart_id, runs)
        if chart is not None:
            parts.append(_chart(chart, span))
    parts.append("</section>")
    return "".join(parts)
