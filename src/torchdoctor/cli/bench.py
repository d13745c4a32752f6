"""``torchdoctor bench``: measurements of the fabric and of scaling, one sub-command each.

Each sub-command lives in its own module (``torchdoctor.cli.bench_<name>``, exposing
``command``), imported only when it runs, as the top-level commands are.
"""

from __future__ import annotations

import importlib
import importlib.util

import click

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


def _exists(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


class _LazyBenchGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return [name for name, (module, _) in BENCHES.items() if _exists(module)]

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        entry = BENCHES.get(cmd_name)
        if entry is None or not _exists(entry[0]):
            return None
        return importlib.import_module(entry[0]).command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, BENCHES[name][1]) for name in self.list_commands(ctx)]
        if rows:
            with formatter.section("Benchmarks"):
                formatter.write_dl(rows)


@click.group("bench", cls=_LazyBenchGroup)
def command() -> None:
    """Measure what a distributed run depends on: collective bandwidth, scaling efficiency."""
