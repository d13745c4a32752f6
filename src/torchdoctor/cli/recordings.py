"""Recordings as the command line names them: ``last``/``@last`` wherever one is named, shell
completion of the recordings folder, and the one-line listing ``torchdoctor ls`` prints."""

from __future__ import annotations

import os
from pathlib import Path

import click
from click.shell_completion import CompletionItem

from torchdoctor.errors import UserError
from torchdoctor.recording.listing import (
    LAST,
    Listed,
    file_key,
    read_index,
    recording_files,
    resolve_recording,
    store_lines,
)
from torchdoctor.recording.paths import runs_dir


class RecordingArg(click.ParamType):
    """A recording file or folder; ``last`` or ``@last`` is the newest recording, ``last~N``
    the one N before it."""

    name = "recording"

    def convert(self, value, param, ctx):
        if not isinstance(value, str):
            return value
        try:
            return resolve_recording(value)
        except UserError as exc:
            self.fail(exc.message, param, ctx)

    def shell_complete(self, ctx, param, incomplete):
        items = [CompletionItem(w) for w in LAST if w.startswith(incomplete)]
        try:
            files = recording_files(runs_dir())
        except UserError:
            files = []
        for path in files:
            if str(path).startswith(incomplete):
                items.append(CompletionItem(str(path)))
        return items + [CompletionItem(incomplete, type="file")]


RECORDING = RecordingArg()

# The word between the two sides of ``torchdoctor compare A1 A2 ... vs B1 B2 ...``.
VERSUS = "vs"


class RecordingOrVersus(RecordingArg):
    """A recording, or the word ``vs`` between the sides of a comparison of several runs a
    side (a recording named ``vs`` in the current folder is ``./vs``)."""

    def convert(self, value, param, ctx):
        if value == VERSUS:
            return value
        return super().convert(value, param, ctx)


RECORDING_OR_VERSUS = RecordingOrVersus()


def versus_sides(first: str, others: tuple[str, ...], command: str) -> list[list[str]]:
    """``A1 A2 ... vs B1 B2 ...`` as its two sides, at least 2 runs each (``command`` names
    the command in the one-line refusals)."""
    if first == VERSUS:
        raise UserError(f"{command} A1 A2 {VERSUS} B1 B2: side A's runs come before {VERSUS!r}")
    at = others.index(VERSUS)
    side_a, side_b = [first, *others[:at]], list(others[at + 1 :])
    if VERSUS in side_b:
        raise UserError(f"{command} takes one {VERSUS!r} between the two sides, not several")
    if len(side_a) < 2 or len(side_b) < 2:
        raise UserError(
            f"{len(side_a)} run(s) before {VERSUS!r} and {len(side_b)} after: each side needs at "
            f"least 2 (for one run a side leave out {VERSUS!r}: {command} A B)"
        )
    return [side_a, side_b]


def recording_line(path: Path, thresholds=None) -> Listed:
    """Work out ``path``'s line: its summary and its worst finding (a diagnosis)."""
    from torchdoctor.recording import open_recording
    from torchdoctor.recording.summary import summarize

    key = file_key(path)
    try:
        with open_recording(path) as rec:
            summary = summarize(rec)
            findings = _findings(rec, thresholds)
    except UserError:
        return Listed(
            str(path), path.name, None, [], None, "unreadable", None, None, None, None, key
        )
    return line_of(path, summary, findings, key)


def line_of(path: Path, summary, findings, key: list[int] | None = None) -> Listed:
    """The line of a recording whose summary and findings are at hand."""
    from torchdoctor.recording.state import COMPLETE, IN_PROGRESS

    if summary.exit_status is not None:
        status = f"exit {summary.exit_status}"
    elif summary.recording_state == IN_PROGRESS:
        status = "running"
    else:
        status = "ended" if summary.recording_state == COMPLETE else summary.recording_state
    worst = _worst(findings)
    return Listed(
        path=str(path),
        name=path.name,
        started_at=summary.started_at,
        command=summary.command,
        duration_s=summary.duration_s,
        status=status,
        exit_status=summary.exit_status,
        steps_per_s=(summary.steps or {}).get("steps_per_s"),
        worst_finding=worst.id if worst else None,
        worst_severity=worst.severity if worst else None,
        key=key if key is not None else file_key(path),
    )


def _findings(rec, thresholds) -> list:
    try:
        from torchdoctor.diagnosis.engine import diagnose
    except ImportError:
        return []
    from torchdoctor.thresholds import load_thresholds

    try:
        return diagnose(rec, thresholds or load_thresholds())
    except UserError:
        return []


def _worst(findings: list):
    from torchdoctor.diagnosis.findings import SEVERITIES

    ranked = sorted(findings, key=lambda f: SEVERITIES.index(f.severity))
    return ranked[0] if ranked else None


def listed(folder: Path) -> list[Listed]:
    """Every recording's line in ``folder``, newest first; lines whose file has not changed
    since they were stored are not worked out again."""
    index = read_index(folder)
    lines: list[Listed] = []
    fresh: list[Listed] = []
    for path in recording_files(folder):
        line = index.get(path.name)
        if line is None or line.key != file_key(path):
            line = recording_line(path)
            fresh.append(line)
        line.path = str(path)
        lines.append(line)
    if fresh and os.access(folder, os.W_OK):
        store_lines(folder, fresh)
    lines.sort(key=lambda x: x.started_at or 0.0, reverse=True)
    return lines


def remember(path: Path, line: Listed) -> None:
    """Store a line just worked out (the end report of `run`), so `ls` need not redo it."""
    store_lines(path.parent, [line])
