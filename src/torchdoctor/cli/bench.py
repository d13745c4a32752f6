"""``torchdoctor bench``: measurements of the fabric and of scaling, one sub-command each.

Each sub-command lives in its own module (``torchdoctor.cli.bench_<name>``, exposing
``command``), imported only when it runs, as the top-level commands are.
"""

from __future__ import annotations

import click

from torchdoctor.cli.parsing import LazyGroup

# name -> (module, one-line help)
BENCHES: dict[str, tuple[str, str]] = {
    "allreduce": (
        "torchdoctor.cli.bench_allreduce",
        "Sweep all-reduce / all-gather / reduce-scatter sizes: time, algbw, busbw.",
    ),
    "scaling": (
        "torchdoctor.cli.bench_scaling",
        "Run a script at 1, 2, 4... ranks and report scaling efficiency E(N).",
    ),
}


@click.group("bench", cls=LazyGroup, commands=BENCHES, section="Benchmarks")
def command() -> None:
    """Measure what a distributed run depends on: collective bandwidth, scaling efficiency."""
