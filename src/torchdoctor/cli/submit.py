"""``torchdoctor submit -- CMD ARGS...``: queue a job; it starts when what it needs is free."""

from __future__ import annotations

import os

import click

from torchdoctor.cli.common import auto_profile_env, job_name, no_auto_profile_option
from torchdoctor.cli.json_output import dump_json
from torchdoctor.cli.parsing import WrapperCommand
from torchdoctor.cli.queue import JOB_IDS
from torchdoctor.errors import UserError


@click.command(
    "submit",
    cls=WrapperCommand,
)
@click.option("--gpus", type=int, default=0, metavar="N", help="How many GPUs (any of them).")
@click.option(
    "--gpu", "gpu", metavar="ID,...", help="These GPUs: NVML indexes or UUIDs (PCI bus order)."
)
@click.option(
    "--vram",
    metavar="SIZE|auto",
    help="GPU memory per GPU, e.g. 12G (= 12GiB, 12 x 2^30 bytes; 12GB is 12 x 10^9); auto: from the last run of this command. "
    "Without it the GPUs are given whole.",
)
@click.option("--cpus", type=int, default=1, show_default=True, metavar="N", help="CPU cores.")
@click.option(
    "--mem", metavar="SIZE|auto", help="RAM, e.g. 16G (= 16GiB); auto: from the last run."
)
@click.option(
    "--estimate",
    "estimate_args",
    metavar="'SPEC ARGS'",
    help="For --vram auto without history: `torchdoctor estimate` arguments, "
    "e.g. 'models.py:make --batch 64 --gpu A100-80GB'.",
)
@click.option(
    "--after",
    "after",
    type=JOB_IDS,
    multiple=True,
    metavar="ID",
    help="Start only after job ID succeeded.",
)
@click.option("--priority", type=int, default=0, show_default=True, help="Higher starts first.")
@click.option("--name", help="A name for the job (default: from the command).")
@click.option(
    "--cwd",
    type=click.Path(file_okay=False, exists=True),
    help="Folder the job runs in (default: this one).",
)
@click.option("-q", "--quiet", is_flag=True, help="Print the job id only.")
@click.option("--json", "as_json", is_flag=True, help="Print the queued job as JSON.")
@no_auto_profile_option
@click.argument("argv", nargs=-1, required=True, type=click.UNPROCESSED, metavar="-- CMD [ARGS]...")
def command(
    gpus: int,
    gpu: str | None,
    vram: str | None,
    cpus: int,
    mem: str | None,
    estimate_args: str | None,
    after: tuple[list[int], ...],
    priority: int,
    name: str | None,
    cwd: str | None,
    quiet: bool,
    as_json: bool,
    no_auto_profile: bool,
    argv: tuple[str, ...],
) -> None:
    """Queue CMD and return at once. It starts when its GPUs, cores and memory are free, under
    torchdoctor's recorder, without a shell, with this environment. `torchdoctor queue` shows
    it; its output goes to `torchdoctor queue logs ID`."""
    from torchdoctor.queue import Request
    from torchdoctor.queue.needs import AUTO, resolve_need
    from torchdoctor.queue.system import open_queue
    from torchdoctor.units import fmt_bytes

    args = list(argv)
    if not args:
        raise UserError(
            "no command given: put it after `--`, e.g. `torchdoctor submit -- python train.py`"
        )
    if gpus < 0:
        raise UserError("--gpus must be 0 or more")
    gpu_ids = [g.strip() for g in gpu.split(",") if g.strip()] if gpu else None
    if gpu_ids and gpus and gpus != len(gpu_ids):
        raise UserError(f"--gpus {gpus} and --gpu {gpu} disagree: give one of them")
    if estimate_args is not None and (vram or "").strip().lower() != AUTO:
        # --estimate sizes --vram auto (its help says so); with any other --vram it was
        # silently dropped, and the job queued without the size the user meant to give it.
        raise UserError(
            "--estimate sizes the GPU memory of --vram auto: add --vram auto, or drop --estimate"
            + (f" (--vram {vram} is given)" if vram else "")
        )
    with open_queue() as queue:
        vram_need, vram_source = resolve_need("vram", vram, args, queue, estimate_args)
        mem_need, mem_source = resolve_need("mem", mem, args, queue)
        request = Request(
            argv=args,
            cwd=os.path.abspath(cwd or os.getcwd()),
            env={**os.environ, **auto_profile_env(no_auto_profile)},
            name=name or job_name(args),
            gpus=gpus,
            gpu_ids=gpu_ids,
            vram=vram_need,
            vram_source=vram_source,
            cpus=cpus,
            mem=mem_need,
            mem_source=mem_source,
            priority=priority,
            after=[i for ids in after for i in ids],
        )
        job = queue.submit(request)
    if as_json:
        dump_json(
            "submit",
            {
                "id": job.id,
                "name": job.name,
                "argv": list(job.argv),
                "cpus": job.cpus,
                "gpus": job.gpus,
                "gpu_ids": job.gpu_ids,
                "vram_bytes": job.vram,
                "vram_source": job.vram_source,
                "mem_bytes": job.mem,
                "mem_source": job.mem_source,
                "priority": job.priority,
                "after": list(job.after or []),
            },
        )
        return
    if quiet:
        click.echo(job.id)
        return
    asks = [f"{job.cpus} core{'s' if job.cpus != 1 else ''}"]
    if job.gpus:
        asks.append(f"{job.gpus} GPU{'s' if job.gpus != 1 else ''}")
    if job.vram is not None:
        asks.append(f"{fmt_bytes(job.vram)} VRAM per GPU ({job.vram_source})")
    elif job.gpus:
        asks.append("whole GPUs")
    if job.mem is not None:
        asks.append(f"{fmt_bytes(job.mem)} RAM ({job.mem_source})")
    click.echo(f"job {job.id} queued: {job.name}; asks {', '.join(asks)}; {_will_see(job)}")


def _will_see(job) -> str:
    """What the job finds when it runs (the defaults a user may not have meant)."""
    from torchdoctor.queue.environment import is_torchrun, processes_per_node

    ranks = processes_per_node(job.argv) if is_torchrun(job.argv) else 1
    threads = max(1, job.cpus // ranks)
    gpus = "no GPU (CUDA_VISIBLE_DEVICES empty)" if not job.gpus else f"{job.gpus} GPU(s)"
    return (
        f"it will see {gpus}, {job.cpus} core{'s' if job.cpus != 1 else ''} "
        f"and OMP_NUM_THREADS={threads}"
    )
