"""The report as ONE self-contained HTML file: inline CSS, inline SVG charts, a small inline script.

Nothing is fetched when it opens (no CDN, no fonts, no images by URL), so it can be mailed,
attached to an issue or opened on an air-gapped cluster.
"""

from __future__ import annotations

import os
import shlex
import time
from html import escape
from importlib import resources
from pathlib import Path

import torchdoctor
from torchdoctor.diagnosis.findings import Evidence, Finding
from torchdoctor.errors import UserError
from torchdoctor.output_files import check_output_file, write_output_file
from torchdoctor.recording.reader import open_recording, require_regular_file
from torchdoctor.report.data import FINDING_CHARTS, Diagnose, build_report_data
from torchdoctor.report.memory import render_memory
from torchdoctor.report.model import Chart, Heatmap, ReportData
from torchdoctor.report.profiles import render_profiles
from torchdoctor.report.scales import fmt_clock, fmt_utc, fmt_value
from torchdoctor.report.svg import (
    PALETTE_SIZE,
    chart_json,
    heat_colour,
    render_chart,
    render_heatmap,
    shows_ref,
)
from torchdoctor.thresholds import Thresholds


def write_report(
    recording: str | os.PathLike[str],
    out: str | os.PathLike[str] | None = None,
    thresholds: Thresholds | None = None,
    *,
    diagnose: Diagnose | None = None,
    force: bool = False,
) -> tuple[Path, ReportData]:
    """Write the report of ``recording`` to ``out`` (default: beside it, ``.html``).

    Written by :mod:`torchdoctor.output_files`: an existing report torchdoctor wrote is replaced
    whole, any other existing file only with ``force``, a recording or anything that is not a
    regular file never; a failure never leaves half a report behind. Text that is not UTF-8
    (a command recorded with Latin-1 bytes) is written with backslash escapes.
    """
    source = Path(recording)
    # The default report is named after the recording: checked to be a file first, so a source
    # with no name ('' and '.' are the cwd, '/') says what it is instead of naming nothing.
    require_regular_file(source)
    target = Path(out) if out is not None else source.with_suffix(".html")
    if target.resolve() == source.resolve():
        raise UserError(
            f"the report would overwrite the recording {str(source)!r}; choose -o FILE.html"
        )
    # Checked before the recording is read: a bad -o fails at once, not after the diagnosis.
    check_output_file(target, "-o", force=force, ours=is_report)
    with open_recording(source) as rec:
        data = build_report_data(rec, thresholds or Thresholds(), diagnose=diagnose)
    page = render_html(data)
    write_output_file(target, page, "-o", force=force, ours=is_report, errors="backslashreplace")
    return target, data


def is_report(head: bytes) -> bool:
    """Whether a file starting with ``head`` is a report this module wrote."""
    return head.startswith(b"<!DOCTYPE html>") and b"<title>torchdoctor report: " in head


def render_html(data: ReportData) -> str:
    """The whole page for ``data``."""
    body = "".join(
        [
            _header(data),
            _nav(data),
            "<main>",
            _summary(data),
            _findings(data),
            render_profiles(data.profiles),
            render_memory(data.memory),
            _timelines(data),
            _processes(data),
            _settings(data),
            _events(data),
            _run(data),
            "</main>",
            f"<footer>Written by torchdoctor {escape(torchdoctor.__version__)} on "
            f"{escape(fmt_utc(time.time()))} from {escape(data.source)}.</footer>",
        ]
    )
    return page(data.title, body)


def page(title: str, body: str, extra_css: str = "") -> str:
    """A whole HTML document around ``body``: the report's CSS (and ``extra_css``) and its
    script inline, titled so that :func:`is_report` knows it."""
    css = _asset("report.css") + extra_css
    script = _asset("report.js")
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        # Forbid every fetch: the report must be complete as it is, and stay private.
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
        "style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:\">"
        f"<title>torchdoctor report: {escape(title)}</title>"
        f"<style>{css}</style></head><body>{body}<script>{script}</script></body></html>\n"
    )


