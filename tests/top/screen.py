"""What a person sees: a rendered screen as text lines, and the colour of a figure on it."""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console
from rich.style import Style

from torchdoctor.top.model import View
from torchdoctor.top.render import render


@dataclass
class Screen:
    lines: list[str]
    segments: list[tuple[str, Style | None]]

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    def line_with(self, needle: str) -> str:
        hits = [line for line in self.lines if needle in line]
        assert hits, f"{needle!r} is not on the screen:\n{self.text}"
        return hits[0]

    def colour_of(self, needle: str, after: str = "") -> str | None:
        """Foreground colour name of the first ``needle`` on screen (after ``after``)."""
        full = "".join(text for text, _ in self.segments)
        start = full.index(after) if after else 0
        at = full.index(needle, start)
        pos = 0
        for text, style in self.segments:
            if pos <= at < pos + len(text):
                return style.color.name if style is not None and style.color else None
            pos += len(text)
        return None


def show(view: View, width: int = 80, height: int = 24, interactive: bool = True) -> Screen:
    console = Console(
        width=width, height=height, record=True, force_terminal=True, color_system="truecolor"
    )
    group = render(view, width, height, interactive=interactive)
    segments = [(s.text, s.style) for s in console.render(group, console.options)]
    console.print(group)
    lines = console.export_text(styles=False).rstrip("\n").split("\n")
    return Screen(lines=lines, segments=segments)
