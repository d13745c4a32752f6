"""What each key does in ``torchdoctor top``: a pure state machine, tested without a terminal.

Keys arrive as names: single characters, or ``up``, ``down``, ``pgup``, ``pgdn``, ``home``,
``end``, ``enter``, ``esc``, ``backspace``. :func:`handle_key` returns the new state and, when
the key asks for it, an action the app carries out (quit, send a signal).
"""

from __future__ import annotations

import dataclasses
import signal
from dataclasses import dataclass

from torchdoctor.top.model import SORT_KEYS, SORT_LABELS, UiState, View

# Signals offered after ``k``: key -> signal name. TERM first: it lets the job clean up.
SIGNAL_KEYS = {
    "t": "SIGTERM",
    "i": "SIGINT",
    "h": "SIGHUP",
    "k": "SIGKILL",
    "s": "SIGSTOP",
    "c": "SIGCONT",
    "1": "SIGUSR1",
    "2": "SIGUSR2",
}

HELP = (
    ("up/down", "select a process"),
    ("enter", "open / close the selected process's detail"),
    ("s", "sort by CPU, memory (PSS), VRAM or PID"),
    ("/", "filter by command, name, role, PID or rankN"),
    ("k", "send a signal to the selected process (asks first)"),
    ("esc", "close detail, cancel, clear the filter"),
    ("?", "this help"),
    ("q", "quit"),
)


@dataclass(frozen=True, slots=True)
class Quit:
    pass


@dataclass(frozen=True, slots=True)
class SendSignal:
    pid: int
    create_time: float  # the process confirmed; a reused PID must not get the signal
    signal: signal.Signals


Action = Quit | SendSignal | None


def handle_key(state: UiState, key: str, view: View) -> tuple[UiState, Action]:
    if key == "resize":  # the terminal changed size: redraw, change nothing
        return state, None
    s = dataclasses.replace(state, message=None)
    if s.mode == "filter":
        return _filter_key(s, key), None
    if s.mode == "signal":
        return _signal_key(s, key), None
    if s.mode == "confirm":
        return _confirm_key(s, key, view)
    if s.mode == "help":
        s.mode = "normal"
        return s, (Quit() if key == "q" else None)

    rows = view.rows()
    if key in ("q", "ctrl-c"):
        return s, Quit()
    if key == "?":
        s.mode = "help"
    elif key in ("up", "down", "pgup", "pgdn", "home", "end"):
        s.selected_pid = _move(rows, s.selected_pid, key)
    elif key == "enter":
        if s.detail_pid is not None:
            s.detail_pid = None
        elif s.selected_pid is not None:
            s.detail_pid = s.selected_pid
        elif rows:
            s.selected_pid = s.detail_pid = rows[0].pid
    elif key == "esc":
        if s.detail_pid is not None:
            s.detail_pid = None
        elif s.filter:
            s.filter = ""
    elif key == "s":
        s.sort = SORT_KEYS[(SORT_KEYS.index(s.sort) + 1) % len(SORT_KEYS)]
        s.message = f"sorted by {SORT_LABELS[s.sort]}"
    elif key == "/":
        s.mode = "filter"
    elif key == "k":
        target = _target(s, rows)
        if target is None:
            s.message = "select a process first (up/down)"
        else:
            s.selected_pid = target
            s.mode = "signal"
    return s, None


def _move(rows, selected: int | None, key: str) -> int | None:
    if not rows:
        return None
    pids = [r.pid for r in rows]
    i = pids.index(selected) if selected in pids else -1
    step = {"up": -1, "down": 1, "pgup": -10, "pgdn": 10}.get(key, 0)
    if key == "home":
        i = 0
    elif key == "end":
        i = len(pids) - 1
    elif i < 0:
        i = 0 if step > 0 else len(pids) - 1
    else:
        i = min(max(i + step, 0), len(pids) - 1)
    return pids[i]


def _target(s: UiState, rows) -> int | None:
    if s.detail_pid is not None:
        return s.detail_pid
    if s.selected_pid is not None and any(r.pid == s.selected_pid for r in rows):
        return s.selected_pid
    return None


def _filter_key(s: UiState, key: str) -> UiState:
    if key == "enter":
        s.mode = "normal"
    elif key == "esc":
        s.mode = "normal"
        s.filter = ""
    elif key == "backspace":
        s.filter = s.filter[:-1]
    elif len(key) == 1 and key.isprintable():
        s.filter += key
    return s


def _signal_key(s: UiState, key: str) -> UiState:
    name = SIGNAL_KEYS.get(key)
    if name is None:
        s.mode = "normal"
        s.message = "no signal sent"
    else:
        s.pending_signal = name
        s.mode = "confirm"
    return s


def _confirm_key(s: UiState, key: str, view: View) -> tuple[UiState, Action]:
    name, pid = s.pending_signal, s.selected_pid
    s.mode = "normal"
    s.pending_signal = None
    row = next((r for r in view.rows() if r.pid == pid), None)
    if key in ("y", "Y") and name is not None and row is not None:
        return s, SendSignal(row.pid, row.create_time, signal.Signals[name])
    if key in ("y", "Y"):
        s.message = f"process {pid} is gone: no signal sent"
        return s, None
    s.message = "no signal sent"
    return s, None