def _asset(name: str) -> str:
    return (
        resources.files("torchdoctor.report").joinpath("assets", name).read_text(encoding="utf-8")
    )


# -- sections ----------------------------------------------------------------------------


def _header(data: ReportData) -> str:
    host = next(
        (v for s in data.meta if s.title == "Machine" for k, v in s.rows if k == "host name"), None
    )
    sub = [
        f"started {fmt_utc(data.started_at)}" if data.started_at else "",
        f"on {host}" if host else "",
        "" if data.command else f"recording {data.source}",
    ]
    return (
        "<header><h1>torchdoctor report <span>· what this training job used, and what held "
        "it back</span></h1>"
        + (f'<p class="command">$ {escape(data.command)}</p>' if data.command else "")
        + f'<p class="sub">{escape(" ".join(s for s in sub if s))}</p></header>'
    )


def _nav(data: ReportData) -> str:
    links = [
        ("summary", "Summary"),
        ("findings", f"Findings ({len(data.findings)})"),
        *([("profiles", "Profiled steps")] if data.profiles else []),
        *([("memory", "CUDA memory")] if data.memory else []),
        ("timelines", "Timelines"),
        ("processes", "Processes"),
        ("settings", "Settings"),
    ]
    if data.events:
        links.append(("events", "Events"))
    links.append(("run", "Run and machine"))
    return "<nav>" + "".join(f'<a href="#{a}">{escape(t)}</a>' for a, t in links) + "</nav>"


def _summary(data: ReportData) -> str:
    parts = ['<section id="summary"><h2>Summary</h2>']
    for note in data.state_notes:
        parts.append(f'<div class="banner">{escape(note)}</div>')
    if not data.complete and not data.state_notes:
        parts.append(
            '<div class="banner">This recording was cut short (the recorder stopped before the job '
            "ended): figures cover the time up to its last sample.</div>"
        )
    parts.append(f'<div class="verdict level-{data.verdict_level}">{escape(data.verdict)}')
    if data.findings:
        parts.append(
            "<small>See the findings below for the evidence and the change to make.</small>"
        )
    parts.append('</div><div class="figures">')
    for f in data.summary:
        parts.append(
            f'<div class="figure level-{f.level}"><div class="label">{escape(f.label)}</div>'
            f'<div class="value">{escape(f.value)}</div><div class="detail">{escape(f.detail)}</div></div>'
        )
    parts.append("</div></section>")
    return "".join(parts)


def _findings(data: ReportData) -> str:
    parts = ['<section id="findings"><h2>Findings</h2>']
    if data.diagnosis_note:
        parts.append(f'<p class="lead">No diagnosis: {escape(data.diagnosis_note)}.</p>')
    elif not data.findings:
        parts.append(
            '<p class="lead">No finding: nothing in this recording crossed a threshold.</p>'
        )
    else:
        parts.append(
            '<p class="lead">Most severe first. Each finding shows the measured evidence and the '
            "change to make, with values computed from this run.</p>"
        )
    titles = {c.id: c.title for c in data.charts if not c.unavailable}
    if not data.cores.unavailable:
        titles[data.cores.id] = data.cores.title
    for i, f in enumerate(data.findings):
        parts.append(_finding(i, f, data, titles))
    parts.append("</section>")
    return "".join(parts)


