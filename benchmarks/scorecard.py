"""Figures against targets: what every benchmark reports, and what `make bench` tabulates.

A benchmark makes one ``Scorecard``, calls ``check`` for each figure that has a target and
``info`` for figures shown beside them (a kinder figure, a comparison), then exits with
``card.exit_code()``: 1 when any target was missed, so `make bench` fails on a miss.
Each figure is printed as it is measured and, when ``run_all.py`` runs the benchmark, also
written as one JSON line to the file named by TORCHDOCTOR_BENCH_RESULTS; run_all prints the
one table the README's benchmark table is copied from, each figure with the load average it
was measured at.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, replace

RESULTS_ENV = "TORCHDOCTOR_BENCH_RESULTS"


@dataclass(frozen=True)
class Figure:
    benchmark: str
    figure: str
    value: str
    target: str  # "" for a figure shown for information
    met: bool | None  # None: no target
    # The 1-minute load average when the figure was measured: a figure read on a busy machine
    # (other work on the cores) is noisier and may miss a target it meets on a quiet one.
    load: float | None = None
    # When it was measured (UTC, to the minute): a saved table gathers runs of different days.
    at: str | None = None

    @property
    def verdict(self) -> str:
        return {True: "met", False: "MISSED", None: "-"}[self.met]


class Scorecard:
    def __init__(self, benchmark: str) -> None:
        self.benchmark = benchmark
        self.figures: list[Figure] = []

    def check(
        self,
        figure: str,
        value: float,
        text: str,
        *,
        at_most: float | None = None,
        at_least: float | None = None,
        target: str | None = None,
    ) -> bool:
        """Record ``value`` (printed as ``text``) against a bound; returns whether it is met."""
        if (at_most is None) == (at_least is None):
            raise ValueError("give exactly one of at_most, at_least")
        met = value <= at_most if at_most is not None else value >= at_least
        if target is None:
            target = f"<= {at_most:g}" if at_most is not None else f">= {at_least:g}"
        self._add(Figure(self.benchmark, figure, text, target, met))
        return met

    def verdict(self, figure: str, text: str, met: bool, target: str) -> bool:
        """A target that is not one bound on one number (e.g. "no change", "every case")."""
        self._add(Figure(self.benchmark, figure, text, target, met))
        return met

    def info(self, figure: str, text: str) -> None:
        self._add(Figure(self.benchmark, figure, text, "", None))

    def _add(self, fig: Figure) -> None:
        fig = replace(
            fig,
            load=round(os.getloadavg()[0], 2),
            at=time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        )
        self.figures.append(fig)
        tail = f"  target {fig.target}  {fig.verdict}" if fig.target else ""
        print(
            f"[{fig.benchmark}] {fig.figure}: {fig.value}{tail}  (load {fig.load:.1f})", flush=True
        )
        path = os.environ.get(RESULTS_ENV)
        if path:
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps(asdict(fig)) + "\n")

    @property
    def missed(self) -> list[Figure]:
        return [f for f in self.figures if f.met is False]

    def exit_code(self) -> int:
        if self.missed:
            names = ", ".join(f.figure for f in self.missed)
            print(f"[{self.benchmark}] targets missed: {names}", flush=True)
            return 1
        return 0


def read_results(path: str) -> list[Figure]:
    try:
        with open(path, encoding="utf-8") as f:
            return [Figure(**json.loads(line)) for line in f if line.strip()]
    except FileNotFoundError:
        return []
