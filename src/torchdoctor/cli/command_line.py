"""A job's command line as the terminal shows it."""

from __future__ import annotations


def one_line(argv: list[str], limit: int = 100) -> str:
    """A command line on one line (scripts passed with -c hold newlines), cut at ``limit``."""
    text = " ".join(" ".join(argv).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