def _finding(index: int, f: Finding, data: ReportData, titles: dict[str, str]) -> str:
    sev = escape(f.severity)
    rows = "".join(
        f'<tr><td>{escape(e.label)}</td><td class="num">{escape(_evidence_value(e))}</td>'
        f"<td>{escape(_span(e, data))}</td></tr>"
        for e in f.evidence
    )
    settings = ""
    if f.settings:
        settings = (
            "<p><strong>Settings:</strong> <code>"
            + escape(", ".join(f"{k}={v}" for k, v in f.settings.items()))
            + "</code></p>"
        )
    details = f"<p>{escape(f.details)}</p>" if f.details else ""
    chart = FINDING_CHARTS.get(f.id)
    if chart in titles:
        details += (
            f'<p class="see">See it on the timeline: <a href="#chart-{chart}">'
            f"{escape(titles[chart])}</a>.</p>"
        )
    return (
        f'<article class="finding sev-{sev}" id="finding-{index}" data-finding="{escape(f.id)}">'
        f'<h3><span class="badge sev-{sev}">{sev}</span>{escape(f.title)}'
        f'<span class="rid">{escape(f.id)}</span>'
        f'<span class="conf">confidence {round(100 * f.confidence)} %</span></h3>'
        + (
            f'<table><thead><tr><th>evidence</th><th class="num">measured</th><th>when</th></tr></thead>'
            f"<tbody>{rows}</tbody></table>"
            if rows
            else ""
        )
        + f'<div class="recommendation"><strong>Recommendation</strong>{escape(f.recommendation)}</div>'
        + (
            f'<p class="effect">Expected effect: {escape(f.expected_effect)}</p>'
            if f.expected_effect
            else ""
        )
        + settings
        + details
        + "</article>"
    )


def _evidence_value(e: Evidence) -> str:
    if isinstance(e.value, (int, float)) and not isinstance(e.value, bool):
        return fmt_value(e.value, e.unit)
    return f"{e.value} {e.unit}".strip()


def _span(e: Evidence, data: ReportData) -> str:
    if e.t_start is None or data.started_at is None:
        return "whole run"
    start = fmt_clock(e.t_start - data.started_at)
    if e.t_end is None or abs(e.t_end - e.t_start) < 0.5:
        return f"at {start}"
    return f"{start} to {fmt_clock(e.t_end - data.started_at)}"


def _timelines(data: ReportData) -> str:
    parts = [
        '<section id="timelines"><h2>Timelines</h2>'
        '<p class="lead">Time runs from the start of the job. Shaded: the threshold table\'s '
        '<span style="color:var(--ok)">best range</span> and '
        '<span style="color:var(--alert)">alert range</span>. Hover a chart to read values.</p>'
    ]
    if data.resolution_note:
        parts.append(f'<p class="lead">{escape(data.resolution_note)}</p>')
    related: dict[str, str] = {}
    for i, f in enumerate(data.findings):
        chart = FINDING_CHARTS.get(f.id)
        if chart:
            related[chart] = related.get(chart, "") + (
                f'<a class="badge sev-{escape(f.severity)}" href="#finding-{i}">'
                f"{escape(f.severity)}: {escape(f.title)}</a> "
            )
    for chart in data.charts:
        parts.append(_chart(chart, data.span_s, related.get(chart.id, "")))
        if chart.id == "cpu":
            parts.append(_heatmap(data.cores, data.span_s, related.get(data.cores.id, "")))
    parts.append(
        "<h3>Threshold table applied</h3><table><thead><tr><th>metric</th><th>alert</th>"
        "<th>best range</th></tr></thead><tbody>"
    )
    for metric, alert, best in data.thresholds:
        parts.append(
            f"<tr><td>{escape(metric)}</td><td>{escape(alert)}</td><td>{escape(best)}</td></tr>"
        )
    parts.append("</tbody></table></section>")
    return "".join(parts)


