"""``--force``: the one flag that lets a command replace an existing file it writes.

What may be replaced, and what never is (a recording, a device, a folder), is
:mod:`torchdoctor.output_files`'s rule; the flag only lifts the refusal of an existing file.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click


def force_option(what: str) -> Callable[[Any], Any]:
    """``--force`` for a command that writes ``what`` (e.g. "the -o file")."""
    return click.option(
        "--force",
        is_flag=True,
        help=f"Replace {what} when it exists (never a torchdoctor recording, a folder or a "
        "device).",
    )
