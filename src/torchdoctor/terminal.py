"""The one way text reaches the terminal.

Everything torchdoctor prints holds text it did not write: command lines (Hydra overrides such as
``trainer.devices=[0,1]``), paths, process names, exception messages, values from recordings.
rich reads ``[...]`` as markup by default, so such text was mangled (``torchdoctor[attach]``
printed as ``torchdoctor``) or crashed the command (``[/x]`` raises ``MarkupError``). Every
Console the package makes comes from :func:`make_console`, with markup off: the project styles
its own words with ``style=`` and ``Text`` objects, never with markup strings, so no string
from a user or a job is ever parsed. ``tests/test_terminal.py`` fails when a Console, a markup
string or a markup-reading progress column appears anywhere else in the package.
"""

from __future__ import annotations

import os
import sys
from typing import IO

from rich.console import Console
from rich.text import Text

# Below this a terminal width is taken for a mistake (COLUMNS=0 from a 0x0 pty in a container,
# COLUMNS=1): rich would print nothing, or one character a line. 80 is what a pipe gets.
MIN_WIDTH = 40
FALLBACK_WIDTH = 80


def terminal_width(width: int | None = None) -> int | None:
    """The width to lay text out in: ``width`` when the code gives one (a layout's own width is
    taken as it is), else $COLUMNS when it is a sane number, else None (rich asks the terminal).
    A $COLUMNS that is not a number or below :data:`MIN_WIDTH` gives :data:`FALLBACK_WIDTH`."""
    if width is not None:
        return width
    raw = os.environ.get("COLUMNS", "").strip()
    if not raw:
        return None
    try:
        width = int(raw)
    except ValueError:
        return FALLBACK_WIDTH
    return width if width >= MIN_WIDTH else FALLBACK_WIDTH


class _Console(Console):
    """rich answers a closed pipe by pointing stdout at /dev/null and raising SystemExit(1)
    from inside the print, whatever stream broke: `run` would exit 1 instead of with the job's
    status. A console whose reader went away falls silent instead; the command goes on."""

    def on_broken_pipe(self) -> None:
        self.quiet = True


def make_console(
    file: IO[str] | None = None,
    *,
    width: int | None = None,
    soft_wrap: bool = False,
    stderr: bool = False,
) -> Console:
    """A rich Console that never reads markup or highlights: what it is given is printed as
    it is. ``stderr=True`` writes to the standard error (the default is the standard output)."""
    if file is None and stderr:
        file = sys.stderr
    console = _Console(
        file=file,
        markup=False,
        highlight=False,
        emoji=False,
        soft_wrap=soft_wrap,
        width=terminal_width(width),
    )
    return console


def styled(text: str, style: str) -> Text:
    """``text`` in ``style``, as it is: the way to colour a line that holds outside text."""
    return Text(text, style=style)
