"""The interactive loop of ``torchdoctor top``: read, draw, wait for a key or the next refresh.

Drawn with rich's ``Live`` on the alternate screen; keys are read from the terminal in cbreak
mode (no Enter needed, no echo) with ``select``, so a key redraws at once and the refresh
never sleeps past its time. Works over SSH in any terminal rich can size, 80 x 24 included.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import termios
import time
import tty
from types import TracebackType

import psutil
from rich.console import Console
from rich.live import Live

from torchdoctor.thresholds import Thresholds
from torchdoctor.top.collect import TopCollector
from torchdoctor.top.keys import Quit, SendSignal, handle_key
from torchdoctor.top.model import UiState, build_view
from torchdoctor.top.render import render

_SEQUENCES = {
    b"\x1b[A": "up",
    b"\x1bOA": "up",
    b"\x1b[B": "down",
    b"\x1bOB": "down",
    b"\x1b[5~": "pgup",
    b"\x1b[6~": "pgdn",
    b"\x1b[H": "home",
    b"\x1b[1~": "home",
    b"\x1b[F": "end",
    b"\x1b[4~": "end",
    b"\r": "enter",
    b"\n": "enter",
    b"\x7f": "backspace",
    b"\x08": "backspace",
    b"\x03": "ctrl-c",
}


def decode_keys(data: bytes) -> list[str]:
    """Key names in a chunk read from the terminal (several keys may arrive at once)."""
    keys = []
    i = 0
    while i < len(data):
        for seq in sorted(_SEQUENCES, key=len, reverse=True):
            if data.startswith(seq, i):
                keys.append(_SEQUENCES[seq])
                i += len(seq)
                break
        else:
            if data[i] == 0x1B:
                j = i + 1
                if j < len(data) and data[j] in b"[O":
                    # An escape sequence we do not use (F-keys...): skip it whole.
                    j += 1
                    while j < len(data) and not 0x40 <= data[j] <= 0x7E:
                        j += 1
                    j += 1
                else:
                    keys.append("esc")  # Esc on its own
                i = j
                continue
            ch = data[i : i + 1].decode("latin-1")
            keys.append(ch)
            i += 1
    return keys


class KeyReader:
    """stdin in cbreak mode for the duration of a ``with`` block; a terminal resize
    (SIGWINCH) wakes :meth:`read` up as the pseudo-key ``resize`` so the screen is redrawn
    at its new size at once."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._saved: list | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._old_winch = None

    def __enter__(self) -> KeyReader:
        self._saved = termios.tcgetattr(self.fd)
        tty.setcbreak(self.fd)
        self._old_winch = signal.signal(signal.SIGWINCH, self._on_resize)
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        signal.signal(signal.SIGWINCH, self._old_winch or signal.SIG_DFL)
        if self._saved is not None:
            termios.tcsetattr(self.fd, termios.TCSADRAIN, self._saved)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _on_resize(self, signum: int, frame: object) -> None:
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"r")

    def read(self, timeout: float) -> list[str]:
        ready, _, _ = select.select([self.fd, self._wake_r], [], [], max(timeout, 0.0))
        keys = []
        if self._wake_r in ready:
            os.read(self._wake_r, 64)
            keys.append("resize")
        if self.fd in ready:
            data = os.read(self.fd, 64)
            if not data:
                raise EOFError
            keys += decode_keys(data)
        return keys


def deliver(action: SendSignal) -> str:
    """Send the confirmed signal if the process is still the one confirmed and ours."""
    try:
        proc = psutil.Process(action.pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return f"process {action.pid} has exited: no signal sent"
        if abs(proc.create_time() - action.create_time) > 1.0:
            return f"process {action.pid} has exited (its PID was reused): no signal sent"
        if os.getuid() != 0 and proc.uids().real != os.getuid():
            return f"process {action.pid} belongs to {proc.username()}: no signal sent"
        os.kill(action.pid, action.signal)
    except psutil.NoSuchProcess:
        return f"process {action.pid} has exited: no signal sent"
    except PermissionError:
        return f"not allowed to signal process {action.pid}"
    return f"sent {action.signal.name} to {action.pid}"


def run_interactive(
    collector: TopCollector, thresholds: Thresholds, interval_s: float, console: Console
) -> None:
    """Until ``q`` (or Ctrl-C): refresh every ``interval_s``, redraw at once after each key."""
    # Ctrl-C is a normal way out of a live view; EOF: the terminal went away.
    with contextlib.suppress(KeyboardInterrupt, EOFError):
        _loop(collector, thresholds, interval_s, console)


def _loop(
    collector: TopCollector, thresholds: Thresholds, interval_s: float, console: Console
) -> None:
    state = UiState()
    with (
        KeyReader(sys.stdin.fileno()) as keys,
        Live(console=console, screen=True, auto_refresh=False) as live,
    ):
        readings = collector.read()
        # Rates need two readings: the first full screen comes sooner than a whole interval.
        deadline = time.monotonic() + min(interval_s, 0.5)
        while True:
            view = build_view(readings, thresholds, state)
            size = console.size
            live.update(render(view, size.width, size.height), refresh=True)
            pressed = keys.read(deadline - time.monotonic())
            detail_before = state.detail_pid
            for key in pressed:
                state, action = handle_key(state, key, view)
                if isinstance(action, Quit):
                    return
                if isinstance(action, SendSignal):
                    state.message = deliver(action)
                view = build_view(readings, thresholds, state)
            if time.monotonic() >= deadline or state.detail_pid != detail_before:
                readings = collector.read(detail_pid=state.detail_pid)
                deadline = time.monotonic() + interval_s
