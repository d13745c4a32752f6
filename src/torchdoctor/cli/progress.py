"""Progress for work that can take more than a couple of seconds: a rich progress line on
stderr while a person watches (stderr is a terminal), nothing at all otherwise (a pipe, a
file, a CI log, or --quiet), so that logs and --json output carry no bars."""

from __future__ import annotations

import sys
from types import TracebackType

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

from torchdoctor.terminal import make_console


def shown(quiet: bool = False) -> bool:
    """Whether progress is shown: stderr is a terminal and --quiet was not given."""
    return not quiet and sys.stderr.isatty()


class Steps:
    """``with Steps("probing batch sizes", total=None) as steps: steps.advance("batch 64")``.

    ``total`` None: a spinner with the step count; a number: a bar. ``note`` prints a line
    above the bar (a row as it finishes). Without a terminal every call does nothing."""

    def __init__(self, description: str, total: float | None = None, quiet: bool = False):
        self.description = description
        self._progress: Progress | None = None
        self._task = None
        if shown(quiet):
            columns = [SpinnerColumn(), TextColumn("{task.description}", markup=False)]
            if total is not None:
                columns += [BarColumn(), MofNCompleteColumn()]
            columns.append(TimeElapsedColumn())
            console = make_console(stderr=True)
            self._progress = Progress(*columns, console=console, transient=True)
            self._task = self._progress.add_task(description, total=total)

    def __enter__(self) -> Steps:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._progress is not None:
            self._progress.stop()

    def advance(self, text: str | None = None, by: float = 1) -> None:
        if self._progress is None:
            return
        label = f"{self.description}: {text}" if text else self.description
        self._progress.update(self._task, advance=by, description=label)

    def note(self, line: str) -> None:
        if self._progress is not None:
            self._progress.console.print(line)