def _chart(chart: Chart, span: float, related: str = "") -> str:
    head = (
        f'<figure class="chart-box" id="chart-{escape(chart.id)}" data-chart="{escape(chart.id)}">'
    )
    head += f"<h3>{escape(chart.title)}</h3>"
    if related:
        head += f'<div class="related">{related}</div>'
    if chart.unavailable:
        return (
            head
            + f'<div class="unavailable" data-unavailable="yes">{escape(chart.unavailable)}</div>'
            + f"<figcaption>{escape(chart.note)}</figcaption></figure>"
        )
    legend = ['<div class="legend">']
    for i, s in enumerate(chart.series):
        summary = f"mean {fmt_value(s.mean, chart.unit)} · peak {fmt_value(s.peak, chart.unit)}"
        dashed = " dashed" if s.dashed else ""
        legend.append(
            f'<span class="item"><span class="swatch s{i % PALETTE_SIZE}{dashed}"></span>{escape(s.label)} '
            f'<span class="val" data-summary="{escape(summary)}">{escape(summary)}</span></span>'
        )
    legend.append('<span class="at"></span></div>')
    return (
        head
        + "".join(legend)
        + render_chart(chart, span)
        + f"<figcaption>{escape(chart.note)}{_off_chart_refs(chart)}{_alert_text(chart)}</figcaption>"
        + f'<script type="application/json" class="chart-data">{chart_json(chart, span)}</script>'
        + "</figure>"
    )


def _heatmap(heatmap: Heatmap, span: float, related: str = "") -> str:
    head = (
        f'<figure class="chart-box heat" id="chart-{escape(heatmap.id)}" '
        f'data-chart="{escape(heatmap.id)}"><h3>{escape(heatmap.title)}</h3>'
    )
    if related:
        head += f'<div class="related">{related}</div>'
    if heatmap.unavailable:
        return (
            head
            + f'<div class="unavailable" data-unavailable="yes">{escape(heatmap.unavailable)}</div>'
            + f"<figcaption>{escape(heatmap.note)}</figcaption></figure>"
        )
    scale = (
        '<div class="legend heat-scale">idle <span class="gradient" style="background:'
        f"linear-gradient(to right, {', '.join(heat_colour(v) for v in (0, 25, 50, 75, 100))})"
        '"></span> fully busy</div>'
    )
    return (
        head
        + scale
        + render_heatmap(heatmap, span)
        + f"<figcaption>{escape(heatmap.note)}</figcaption></figure>"
    )


def _off_chart_refs(chart: Chart) -> str:
    peak = max([s.peak or 0.0 for s in chart.series] + [0.0])
    hidden = [r.label for r in chart.refs if not shows_ref(r.value, peak)]
    return f" Above the top of the chart: {escape(', '.join(hidden))}." if hidden else ""


def _alert_text(chart: Chart) -> str:
    return "".join(
        f'<span class="alert-note">Red stretch: {escape(a.label)}, '
        f"from {fmt_clock(a.t_start)} to {fmt_clock(a.t_end)}.</span>"
        for a in chart.alerts
    )


def _processes(data: ReportData) -> str:
    parts = [
        '<section id="processes"><h2>Processes</h2>'
        f'<p class="lead">{data.process_count} process{"es" if data.process_count != 1 else ""} '
        "of the job, as a tree. CPU: 100 % = one full core. PSS splits shared pages between "
        "processes; RSS counts them in each.</p>"
    ]
    if not data.processes:
        parts.append('<p class="unavailable">No process of the job was recorded.</p></section>')
        return "".join(parts)
    parts.append(
        '<div class="scroll"><table class="tree"><thead><tr><th>process</th><th>role</th><th>seen</th>'
        '<th class="num">CPU mean</th><th class="num">CPU peak</th><th class="num">RSS peak</th>'
        '<th class="num">PSS peak</th><th class="num">threads</th><th class="num">swap peak</th>'
        "<th>command line</th></tr></thead><tbody>"
    )
    for p in data.processes:
        indent = f"padding-left:{8 + 18 * p.depth}px"
        glyph = "└ " if p.depth else ""
        role = p.role + (f" {p.rank}" if p.rank is not None else "")
        if p.folded:
            who = f"{glyph}… {p.folded} more {escape(p.name)}"
            cls = ' class="folded"'
        else:
            who = f'{glyph}{escape(p.name)} <span class="mono">{p.pid}</span>'
            cls = ""
        seen = (
            f"{fmt_clock(p.first_seen)}–{fmt_clock(p.last_seen)}"
            if p.first_seen is not None and p.last_seen is not None
            else "n/a"
        )
        parts.append(
            f'<tr{cls}><td class="proc" style="{indent}">{who}</td>'
            f'<td><span class="role role-{escape(p.role)}">{escape(role)}</span></td>'
            f'<td class="seen">{seen}</td>'
            f'<td class="num">{fmt_value(p.mean_cpu, "%")}</td><td class="num">{fmt_value(p.peak_cpu, "%")}</td>'
            f'<td class="num">{fmt_value(p.peak_rss, "B")}</td><td class="num">{fmt_value(p.peak_pss, "B")}</td>'
            f'<td class="num">{fmt_value(p.peak_threads, "")}</td><td class="num">{fmt_value(p.peak_swap, "B")}</td>'
            f'<td class="cmd">{escape(shlex.join(p.cmdline) or p.name)}</td></tr>'
        )
    parts.append("</tbody></table></div></section>")
    return "".join(parts)


