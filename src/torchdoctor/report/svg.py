"""One timeline chart as inline SVG: axes, the threshold bands, limit lines, markers and series.

Drawn in Python so the report needs no script to show its charts and opens offline in any
browser; the report's small script only adds the hover read-out on top of the SVG.
"""

from __future__ import annotations

import json
import math
from html import escape

from torchdoctor.report.model import Chart, Heatmap
from torchdoctor.report.scales import PERCENT, fmt_clock, nice_ticks, scale_for, time_ticks

WIDTH = 1000
HEIGHT = 250
LEFT, RIGHT, TOP, BOTTOM = 72, 16, 14, 30
PLOT_W = WIDTH - LEFT - RIGHT
PLOT_H = HEIGHT - TOP - BOTTOM
PALETTE_SIZE = 8  # colours are CSS classes s0..s7 (colour-blind safe palette in report.css)


def y_top(chart: Chart) -> float:
    """The value at the top of the plot: fixed for shares of a whole, else room over the data.

    ``y_max`` alone fixes the top (CPU is 0-100 % of the machine); with ``y_min_top`` as well it
    caps a top that otherwise follows the data but never hides the alert band. A top that
    follows the data is rounded up to a tick, so the highest gridline carries a label.
    """
    if chart.y_max is not None and chart.y_min_top == 0:
        return chart.y_max
    data_peak = max([s.peak or 0.0 for s in chart.series] + [0.0])
    highest = max([data_peak] + [r.value for r in chart.refs if shows_ref(r.value, data_peak)])
    top = max(highest * 1.08, chart.y_min_top) or 1.0
    _, factor = scale_for(chart.unit, top)
    ticks = nice_ticks(0.0, top / factor)
    step = ticks[1] - ticks[0] if len(ticks) > 1 else top / factor
    rounded = math.ceil(top / factor / step - 1e-9) * step * factor
    return min(rounded, chart.y_max) if chart.y_max is not None else rounded


def shows_ref(value: float, data_peak: float) -> bool:
    """A limit far above the data (64 GiB of RAM over a 2 GiB job) would flatten the lines
    against the floor: such a limit is named in the caption instead of drawn."""
    return value <= 4 * data_peak


