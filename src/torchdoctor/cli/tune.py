"""`torchdoctor tune -- CMD ARGS...`: measure the job in short trials, find its fastest
DataLoader and thread settings, verify the gain, and say what to paste.

JSON output (``--json``, on stdout; progress stays on stderr)::

    {
      "original":    {"num_workers", "num_threads", "prefetch_factor",
                      "persistent_workers", "pin_memory"},   # the script as written
      "recommended": {...same keys...},   # what to use: the original unless a gain was verified
      "changed":     bool,
      "candidate":   {...} | null,        # the search's pick before verification
      "gain":        float | null,        # verified speed-up (original's step time / tuned's,
                                          # compare's statistics), else null
      "gain_spread": float | null,        # half the range of the verification pairs' ratios
      "verification": {"pairs", "original_steps_per_s", "tuned_steps_per_s", "ratios",
                       "gain", "gain_spread", "gain_low", "gain_high",  # the 95 % interval
                       "confirmed", "reason"} | null,
      "noise":       float,               # relative difference below which runs are equal
      "stopped":     "converged" | "budget" | "interrupted" | "original-failed",
      "elapsed_s", "search_s", "budget_s", "memory_budget_bytes",
      "trial_steps":  int,                # measured steps per trial, after warm-up
      "explored":    [setting names the search varied],
      "paste":       {"dataloader_kwargs", "dataloader_code", "env", "env_lines",
                      "set_num_threads"} | null,   # null when nothing should change
      "notes":       [str],
      "trials": [{"index", "config", "purpose", "status", "steps_per_s", "samples_per_s",
                  "measured_steps", "warmup_steps", "spread", "data_wait_share",
                  "peak_memory_bytes", "duration_s", "reason", "recording", "log"}]
    }

``purpose`` is one of original, suggested (the diagnosis' advice), search, confirm,
verify-original, verify-tuned; ``status`` one of ok, failed, rejected, interrupted.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from torchdoctor.cli.common import stderr_console, thresholds_option
from torchdoctor.cli.json_output import dump_json, user_output_to_stderr
from torchdoctor.cli.parsing import WrapperCommand
from torchdoctor.run.process import hold_signals, release_signals
from torchdoctor.terminal import make_console, styled
from torchdoctor.tune.result import Measurement, TuneResult
from torchdoctor.tune.space import Config
from torchdoctor.tune.tuner import DEFAULT_BUDGET_S, check_limits, tune_command
from torchdoctor.units import parse_duration

_PURPOSE = {
    "original": "as written",
    "suggested": "diagnosis",
    "search": "search",
    "confirm": "re-run",
    "verify-original": "verify: as written",
    "verify-tuned": "verify: tuned",
}


@click.command(
    "tune",
    cls=WrapperCommand,
    renamed={"--out": "--out-dir"},
)
@click.option(
    "--budget",
    default="5m",
    show_default=True,
    metavar="TIME",
    help="Hard limit on the whole tune, verification included (300 = seconds, 90s, 5m, 1h).",
)
@click.option(
    "--trial-steps",
    type=int,
    default=None,
    metavar="N",
    help="Measured steps per trial, after warm-up (default: as many as the first trial "
    "makes in a window sized to the budget).",
)
@click.option(
    "--trial-timeout",
    type=float,
    default=None,
    metavar="S",
    help="Stop a trial as hung after S seconds without a training step; before its first "
    "step it gets at least 30 s (default: from the first trial's pace).",
)
@click.option(
    "--out-dir",
    "out",
    type=click.Path(file_okay=False),
    default=None,
    metavar="DIR",
    help="Folder for the trials' recordings and logs (default: <recordings folder>/tune-<time>/).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")
@click.option("--quiet", is_flag=True, help="No progress lines on stderr.")
@thresholds_option
@click.argument("argv", nargs=-1, required=True, type=click.UNPROCESSED, metavar="-- CMD [ARGS]...")
@click.pass_context
def command(
    ctx: click.Context,
    budget: str,
    trial_steps: int | None,
    trial_timeout: float | None,
    out: str | None,
    as_json: bool,
    quiet: bool,
    thresholds: str | None,
    argv: tuple[str, ...],
) -> None:
    """Run CMD in short trials and find its fastest DataLoader and thread settings.

    Each trial runs CMD unmodified in its own process, with num_workers, prefetch_factor,
    pin_memory, persistent_workers (every DataLoader) and the trainer's torch threads
    overridden by torchdoctor's instrumentation, and stops it after a number of measured
    steps. The search starts from the script's own settings and the diagnosis' advice, keeps
    the job under half the available RAM with no swapping, stops when improvements are
    within the measured noise, and picks the cheapest settings within noise of the best.
    The pick is then run against the original in interleaved trials (A B A B ...): a gain is
    reported only if those runs show it. Ctrl-C stops the current trial and prints what was
    found so far. Your files are never changed: the trials' recordings go to --out-dir.
    """
    budget_s = parse_duration(budget, "--budget") if budget else DEFAULT_BUDGET_S
    check_limits(budget_s, trial_timeout, trial_steps)  # before the first line is printed
    progress = None if quiet else _Progress(stderr_console())
    if not quiet:
        from torchdoctor.run.interpreter import announce, find_job_python

        announce(find_job_python(list(argv)), "every trial")
    held = hold_signals()
    try:
        # The trials' output goes to their logs; anything else printed meanwhile goes to
        # stderr under --json, so that stdout is the JSON alone.
        with user_output_to_stderr(as_json):
            result = tune_command(
                list(argv),
                budget_s=budget_s,
                trial_steps=trial_steps,
                trial_timeout_s=trial_timeout,
                folder=Path(out) if out else None,
                on_folder=None
                if quiet
                else lambda f: click.echo(f"torchdoctor tune: trials record into {f}", err=True),
                signals_held=True,
                on_start=progress.start if progress else None,
                on_trial=progress.done if progress else None,
            )
    finally:
        release_signals(held)
    if as_json:
        dump_json("tune", result.to_json())
    else:
        width = None if sys.stdout.isatty() else 120  # a file or pipe: no 80-column cut
        render(result, make_console(sys.stdout, soft_wrap=True, width=width))
    # 128 + the signal, as a shell reports a command it killed: 143 for SIGTERM (a scheduler's
    # stop), 130 for Ctrl-C.
    interrupted = result.stopped == "interrupted"
    ctx.exit(128 + (result.stop_signal or signal.SIGINT) if interrupted else 0)


class _Progress:
    """One line on stderr per trial, so a five-minute tune is never silent."""

    def __init__(self, console: Console) -> None:
        self.console = console

    def start(self, index: int, config: Config, purpose: str) -> None:
        label = "settings as written" if purpose == "original" else config.label()
        self.console.print(
            styled(f"trial {index:>2}  {_PURPOSE.get(purpose, purpose):<18} {label} ...", "dim")
        )

    def done(self, m: Measurement) -> None:
        if m.ok:
            figure = f"{m.throughput:.2f} steps/s"
        else:
            # "interrupted: interrupted" said nothing twice: a reason that repeats the status
            # is left out
            reason = f": {m.reason}" if m.reason and m.reason != m.status else ""
            figure = Text.assemble((m.status, "yellow"), reason)
        label = m.config.label() if m.purpose != "original" else "as written"
        self.console.print(
            Text.assemble(f"trial {m.index:>2}  {label:<24} ", figure, f"  ({m.duration_s:.1f} s)")
        )


def _throughput(m: Measurement) -> str:
    return f"{m.throughput:.2f}" if m.throughput is not None else "-"


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.0f} MiB"


def render(result: TuneResult, console: Console) -> None:
    """The table of trials, the winner, the verified gain and what to paste."""
    original_speed = result.best_throughput(result.original)
    with_samples = any(m.samples_per_s is not None for m in result.trials)
    table = Table(title="Trials", title_justify="left", show_edge=False, pad_edge=False)
    columns = [
        ("#", "right"),
        ("run", "left"),
        ("settings", "left"),
        ("steps/s", "right"),
        *([("samples/s", "right")] if with_samples else []),
        ("vs orig.", "right"),
        ("data wait", "right"),
        ("memory", "right"),
        ("result", "left"),
    ]
    for name, justify in columns:
        table.add_column(name, justify=justify, no_wrap=True)
    reasons = []
    for m in result.trials:
        ratio = (
            f"{m.throughput / original_speed:.2f}x"
            if m.throughput is not None and original_speed
            else "-"
        )
        status = Text("ok") if m.ok else styled(m.status, "yellow")
        if m.reason:
            status.append(f" ({len(reasons) + 1})")
            reasons.append(f"({len(reasons) + 1}) trial {m.index}: {m.reason}")
        table.add_row(
            str(m.index),
            _PURPOSE.get(m.purpose, m.purpose),
            m.config.label(),
            _throughput(m),
            *(
                [f"{m.samples_per_s:.0f}" if m.samples_per_s is not None else "-"]
                if with_samples
                else []
            ),
            ratio,
            f"{m.data_wait_share:.0%}" if m.data_wait_share is not None else "-",
            _mib(m.peak_memory),
            status,
        )
    console.print(table)
    for line in reasons:
        console.print(f"  {line}")
    console.print()
    console.print(
        f"Noise between runs: ±{result.noise:.0%}. Search: {result.search_s:.0f} s, "
        f"total {result.elapsed_s:.0f} s of a {result.budget_s or 0:.0f} s budget "
        f"({result.stopped})."
    )
    console.print(f"As written:  {result.original.label()}")
    v = result.verification
    if result.changed and result.gain is not None:
        spread = f" ± {v.gain_spread:.2f}" if v.gain_spread is not None else ""
        if v.interval is not None:  # compare's statistics: the same figure compare prints
            spread = f" (95 % interval {v.interval.low:.2f}x to {v.interval.high:.2f}x)"
        ratios = " ".join(f"{r:.2f}x" for r in v.ratios)
        console.print(styled(f"Winner:      {result.recommended.label()}", "bold"))
        console.print(
            Text.assemble(
                (f"Verified gain: {result.gain:.2f}x{spread}", "bold green"),
                f" ({v.pairs} interleaved pairs A B A B...: {ratios})",
            )
        )
        _render_paste(result, console)
    else:
        if result.candidate is not None and result.candidate != result.original and v:
            console.print(f"Search's pick {result.candidate.label()} was not kept: {v.reason}.")
        console.print(
            Text.assemble(
                ("Keep your settings:", "bold"),
                " nothing measured here is faster beyond the noise.",
            )
            if result.stopped != "interrupted"
            else Text.assemble(
                ("Interrupted:", "bold"), " nothing verified, keep your settings for now."
            )
        )
    for note in result.notes:
        console.print(styled(f"- {note}", "dim"))


def _render_paste(result: TuneResult, console: Console) -> None:
    paste = result.paste()
    console.print()
    console.print("Paste into your DataLoader(...) call:")
    console.print(f"    {paste['dataloader_code']}")
    console.print("and set the trainer's threads before it starts:")
    for line in paste["env_lines"]:
        console.print(f"    {line}")
    if result.threads_set_in_script:
        console.print(
            f"    (your script calls torch.set_num_threads itself: make it "
            f"{paste['set_num_threads']})"
        )