def _settings(data: ReportData) -> str:
    parts = ['<section id="settings"><h2>Settings in force</h2>']
    if data.settings:
        parts.append(
            '<table class="settings"><thead><tr><th>setting</th><th>value</th><th>where</th></tr></thead><tbody>'
        )
        group = None
        for s in data.settings:
            if s.group != group:
                group = s.group
                parts.append(f'<tr class="group"><td colspan="3">{escape(group)}</td></tr>')
            parts.append(
                f'<tr><td class="mono">{escape(s.key)}</td><td class="mono">{escape(s.value)}</td>'
                f"<td>{escape(s.where)}</td></tr>"
            )
        parts.append("</tbody></table>")
    else:
        parts.append(
            '<p class="lead">No settings were captured: the job ran without torchdoctor\'s '
            "instrumentation (threads, optimizer and mixed precision are read inside the job).</p>"
        )
    parts.append("<h3>DataLoaders</h3>")
    if data.dataloaders:
        cols = list(data.dataloaders[0])
        parts.append(
            '<div class="scroll"><table class="loaders"><thead><tr>'
            + "".join(f"<th>{escape(c.replace('_', ' '))}</th>" for c in cols)
        )
        parts.append("</tr></thead><tbody>")
        for row in data.dataloaders:
            parts.append("<tr>" + "".join(f"<td>{escape(row[c])}</td>" for c in cols) + "</tr>")
        parts.append("</tbody></table></div>")
    else:
        parts.append('<p class="lead">No DataLoader was recorded.</p>')
    if data.precision:
        parts.append("<h3>Precision and CUDA memory in the steps</h3><table><tbody>")
        for k, v in data.precision:
            parts.append(f"<tr><th>{escape(k)}</th><td>{escape(v)}</td></tr>")
        parts.append("</tbody></table>")
    parts.append("</section>")
    return "".join(parts)


def _events(data: ReportData) -> str:
    if not data.events:
        return ""
    parts = [
        '<section id="events"><h2>Events</h2><table><thead><tr><th>when</th><th>where</th>'
        "<th>what</th><th>detail</th></tr></thead><tbody>"
    ]
    for e in data.events:
        parts.append(
            f'<tr class="event-{escape(e.level)}"><td>{fmt_clock(e.t)}</td><td>{escape(e.where)}</td>'
            f'<td class="mono nowrap">{escape(e.kind)}</td><td>{escape(e.detail)}</td></tr>'
        )
    parts.append("</tbody></table></section>")
    return "".join(parts)


def _run(data: ReportData) -> str:
    parts = ['<section id="run"><h2>Run and machine</h2><div class="meta-grid">']
    for section in data.meta:
        parts.append(f"<div><h3>{escape(section.title)}</h3><table><tbody>")
        for k, v in section.rows:
            parts.append(f"<tr><th>{escape(k)}</th><td>{escape(v)}</td></tr>")
        parts.append("</tbody></table></div>")
    parts.append("</div></section>")
    return "".join(parts)
