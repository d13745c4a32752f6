"""``torchdoctor top``: live view of the machine and its PyTorch jobs."""

from __future__ import annotations

import sys
import time

import click

from torchdoctor.cli.json_output import dump_json
from torchdoctor.errors import UserError

# Below 0.1 s between refreshes the rates are mostly the sampling's own noise and top's own
# reads cost a core; an hour is the longest refresh worth waiting for.
MIN_INTERVAL_S = 0.1
MAX_INTERVAL_S = 3600.0
ONCE_WINDOW_S = 2.0  # the longest --once waits between its two readings


@click.command("top")
@click.option(
    "--interval",
    "interval_text",
    default="1",
    show_default=True,
    metavar="TIME",
    help=f"Time between refreshes (and the window rates are measured over), "
    f"{MIN_INTERVAL_S:g}-{MAX_INTERVAL_S:g} s (e.g. 2, 2s or 500ms).",
)
@click.option(
    "--once",
    is_flag=True,
    help=f"Print one snapshot and exit (for scripts); its rates are measured over "
    f"--interval, at most {ONCE_WINDOW_S:g} s.",
)
@click.option(
    "--json", "as_json", is_flag=True, help="With --once: the snapshot as JSON (schema in docs)."
)
@click.option(
    "--thresholds",
    "thresholds_file",
    type=click.Path(dir_okay=False),
    default=None,
    metavar="FILE",
    help="TOML file overriding the threshold table used for colours.",
)
def command(interval_text: str, once: bool, as_json: bool, thresholds_file: str | None) -> None:
    """Live view: host CPU/memory/PSI, GPUs and every PyTorch job with its workers and ranks.

    Jobs running under `torchdoctor run` also show their step rate, data-wait share and
    current findings. Keys: arrows select, enter detail, s sort, / filter, k signal, q quit.
    """
    from torchdoctor.terminal import make_console
    from torchdoctor.thresholds import load_thresholds
    from torchdoctor.top.collect import TopCollector
    from torchdoctor.top.model import UiState, build_view
    from torchdoctor.top.render import render
    from torchdoctor.top.snapshot import snapshot
    from torchdoctor.units import parse_duration

    interval = parse_duration(interval_text, "--interval", examples="2, 2s or 500ms")
    if not MIN_INTERVAL_S <= interval <= MAX_INTERVAL_S:
        raise UserError(
            f"--interval {interval:g} is out of range: use {MIN_INTERVAL_S:g}-{MAX_INTERVAL_S:g} "
            "seconds (e.g. 2, 2s or 500ms)"
        )
    if as_json and not once:
        raise UserError(
            "--json prints one snapshot: use it with --once (torchdoctor top --once --json)"
        )
    thresholds = load_thresholds(thresholds_file)
    if not once and not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise UserError(
            "torchdoctor top needs a terminal; in scripts use `torchdoctor top --once` "
            "(or --once --json)"
        )

    try:
        collector = TopCollector(thresholds, interval_s=interval)
    except OSError as exc:  # no /proc: not Linux, or a sandbox that hides it
        raise UserError(f"cannot read this machine: {exc}", exit_code=3) from None
    try:
        if not once:
            from torchdoctor.top.app import run_interactive

            run_interactive(collector, thresholds, interval, make_console())
            return
        collector.read()
        # Rates (CPU %, swap traffic) are measured over one interval between two readings;
        # a script asking for one snapshot gets it within ONCE_WINDOW_S, whatever --interval
        # (--once --interval 3600 used to wait an hour, silently).
        time.sleep(min(interval, ONCE_WINDOW_S))
        readings = collector.read()
        view = build_view(readings, thresholds, UiState())
        if as_json:
            dump_json("top", snapshot(readings, view, thresholds))
            return
        console = make_console()
        # --once prints everything: no height limit but the content's. Piped output is as
        # wide as $COLUMNS, else 80 columns (rich's default).
        console.print(render(view, console.width, 10_000, interactive=False))
    finally:
        collector.close()
