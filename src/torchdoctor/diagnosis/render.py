"""Findings for people (a rich terminal rendering) and for programs (the documented JSON).

JSON form, stable for tools and CI checks::

    {"findings": [{"id": "dataloader-bound", "severity": "critical" | "warning" | "info",
                   "title": str,
                   "evidence": [{"label": str, "value": number | str, "unit": str,
                                 "t_start": float | null, "t_end": float | null}],
                   "recommendation": str, "expected_effect": str, "confidence": 0..1,
                   "settings": {machine-readable fix, e.g. "num_workers": 2},
                   "details": str}],
     "recordings": [{"path": str, "steps": {...} | null}]}

``recordings`` has one entry per recording diagnosed: ``steps`` is the step summary the rules
read, the same object as ``torchdoctor show --json`` prints under ``steps``
(:class:`torchdoctor.recording.steps.StepStats`), null when the job recorded no steps.

Times are UNIX seconds; ``settings`` keys are DataLoader arguments (``num_workers``,
``prefetch_factor``, ``persistent_workers``, ``pin_memory``, ``batch_size``), ``device``,
``autocast_dtype``, ``grad_scaler``, ``torch.num_threads`` and ``env.<VARIABLE>``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from torchdoctor.diagnosis.findings import Evidence, Finding
from torchdoctor.recording.reader import Recording
from torchdoctor.terminal import make_console
from torchdoctor.units import fmt_bytes, fmt_duration, fmt_rate

STYLES = {"critical": "bold red", "warning": "yellow", "info": "cyan"}


def findings_to_dict(
    findings: list[Finding], recordings: list[Recording] | None = None
) -> dict[str, Any]:
    out: dict[str, Any] = {"findings": [dataclasses.asdict(f) for f in findings]}
    if recordings is not None:
        out["recordings"] = [
            {"path": str(rec.path), "steps": stats.to_dict() if stats is not None else None}
            for rec in recordings
            for stats in [rec.step_stats()]
        ]
    return out


def format_value(ev: Evidence) -> str:
    """An evidence figure with its unit, bytes and seconds in readable units."""
    value, unit = ev.value, ev.unit
    if isinstance(value, str):
        return f"{value} {unit}".strip()
    if unit == "B":
        return fmt_bytes(value)
    if unit == "B/s":
        return fmt_rate(value)
    if unit == "s":
        return fmt_duration(float(value))
    if unit == "%" or unit.startswith("% "):
        return f"{value:.1f} {unit}" if isinstance(value, float) else f"{value} {unit}"
    text = f"{value:g}" if isinstance(value, float) else f"{value:,}"
    return f"{text} {unit}".strip()


def render_findings(
    findings: list[Finding], console: Console | None = None, *, failed_rules: int = 0
) -> None:
    """Print findings as panels, most severe first; a clean bill when there are none that matter.

    ``failed_rules``: rules that failed and were skipped (each already said why): the bill
    is then not clean, only incomplete, and says so."""
    console = console or make_console()
    serious = [f for f in findings if f.severity in ("critical", "warning")]
    if failed_rules and not serious:
        console.print(
            Text(
                f"torchdoctor: the diagnosis is incomplete: {failed_rules} rule"
                f"{'s' if failed_rules > 1 else ''} failed on this recording (see above); "
                "the others found no problem.",
                style="bold yellow",
            )
        )
        for f in findings:
            console.print(_panel(f), soft_wrap=False)
        return
    if not findings:
        console.print(Text("torchdoctor: no problems found in this job.", style="bold green"))
        return
    if not serious:
        console.print(
            Text("torchdoctor: no problems found; notes for this job:", style="bold green")
        )
    else:
        counts = ", ".join(
            f"{n} {sev}"
            for sev in ("critical", "warning", "info")
            if (n := sum(f.severity == sev for f in findings))
        )
        console.print(Text(f"torchdoctor diagnosis: {counts}", style="bold"))
    for f in findings:
        console.print(_panel(f), soft_wrap=False)  # panels wrap even on soft-wrap consoles


def _panel(f: Finding) -> Panel:
    style = STYLES.get(f.severity, "")
    table = Table.grid(padding=(0, 2))
    table.add_column(style="dim")
    table.add_column()
    for ev in f.evidence:
        table.add_row(Text(ev.label), Text(format_value(ev)))  # figures are not markup
    parts: list[Any] = [Text(f.title, style="bold"), table, Text("")]
    parts.append(Text.assemble(("Fix: ", "bold"), f.recommendation))
    if f.expected_effect:
        parts.append(Text.assemble(("Expected: ", "bold"), f.expected_effect))
    if f.settings:
        fix = ", ".join(f"{k}={v!r}" for k, v in f.settings.items())
        parts.append(Text.assemble(("Settings: ", "bold"), fix))
    title = Text.assemble((f"{f.severity.upper()} ", style), (f.id, "bold"))
    return Panel(
        Group(*parts),
        title=title,
        title_align="left",
        subtitle=f"confidence {f.confidence:.0%}",
        subtitle_align="right",
        border_style=style,
    )
