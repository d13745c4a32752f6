"""``torchdoctor doctor``: check the machine and the fabric before a distributed run."""

from __future__ import annotations

import json

import click

from torchdoctor.cli.common import python_option, run_in_job_python
from torchdoctor.cli.json_output import dump_json
from torchdoctor.doctor import Plan, exit_status, run_checks
from torchdoctor.doctor.render import render, to_json
from torchdoctor.errors import UserError


@click.command("doctor")
@click.option("--json", "as_json", is_flag=True, help="Print the checks as JSON (see README).")
@click.option("--master-addr", default=None, help="The rendezvous host (default: $MASTER_ADDR).")
@click.option(
    "--master-port",
    type=click.IntRange(1, 65535),
    default=None,
    help="The rendezvous port (default: $MASTER_PORT, else 29500).",
)
@click.option(
    "--nnodes", type=click.IntRange(1), default=1, show_default=True, help="Nodes the run will use."
)
@click.option(
    "--nproc-per-node",
    type=click.IntRange(1),
    default=None,
    help="Ranks per node (default: one per GPU).",
)
@click.option(
    "--workers", type=click.IntRange(0), default=None, help="DataLoader workers per rank, if known."
)
@click.option(
    "--only", multiple=True, help="Run only this check or family (repeatable), e.g. --only network."
)
@click.option(
    "--bench", is_flag=True, help="Also run a short all-reduce sweep on this node (gloo or nccl)."
)
@python_option
@click.option("--quiet", is_flag=True, help="No progress on stderr.")
def command(
    as_json: bool,
    master_addr: str | None,
    master_port: int | None,
    nnodes: int,
    nproc_per_node: int | None,
    workers: int | None,
    only: tuple[str, ...],
    bench: bool,
    python: str | None,
    quiet: bool,
) -> int:
    """Check versions, GPUs, network, rendezvous, host limits and left-behind NCCL settings.

    Every check says ok / warning / error (or skipped, with the reason), what it saw and the
    exact fix. Nothing needs root and nothing is changed. Exits 1 when any check is an error.
    """
    run_in_job_python(python)  # the versions and torch checks are the training env's
    plan = Plan(
        master_addr=master_addr,
        master_port=master_port,
        nnodes=nnodes,
        nproc_per_node=nproc_per_node,
        workers=workers,
        bench=bench,
    )
    from torchdoctor.cli.progress import Steps

    # --bench sweeps all-reduce sizes for several seconds: say so while it runs.
    try:
        with Steps("checking" + (" (with an all-reduce sweep)" if bench else ""), quiet=quiet):
            checks = run_checks(plan, list(only) or None)
    except ValueError as exc:
        raise UserError(f"{exc}") from None
    if as_json:
        dump_json("doctor", json.loads(to_json(checks, plan)))
    else:
        render(checks)
    return exit_status(checks)