def render_chart(chart: Chart, span: float) -> str:
    """The chart as an ``<svg>`` element plus the JSON its hover read-out uses."""
    top = y_top(chart)
    span = max(span, max((p[0] for s in chart.series for p in s.points), default=0.0), 1e-9)

    def x(t: float) -> float:
        return _time_x(t, span)

    def y(v: float) -> float:
        return TOP + PLOT_H * (1.0 - min(max(v / top, 0.0), 1.0))

    parts: list[str] = [
        f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
        f'aria-label="{escape(chart.title)} over time" data-chart="{escape(chart.id)}" '
        f'data-span="{span:.6g}" data-top="{top:.6g}">'
    ]
    parts.append(f'<rect class="plot" x="{LEFT}" y="{TOP}" width="{PLOT_W}" height="{PLOT_H}"/>')
    for band in chart.bands:
        high = top if band.high is None else min(band.high, top)
        if band.low >= top or high <= band.low:
            continue
        y1, y2 = y(high), y(band.low)
        parts.append(
            f'<rect class="band band-{band.kind}" x="{LEFT}" y="{y1:.1f}" width="{PLOT_W}" '
            f'height="{max(y2 - y1, 0.8):.1f}" data-low="{band.low:.6g}"><title>{escape(band.label)}</title></rect>'
        )
        label_y = y1 + 12 if y2 - y1 >= 14 else y1 - 3
        parts.append(
            f'<text class="band-label band-label-{band.kind}" x="{LEFT + PLOT_W - 6}" '
            f'y="{label_y:.1f}" text-anchor="end">{escape(band.label)}</text>'
        )
    name, factor = scale_for(chart.unit, top)
    for tick in nice_ticks(0.0, top / factor):
        value = tick * factor
        if value > top * 1.0001:
            continue
        ty = y(value)
        label = (
            f"{_tick_text(tick)} {name}".strip()
            if chart.unit != PERCENT
            else f"{_tick_text(tick)} %"
        )
        parts.append(
            f'<line class="grid" x1="{LEFT}" x2="{LEFT + PLOT_W}" y1="{ty:.1f}" y2="{ty:.1f}"/>'
        )
        parts.append(
            f'<text class="tick" x="{LEFT - 6}" y="{ty + 4:.1f}" text-anchor="end">{escape(label)}</text>'
        )
    parts += _time_axis(span, TOP + PLOT_H)
    for ref in chart.refs:
        if ref.value > top:
            continue
        ry = y(ref.value)
        parts.append(
            f'<line class="ref" x1="{LEFT}" x2="{LEFT + PLOT_W}" y1="{ry:.1f}" y2="{ry:.1f}"/>'
        )
        parts.append(
            f'<text class="ref-label" x="{LEFT + 6}" y="{ry - 4:.1f}">{escape(ref.label)}</text>'
        )
    for i, marker in enumerate(chart.markers):
        mx = x(marker.t)
        parts.append(
            f'<line class="marker marker-{marker.kind}" x1="{mx:.1f}" x2="{mx:.1f}" y1="{TOP}" y2="{TOP + PLOT_H}">'
            f"<title>{escape(marker.label or marker.kind)} at {fmt_clock(marker.t)}</title></line>"
        )
        if marker.label and (marker.kind == "error" or i < 30):
            parts.append(
                f'<text class="marker-label" x="{mx + 3:.1f}" y="{TOP + 10}">{escape(marker.label)}</text>'
            )
    for alert in chart.alerts:
        ax1, ax2 = x(alert.t_start), x(alert.t_end)
        width = max(ax2 - ax1, 2.0)
        parts.append(
            f'<rect class="alert-span" x="{ax1:.1f}" y="{TOP}" width="{width:.1f}" height="{PLOT_H}">'
            f"<title>{escape(alert.label)}</title></rect>"
            f'<rect class="alert-bar" x="{ax1:.1f}" y="{TOP}" width="{width:.1f}" height="4"/>'
        )
    for i, series in enumerate(chart.series):
        cls = f"series s{i % PALETTE_SIZE}" + (" dashed" if series.dashed else "")
        path, dots = _path(series.points, x, y)
        drawn = sum(1 for p in series.points if p[1] is not None)
        parts.append(
            f'<path class="{cls}" d="{path}" data-points="{drawn}" data-label="{escape(series.label)}"/>'
        )
        for cx, cy in dots:
            parts.append(f'<circle class="{cls} dot" cx="{cx:.1f}" cy="{cy:.1f}" r="2.5"/>')
    parts.append(
        f'<line class="crosshair" x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{TOP + PLOT_H}" visibility="hidden"/>'
    )
    parts.append(
        f'<rect class="hover" x="{LEFT}" y="{TOP}" width="{PLOT_W}" height="{PLOT_H}" fill="transparent"/>'
    )
    parts.append("</svg>")
    return "".join(parts)


def chart_json(chart: Chart, span: float) -> str:
    """The drawn points for the hover read-out, safe to embed in a ``<script>`` element."""
    data = {
        "unit": chart.unit,
        "span": span,
        "geometry": [LEFT, TOP, PLOT_W, PLOT_H, WIDTH, HEIGHT],
        "series": [
            {
                "label": s.label,
                "points": [[round(t, 3), None if v is None else _compact(v)] for t, v in s.points],
            }
            for s in chart.series
        ],
    }
    # No "<" at all, so no label can end the script element early or open a comment in it.
    return json.dumps(data, separators=(",", ":")).replace("<", "\\u003c")


def _path(points, x, y) -> tuple[str, list[tuple[float, float]]]:
    """SVG path data with a new sub-path after every gap; lone points come back as dots."""
    commands: list[str] = []
    dots: list[tuple[float, float]] = []
    run: list[tuple[float, float]] = []

    def close_run() -> None:
        if len(run) == 1:
            dots.append(run[0])
        elif run:
            commands.append("M" + " L".join(f"{px:.1f},{py:.1f}" for px, py in run))
        run.clear()

    for t, v in points:
        if v is None:
            close_run()
            continue
        run.append((x(t), y(v)))
    close_run()
    return " ".join(commands), dots


def _compact(value: float) -> float:
    return float(f"{value:.5g}")


def _tick_text(value: float) -> str:
    text = f"{value:.6g}"
    return text


