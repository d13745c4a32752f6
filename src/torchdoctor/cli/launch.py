"""`torchdoctor launch -- SCRIPT ARGS...`: torchrun with every rank recorded and instrumented."""

from __future__ import annotations

import os
import time
from pathlib import Path

import click

from torchdoctor.cli.common import (
    check_interval,
    interval_option,
    print_end_report,
    python_option,
    stderr_console,
    thresholds_option,
)
from torchdoctor.cli.parsing import WrapperCommand
from torchdoctor.errors import UserError


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
@thresholds_option
@python_option
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
    thresholds: str | None,
    python: str | None,
    argv: tuple[str, ...],
) -> None:
    """Start SCRIPT on every rank through torchrun, record this node, exit with its status.

    Only what you left unset is set: OMP_NUM_THREADS (usable cores / local ranks), a free
    rendezvous port on one node, GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME across nodes, and the
    flight recorder (dumps next to the recording). Every rank sees all the node's GPUs.
    Run it on each node with the same --nnodes/--master-addr/--master-port; then
    `torchdoctor diagnose DIR_OR_FILES...` reads the nodes' recordings as one job.
    """
    from torchdoctor.launch.plan import (
        LaunchOptions,
        launch_meta,
        plan_launch,
        split_script,
        torchrun_supports_numa_binding,
    )
    from torchdoctor.launch.preflight import preflight
    from torchdoctor.recording import create_recording_file
    from torchdoctor.recording.paths import removed_if_unused
    from torchdoctor.run.interpreter import find_job_python
    from torchdoctor.run.process import resolve_command
    from torchdoctor.run.session import record_command
    from torchdoctor.sampling.gpus import GpuReader

    check_interval(interval)
    job_python = find_job_python(_command(argv), explicit=python)
    script = split_script(list(argv))
    opts = LaunchOptions(
        nproc_per_node=nproc_per_node,
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        standalone=standalone,
    )
    console = stderr_console()
    name = f"{Path(script[-1] if script[0] == '-m' else script[0]).stem}-node{node_rank}"
    path = create_recording_file(name, folder=out, option="--out")
    with removed_if_unused(path):  # an error before the job starts leaves no file
        fr_dir = path.resolve().with_suffix(".fr")
        gpus = GpuReader()
        gpu_count = len(gpus.status.gpus) if gpus.status.available else 0
        plan = plan_launch(
            opts,
            script,
            env=dict(os.environ),
            fr_dir=fr_dir,
            gpu_count=gpu_count,
            python=job_python.executable,
            numa_binding=torchrun_supports_numa_binding(),
        )
        report = preflight(plan, gpu_status=gpus.status)
        if not quiet:
            console.print(
                f"torchdoctor launch: {plan.nproc_per_node} rank(s) on node {plan.node_rank} of "
                f"{plan.nnodes} (world size {plan.world_size}), rendezvous {plan.rendezvous}"
            )
            if not job_python.is_ours:
                console.print(f"  torchrun and the ranks run with {job_python.describe()}")
            for note in plan.notes:
                console.print(f"  {note}")
            for line in report.lines():
                console.print(f"  {line}")
        gpus.close()  # the recorder opens its own
        if report.errors and not force:
            raise UserError(
                f"preflight found {len(report.errors)} error(s) ({report.errors[0]}); "
                "fix them, or start anyway with --force"
            )
        try:
            fr_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(
                f"cannot create {str(fr_dir)!r}: {exc.strerror}; choose --out"
            ) from None
        executable = resolve_command(list(plan.argv))
        started = time.time()
        status = record_command(
            executable,
            plan.argv,
            path,
            interval,
            instrument=True,
            env=plan.env,
            mode="launch",
            meta={"launch": launch_meta(plan, report, started)},
        )
    if not quiet:
        console.print(f"torchdoctor launch: recording {path}")
        print_end_report(path, console, thresholds)
    if not any(fr_dir.iterdir()):
        fr_dir.rmdir()
    ctx.exit(status)


def _command(argv: tuple[str, ...]) -> list[str]:
    """The job's command line as typed after ``--``."""
    return list(argv[1:] if argv and argv[0] == "--" else argv)
