"""`torchdoctor launch -- SCRIPT ARGS...`: torchrun with every rank recorded and instrumented."""

from __future__ import annotations

import os

import click

from torchdoctor.cli.common import (
    auto_profile_env,
    check_interval,
    interval_option,
    keep_option,
    no_auto_profile_option,
    profile_steps_env,
    python_option,
    stderr_console,
    thresholds_option,
)
from torchdoctor.cli.parsing import WrapperCommand


@click.command(
    "launch",
    cls=WrapperCommand,
    renamed={"--out": "--out-dir"},
)
@click.option(
    "--nproc-per-node",
    default="auto",
    show_default=True,
    metavar="N|auto",
    help="Ranks on this node (auto: one per GPU, 1 without GPUs).",
)
@click.option("--nnodes", type=int, default=1, show_default=True, help="Nodes in the job.")
@click.option("--node-rank", type=int, default=0, show_default=True, help="This node's rank.")
@click.option("--master-addr", default=None, metavar="ADDR", help="Node 0's routable address.")
@click.option("--master-port", type=int, default=None, metavar="PORT", help="Rendezvous port.")
@click.option("--standalone", is_flag=True, help="One node, free port (the default on one node).")
@click.option(
    "--out-dir",
    "out",
    type=click.Path(file_okay=False),
    default=None,
    metavar="DIR",
    help="Folder for this node's recording and the ranks' flight-recorder dumps "
    "(default: the recordings folder, $TORCHDOCTOR_RUNS_DIR or ./torchdoctor-runs).",
)
@click.option("--force", is_flag=True, help="Start even when the preflight finds an error.")
@click.option("--quiet", is_flag=True, help="Print nothing of our own (errors aside).")
@interval_option
@keep_option
@thresholds_option
@python_option
@click.option(
    "--profile-steps",
    metavar="A-B",
    default=None,
    help="Profile steps A to B of every rank with torch.profiler (as `run --profile-steps`): "
    "each rank's trace goes to <recording>.profile/rank<R>-steps<A>-<B>.pt.trace.json.gz.",
)
@no_auto_profile_option
@click.argument(
    "argv", nargs=-1, required=True, type=click.UNPROCESSED, metavar="-- SCRIPT [ARGS]..."
)
@click.pass_context
def command(
    ctx: click.Context,
    nproc_per_node: str,
    nnodes: int,
    node_rank: int,
    master_addr: str | None,
    master_port: int | None,
    standalone: bool,
    out: str,
    force: bool,
    quiet: bool,
    interval: float,
    keep: str,
    thresholds: str | None,
    python: str | None,
    profile_steps: str | None,
    no_auto_profile: bool,
    argv: tuple[str, ...],
) -> None:
    """Start SCRIPT on every rank through torchrun, record this node, exit with its status.

    Only what you left unset is set: OMP_NUM_THREADS (usable cores / local ranks), a free
    rendezvous port on one node, GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME across nodes, and the
    flight recorder (dumps next to the recording). Every rank sees all the node's GPUs.
    Run it on each node with the same --nnodes/--master-addr/--master-port; then
    `torchdoctor diagnose DIR_OR_FILES...` reads the nodes' recordings as one job.
    """
    from torchdoctor.launch.node import launch_node
    from torchdoctor.launch.plan import LaunchOptions
    from torchdoctor.run.end_report import print_end_report
    from torchdoctor.run.interpreter import find_job_python

    check_interval(interval)
    # The ranks' environment is ours (launch_node copies it): the window goes with it.
    os.environ.update(profile_steps_env(profile_steps, no_instrument=False))
    os.environ.update(auto_profile_env(no_auto_profile))
    job_python = find_job_python(_command(argv), explicit=python)
    opts = LaunchOptions(
        nproc_per_node=nproc_per_node,
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        standalone=standalone,
    )
    console = stderr_console()
    result = launch_node(
        opts,
        list(argv),
        out=out,
        interval=interval,
        keep=keep,
        force=force,
        python=job_python,
        say=None if quiet else console.print,
    )
    if not quiet:
        print_end_report(result.recording, console, thresholds)
    ctx.exit(result.status)


def _command(argv: tuple[str, ...]) -> list[str]:
    """The job's command line as typed after ``--``."""
    return list(argv[1:] if argv and argv[0] == "--" else argv)
