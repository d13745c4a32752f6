"""The ``torchdoctor`` command line: a thin layer over the library.

Each sub-command lives in its own module (``torchdoctor.cli.<name>``) exposing ``command``;
modules are imported only when their command runs, so ``torchdoctor run`` never pays for
the estimator, and a broken optional part cannot break the others.
"""

from __future__ import annotations

import sys

import click

from torchdoctor import __version__
from torchdoctor.cli.parsing import LazyGroup
from torchdoctor.errors import UserError

# name -> (module, one-line help shown in `torchdoctor --help`)
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("torchdoctor.cli.run", "Run a command and record everything it uses."),
    "attach": ("torchdoctor.cli.attach", "Record a running process tree until it exits."),
    "profile": (
        "torchdoctor.cli.profile",
        "Profile a few steps of a recorded running job with torch.profiler.",
    ),
    "ls": ("torchdoctor.cli.ls", "List the recordings, newest first."),
    "show": ("torchdoctor.cli.show", "Summarize a recording."),
    "export": ("torchdoctor.cli.export", "Export a recording to CSV, Parquet or JSON Lines."),
    "diagnose": ("torchdoctor.cli.diagnose", "Name the bottleneck of a recorded job, with fixes."),
    "compare": (
        "torchdoctor.cli.compare",
        "Compare two runs: faster or slower, which phase moved, which setting explains it.",
    ),
    "report": ("torchdoctor.cli.report", "Write a self-contained HTML report of a recording."),
    "estimate": ("torchdoctor.cli.estimate", "Estimate VRAM of a training step without a GPU."),
    "tune": ("torchdoctor.cli.tune", "Find the fastest DataLoader and thread settings."),
    "top": ("torchdoctor.cli.top", "Live view of the machine and its PyTorch jobs."),
    # the jobs it runs: a shared queue, distributed runs, hand-off to Slurm
    "submit": (
        "torchdoctor.cli.submit",
        "Queue a job; it starts when its GPUs, cores and memory are free.",
    ),
    "queue": ("torchdoctor.cli.queue", "List, inspect, cancel, pause and wait for queued jobs."),
    "doctor": ("torchdoctor.cli.doctor", "Check the machine and network before a distributed run."),
    "bench": ("torchdoctor.cli.bench", "Measure all-reduce bandwidth and multi-rank scaling."),
    "launch": ("torchdoctor.cli.launch", "Start a torchrun job with every rank recorded."),
    "sbatch": (
        "torchdoctor.cli.sbatch",
        "Write (and submit) a Slurm script sized from a recording.",
    ),
    "slurm": ("torchdoctor.cli.slurm", "Show a Slurm job: state, asked vs used, findings."),
    "handoff": (
        "torchdoctor.cli.handoff",
        "Hand a job to Slurm, Ray or Kubernetes, sized from its recording.",
    ),
    # fleets: where people already watch
    "exporter": (
        "torchdoctor.cli.exporter",
        "Serve Prometheus metrics for this machine and its jobs.",
    ),
    "completion": (
        "torchdoctor.cli.completion",
        "Print the shell completion script (bash, zsh or fish).",
    ),
}


@click.group(
    cls=LazyGroup,
    commands=COMMANDS,
    context_settings={"help_option_names": ["-h", "--help"]},
)
@click.version_option(__version__, prog_name="torchdoctor")
def cli() -> None:
    """Record, diagnose and tune the resource use of PyTorch training jobs."""


def main(argv: list[str] | None = None) -> None:
    """Entry point: turn UserError into one line on stderr and its exit status.

    Our own stdout and stderr drop output once they break (a closed pipe, a full disk): the
    command still runs to its end and exits with its own status, `run` with the job's."""
    from torchdoctor.cli.streams import guard_standard_streams
    from torchdoctor.units import visible

    guard_standard_streams()
    try:
        # Without standalone mode click returns ctx.exit(code)'s code instead of exiting.
        status = cli.main(args=argv, prog_name="torchdoctor", standalone_mode=False)
    # Every error message carries what the user typed or a file named (values, paths, names):
    # its newlines, \r and escape sequences are escaped here, once, so the error stays one line
    # and cannot rewrite the terminal, whichever command or click itself wrote the message.
    except UserError as exc:
        click.echo(f"torchdoctor: error: {visible(exc.message)}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("torchdoctor: aborted", err=True)
        sys.exit(130)
    except click.UsageError as exc:
        exc.message = visible(exc.message)
        exc.show()  # the usage line, click's "Try '... -h' for help." hint, then the error
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        click.echo(f"torchdoctor: error: {visible(exc.format_message())}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    sys.exit(status if isinstance(status, int) else 0)
