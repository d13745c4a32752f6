"""`torchdoctor.launch.scaling -- SCRIPT ARGS`: E(N) of the user's script at 1, 2, 4... ranks."""

from __future__ import annotations

import time
from pathlib import Path

import click

from torchdoctor.cli.common import python_option, stderr_console
from torchdoctor.cli.json_output import dump_json
from torchdoctor.cli.parsing import WrapperCommand
from torchdoctor.recording.paths import prepare_folder, runs_dir


@click.command(
    "scaling",
    cls=WrapperCommand,
    renamed={"--out": "--out-dir"},
)
@click.option("--nproc", default="1,2", show_default=True, metavar="N,N...", help="Rank counts.")
@click.option("--steps", type=int, default=20, show_default=True, help="Measured steps per trial.")
@click.option(
    "--keep",
    type=click.Choice(["per-rank-batch", "global-batch"]),
    default="per-rank-batch",
    show_default=True,
    help="per-rank-batch: the script as is (the global batch grows with N); global-batch: "
    "{per_rank_batch} in ARGS becomes --global-batch / N.",
)
@click.option(
    "--global-batch", type=int, default=None, metavar="B", help="With --keep global-batch."
)
@click.option(
    "--out-dir",
    "out",
    type=click.Path(file_okay=False),
    default=None,
    metavar="DIR",
    help="Folder for the trials' recordings and logs (default: <recordings folder>/scaling-<time>).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@python_option
@click.argument(
    "argv", nargs=-1, required=True, type=click.UNPROCESSED, metavar="-- SCRIPT [ARGS]..."
)
def command(
    nproc: str,
    steps: int,
    keep: str,
    global_batch: int | None,
    out: str | None,
    as_json: bool,
    python: str | None,
    argv: tuple[str, ...],
) -> None:
    """Run SCRIPT briefly at each rank count on this node and report E(N) with its causes.

    E(N) = throughput(N) / (N x throughput(1)). Each trial is `torchdoctor launch` with N
    ranks, stopped after a few warm-up steps plus --steps measured steps on every rank.
    """
    import dataclasses

    from torchdoctor.launch.plan import split_script
    from torchdoctor.launch.scaling import bench_scaling, parse_sizes
    from torchdoctor.run.interpreter import announce, find_job_python

    typed = list(argv[1:] if argv and argv[0] == "--" else argv)
    job_python = find_job_python(typed, explicit=python)
    announce(job_python, "every trial")
    script = split_script(list(argv))
    sizes = parse_sizes(nproc)
    folder = (
        Path(out) if out else runs_dir() / time.strftime("scaling-%Y%m%dT%H%M%SZ", time.gmtime())
    )
    prepare_folder(folder, "--out-dir")
    console = stderr_console()

    def on_trial(t) -> None:
        if not as_json:
            state = f"{t.samples_per_s:.0f} samples/s" if t.samples_per_s else f"failed: {t.error}"
            console.print(f"torchdoctor bench scaling: {t.nproc} rank(s): {state}")

    result = bench_scaling(
        script,
        sizes,
        steps,
        folder,
        keep=keep,
        global_batch=global_batch,
        on_trial=on_trial,
        python=job_python.executable,
    )
    if as_json:
        dump_json("bench-scaling", dataclasses.asdict(result))
        return
    click.echo(f"scaling of {' '.join(script)} ({keep} kept, {steps} measured steps per trial)")
    click.echo(
        f"{'ranks':>5}  {'samples/s':>10}  {'E(N)':>5}  {'step ms':>8}  {'data ms':>8}  "
        f"{'comm ms':>8}  {'straggle ms':>11}  {'cores/rank':>10}  {'others CPU':>10}"
    )
    for t in result.trials:
        click.echo(
            f"{t.nproc:>5}  {_f(t.samples_per_s, 0):>10}  {_f(t.efficiency, 2):>5}  "
            f"{_ms(t.step_s):>8}  {_ms(t.data_wait_s):>8}  {_ms(t.exposed_comm_s):>8}  "
            f"{_ms(t.straggle_s):>11}  {_f(t.cores_per_rank, 2):>10}  {_f(t.others_cpu, 0) + ' %':>10}"
        )
    for line in result.explanation:
        click.echo(line)
    click.echo(f"Recommendation: {result.recommendation}")
    click.echo(f"recordings: {folder}")


def _f(value, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _ms(seconds) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"