# Sequential blues from idle to fully busy; light enough at 0 % that idle CPUs read as empty.
HEAT_STOPS = (
    (0.0, (247, 251, 255)),
    (25.0, (198, 219, 239)),
    (50.0, (107, 174, 214)),
    (75.0, (33, 113, 181)),
    (100.0, (8, 48, 107)),
)
HEAT_LEVELS = 20  # colours are quantized so that equal neighbours merge into one rectangle


def heat_colour(value: float) -> str:
    level = round(min(max(value, 0.0), 100.0) / 100.0 * HEAT_LEVELS) * 100.0 / HEAT_LEVELS
    for (v0, c0), (v1, c1) in zip(HEAT_STOPS, HEAT_STOPS[1:], strict=False):
        if level <= v1:
            f = (level - v0) / (v1 - v0)
            r, g, b = (round(a + (z - a) * f) for a, z in zip(c0, c1, strict=True))
            return f"#{r:02x}{g:02x}{b:02x}"
    return "#08306b"


def _time_x(t: float, span: float) -> float:
    """Where elapsed time ``t`` lies on a time axis ``span`` seconds long (charts and heatmap
    share it, so their moments line up)."""
    return LEFT + PLOT_W * min(max(t / span, 0.0), 1.0)


def _time_axis(span: float, bottom: float) -> list[str]:
    """Ticks and clock labels of the time axis under a plot whose bottom edge is ``bottom``."""
    parts = []
    for tick in time_ticks(span):
        tx = _time_x(tick, span)
        parts.append(
            f'<line class="xtick" x1="{tx:.1f}" x2="{tx:.1f}" y1="{bottom}" y2="{bottom + 4}"/>'
        )
        parts.append(
            f'<text class="tick" x="{tx:.1f}" y="{bottom + 18}" text-anchor="middle">'
            f"{fmt_clock(tick)}</text>"
        )
    return parts


def render_heatmap(heatmap: Heatmap, span: float) -> str:
    """The per-CPU heatmap on the same time axis as the charts."""
    nrows = len(heatmap.rows)
    row_h = max(3, min(22, 240 // max(nrows, 1)))
    height = TOP + nrows * row_h + BOTTOM
    span = max(span, heatmap.t_edges[-1] if heatmap.t_edges else 0.0, 1e-9)

    def x(t: float) -> float:
        return _time_x(t, span)

    parts = [
        f'<svg class="chart heatmap" viewBox="0 0 {WIDTH} {height}" role="img" '
        f'aria-label="{escape(heatmap.title)} over time" data-chart="{escape(heatmap.id)}">'
        f'<rect class="plot" x="{LEFT}" y="{TOP}" width="{PLOT_W}" height="{nrows * row_h}"/>'
    ]
    label_every = max(1, math.ceil(11 / row_h))
    edges = heatmap.t_edges
    for i, (label, cells) in enumerate(zip(heatmap.rows, heatmap.cells, strict=True)):
        y = TOP + i * row_h
        measured = [v for v in cells if v is not None]
        mean = sum(measured) / len(measured) if measured else None
        tip = f"{label}: mean busy {mean:.0f} %" if mean is not None else f"{label}: no reading"
        parts.append(f'<g class="core-row" data-row="{escape(label)}"><title>{escape(tip)}</title>')
        start = 0
        while start < len(cells):
            colour = None if cells[start] is None else heat_colour(cells[start])
            end = start + 1
            while (
                end < len(cells)
                and (None if cells[end] is None else heat_colour(cells[end])) == colour
            ):
                end += 1
            if colour is not None:
                x1, x2 = x(edges[start]), x(edges[end])
                parts.append(
                    f'<rect class="cell" x="{x1:.1f}" y="{y}" width="{max(x2 - x1, 0.5):.1f}" '
                    f'height="{row_h}" fill="{colour}"/>'
                )
            start = end
        parts.append("</g>")
        if i % label_every == 0:
            parts.append(
                f'<text class="tick" x="{LEFT - 6}" y="{y + row_h / 2 + 4:.1f}" '
                f'text-anchor="end">{escape(label)}</text>'
            )
    bottom = TOP + nrows * row_h
    parts += _time_axis(span, bottom)
    parts.append("</svg>")
    return "".join(parts)
