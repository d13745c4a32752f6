"""The report's profiled-windows section: per window, a bar per profiled step split into what
the step was made of (and, on a GPU trace, the GPU's busy and idle time), then the ops that took
the most time, with their shapes and dtypes, and the GPU kernels."""

from __future__ import annotations

import json
from html import escape

from torchdoctor.recording.profiles import GPU_PARTS, STEP_PARTS, WindowProfile
from torchdoctor.units import fmt_duration

COLOURS = {
    "ops": "#4e79a7",
    "runtime": "#9c755f",
    "data": "#f28e2b",
    "Python": "#e15759",
    "busy": "#59a14f",
    "host wait": "#e15759",
    "kernel wait": "#edc948",
    "other idle": "#bab0ac",
}
BAR_H = 14
LABEL_W = 90
WIDTH = 720
MAX_STEPS = 60  # bars drawn per window (a window holds at most 50 active steps)
TOP_ROWS = 15


def render_profiles(windows: list[WindowProfile]) -> str:
    if not windows:
        return ""
    parts = ['<section id="profiles"><h2>Profiled steps</h2>']
    for w in windows:
        parts.append(_window(w))
    parts.append("</section>")
    return "".join(parts)


def _window(w: WindowProfile) -> str:
    state = w.window.get("state") or "done"
    head = f"<h3>{escape(w.label)}</h3>"
    if not w.steps:
        why = w.window.get("reason") or "its trace was not parsed"
        return f"{head}<p>No figures: {escape(str(why))} ({escape(state)}).</p>"
    out = [head]
    if state == "cut" and w.window.get("reason"):
        out.append(f"<p>Cut: {escape(str(w.window['reason']))}</p>")
    out.append(
        "<p>Each bar is one profiled step: what the CPU thread spent it on (CPU ops' own time, "
        "CUDA runtime calls, the DataLoader, Python between ops)"
        + ("; below it, the GPU's time for the step: busy, or idle waiting for the host, for "
           "the next kernel (gaps under 30 us) or for something else" if w.gpu else "")
        + ".</p>"
    )  # fmt: skip
    out.append(_bars(w))
    out.append(_ops_table(w))
    if w.kernels:
        out.append(_kernels_table(w))
    return "".join(out)


def _bars(w: WindowProfile) -> str:
    steps = w.steps[:MAX_STEPS]
    rows_per_step = 2 if w.gpu else 1
    longest = max(max(s["dur_s"] or 0.0, sum(s.get(c) or 0.0 for _, c in GPU_PARTS)) for s in steps)
    scale = (WIDTH - LABEL_W - 10) / longest if longest > 0 else 0.0
    row_h = BAR_H * rows_per_step + 6
    height = row_h * len(steps) + 24
    svg = [
        f'<svg class="profile-bars" width="{WIDTH}" height="{height}" role="img" '
        f'aria-label="profiled step breakdown">'
    ]
    for i, s in enumerate(steps):
        y = 4 + i * row_h
        svg.append(
            f'<text x="0" y="{y + BAR_H - 3}" font-size="11">step {escape(str(s["step"]))}</text>'
        )
        svg.extend(_segments(s, STEP_PARTS, LABEL_W, y, scale))
        if w.gpu:
            svg.extend(_segments(s, GPU_PARTS, LABEL_W, y + BAR_H, scale))
    legend = STEP_PARTS + (GPU_PARTS if w.gpu else ())
    x = 0
    for name, _ in legend:
        y = height - 8
        svg.append(f'<rect x="{x}" y="{y - 9}" width="10" height="10" fill="{COLOURS[name]}"/>')
        svg.append(f'<text x="{x + 13}" y="{y}" font-size="11">{escape(name)}</text>')
        x += 16 + 7 * len(name) + 10
    svg.append("</svg>")
    return "".join(svg)


def _segments(step: dict, parts: tuple, x0: float, y: float, scale: float) -> list[str]:
    out = []
    x = x0
    for name, column in parts:
        seconds = step.get(column) or 0.0
        width = seconds * scale
        if width <= 0:
            continue
        out.append(
            f'<rect x="{x:.1f}" y="{y}" width="{width:.1f}" height="{BAR_H - 2}" '
            f'fill="{COLOURS[name]}"><title>{escape(name)}: {escape(fmt_duration(seconds))}'
            "</title></rect>"
        )
        x += width
    return out


def _shapes(text: str | None) -> str:
    if not text:
        return ""
    try:
        return ", ".join(json.dumps(v) for v in json.loads(text) if v not in ([], "", None))
    except ValueError:
        return text


def _ops_table(w: WindowProfile) -> str:
    n = len(w.steps) or 1
    step_s = w.typical("dur_s") or 0.0
    rows = [
        "<table><thead><tr><th>op</th><th>input shapes</th><th>dtypes</th><th>calls per step"
        "</th><th>own time per step</th><th>share of the step</th></tr></thead><tbody>"
    ]
    for op in w.ops[:TOP_ROWS]:
        per_step = (op["self_s"] or 0.0) / n
        share = f"{100.0 * per_step / step_s:.1f} %" if step_s > 0 else "n/a"
        rows.append(
            f'<tr><td class="mono">{escape(op["name"])}</td>'
            f'<td class="mono">{escape(_shapes(op["input_dims"]))}</td>'
            f'<td class="mono">{escape(_shapes(op["input_types"]))}</td>'
            f"<td>{(op['count'] or 0) / n:g}</td><td>{escape(fmt_duration(per_step))}</td>"
            f"<td>{share}</td></tr>"
        )
    rows.append("</tbody></table>")
    return "<h4>Ops with the most own time</h4>" + "".join(rows)


def _kernels_table(w: WindowProfile) -> str:
    n = len(w.steps) or 1
    rows = [
        "<table><thead><tr><th>kernel</th><th>kind</th><th>per step</th><th>time per step</th>"
        "<th>longest</th></tr></thead><tbody>"
    ]
    for k in w.kernels[:TOP_ROWS]:
        rows.append(
            f'<tr><td class="mono">{escape(k["name"][:160])}</td><td>{escape(k["kind"] or "")}</td>'
            f"<td>{(k['count'] or 0) / n:g}</td>"
            f"<td>{escape(fmt_duration((k['total_s'] or 0.0) / n))}</td>"
            f"<td>{escape(fmt_duration(k['max_s'] or 0.0))}</td></tr>"
        )
    rows.append("</tbody></table>")
    return "<h4>GPU kernels with the most time</h4>" + "".join(rows)
