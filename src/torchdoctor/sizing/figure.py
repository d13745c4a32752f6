"""One figure of a generated script and where it came from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Figure:
    """A value the script writes, and its source (written beside it as a comment)."""

    value: Any
    source: str
