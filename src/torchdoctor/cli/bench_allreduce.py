"""``torchdoctor bench allreduce``: sweep collective sizes, report time, algbw and busbw."""

from __future__ import annotations

import click

from torchdoctor.cli.common import python_option, run_in_job_python
from torchdoctor.cli.json_output import dump_json
from torchdoctor.cli.progress import Steps
from torchdoctor.doctor.allreduce import (
    OPS,
    BenchConfig,
    bench_local,
    check_fits,
    parse_sizes,
    run_rank,
    under_launcher,
)
from torchdoctor.doctor.allreduce_report import format_result, format_row
from torchdoctor.errors import UserError, require_torch


@click.command("allreduce")
@click.option(
    "--backend",
    type=click.Choice(["gloo", "nccl"]),
    default=None,
    help="Default: nccl with GPUs, else gloo.",
)
@click.option(
    "--nproc",
    type=click.IntRange(2),
    default=2,
    show_default=True,
    help="Local ranks to start (ignored under torchrun).",
)
@click.option(
    "--sizes",
    default="8K:256M",
    show_default=True,
    help="LOW:HIGH (doubling) or a comma list; K, M, G suffixes.",
)
@click.option("--dtype", default="float32", show_default=True, help="Element type of the buffers.")
@click.option(
    "--iters",
    type=click.IntRange(1),
    default=20,
    show_default=True,
    help="Timed iterations per size.",
)
@click.option(
    "--warmup",
    type=click.IntRange(0),
    default=5,
    show_default=True,
    help="Untimed iterations per size first.",
)
@click.option("--ops", default=",".join(OPS), show_default=True, help="Operations to sweep.")
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(1),
    default=120.0,
    show_default=True,
    help="Seconds a collective may wait for the others.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option(
    "--force",
    is_flag=True,
    help="Start even when the largest size would not fit in the memory available.",
)
@python_option
@click.option("--quiet", is_flag=True, help="No progress on stderr.")
def command(
    backend: str | None,
    nproc: int,
    sizes: str,
    dtype: str,
    iters: int,
    warmup: int,
    ops: str,
    timeout_s: float,
    as_json: bool,
    force: bool,
    python: str | None,
    quiet: bool,
) -> None:
    """Measure all-reduce, all-gather and reduce-scatter like nccl-tests: per size the time per
    op, algbw = S/t and busbw = algbw x 2(n-1)/n (all-reduce) or x (n-1)/n (the others).

    Starts --nproc ranks here, or, under torchrun (RANK/WORLD_SIZE/MASTER_ADDR set), runs as
    one rank of that launch and rank 0 prints. Across nodes busbw is compared with the link's
    rated speed (target 85 %), with the likely cause when it falls short.
    """
    run_in_job_python(python)
    torch = require_torch("torchdoctor bench allreduce")
    chosen_ops = tuple(o.strip().replace("-", "_") for o in ops.split(",") if o.strip())
    unknown = [o for o in chosen_ops if o not in OPS]
    if unknown or not chosen_ops:
        raise UserError(
            f"--ops: unknown operation(s) {', '.join(unknown) or '(none)'}; known: {', '.join(OPS)}"
        )
    if not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise UserError(
            f"--dtype {dtype}: not a torch dtype (float32, float16, bfloat16, float64...)"
        )
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise UserError(
            "--backend nccl needs CUDA GPUs and a CUDA build of torch; use --backend gloo here"
        )
    cfg = BenchConfig(
        backend=backend,
        sizes=parse_sizes(sizes),
        dtype=dtype,
        iters=iters,
        warmup=warmup,
        ops=chosen_ops,
        timeout_s=timeout_s,
    )
    ranks, local_ranks = _ranks(nproc)
    if not force:
        _check_memory(torch, cfg, ranks, local_ranks)
    total = len(cfg.sizes) * len(cfg.ops)
    with Steps("all-reduce sweep", total=total, quiet=quiet) as steps:

        def on_row(row) -> None:
            steps.note(f"{row.op:<14} {format_row(row)}")
            steps.advance(row.op)

        result = (
            run_rank(cfg, on_row=on_row) if under_launcher() else bench_local(cfg, nproc, on_row)
        )
    if result is None:
        return  # not rank 0 of a launch: rank 0 prints
    if as_json:
        dump_json("bench-allreduce", result.to_dict())
    else:
        click.echo(format_result(result))


def _ranks(nproc: int) -> tuple[int, int]:
    """(ranks in all, ranks on this machine): --nproc here, torchrun's own under torchrun."""
    import os

    if under_launcher():
        world = int(os.environ["WORLD_SIZE"])
        return world, int(os.environ.get("LOCAL_WORLD_SIZE") or world)
    return nproc, nproc


def _check_memory(torch, cfg: BenchConfig, ranks: int, local_ranks: int) -> None:
    """The buffers must fit before any is made: gloo's ranks share this machine's RAM, each
    NCCL rank has one GPU's memory (the GPU with the least free memory counts)."""
    element_size = torch.empty(0, dtype=getattr(torch, cfg.dtype)).element_size()
    if cfg.backend == "gloo":
        from torchdoctor.sampling.hostinfo import available_ram

        check_fits(cfg.sizes, ranks, local_ranks, element_size, available_ram(), "RAM")
        return
    from torchdoctor.sampling.gpus import GpuReader

    gpus = GpuReader()
    try:
        free = gpus.free_memory()
    finally:
        gpus.close()
    if free:  # NVML unreadable: NCCL's own out-of-memory error is all there is
        check_fits(cfg.sizes, ranks, 1, element_size, min(free.values()), "a GPU")
