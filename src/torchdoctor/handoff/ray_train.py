"""``--to ray-train`` (opt-in): a Python file running the unchanged script under Ray Train's
TorchTrainer, its ScalingConfig from the sizing.

Ray Train calls ``init_process_group`` itself before the script runs, so a torchrun script's
own call fails ("trying to initialize the default process group twice"); re-making the group
on the same port fails too. The file carries the small shim that works: the script's
``init_process_group`` joins the group that exists, its ``destroy_process_group`` is left to
Ray Train. Ray Train sets torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, ...), not
GROUP_RANK or TORCHELASTIC_*.

Every value is written as a Python literal (``repr``), so no word of the command can become
code; comments are made printable.
"""

from __future__ import annotations

import os
from pathlib import Path

from torchdoctor.errors import UserError
from torchdoctor.sampling.roles import is_python
from torchdoctor.sizing.command import torchrun_invocation
from torchdoctor.sizing.size import JobSize
from torchdoctor.units import fmt_bytes

HEADER = "# Written by `torchdoctor handoff --to ray-train`"

TEMPLATE = """#!/usr/bin/env python
{header}
import os
import runpy
import sys

import ray
from ray.train import ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

SCRIPT = {script!r}
ARGS = {args!r}
ENV = {env!r}
NUM_WORKERS = {workers!r}
USE_GPU = {use_gpu!r}
RESOURCES_PER_WORKER = {resources!r}


def train_loop_per_worker(config):
    import torch.distributed as dist

    os.environ.update(ENV)
    made_by_ray = dist.init_process_group

    def init_process_group(*args, **kwargs):
        # Ray Train made the group already: the script's own call joins it.
        if dist.is_initialized():
            return None
        return made_by_ray(*args, **kwargs)

    dist.init_process_group = init_process_group
    dist.destroy_process_group = lambda *args, **kwargs: None  # Ray Train tears it down
    sys.argv = [SCRIPT, *ARGS]
    runpy.run_path(SCRIPT, run_name="__main__")


if __name__ == "__main__":
    ray.init()  # the cluster of RAY_ADDRESS (a Ray job's own), else a local one
    trainer = TorchTrainer(
        train_loop_per_worker,
        scaling_config=ScalingConfig(
            num_workers=NUM_WORKERS,
            use_gpu=USE_GPU,
            resources_per_worker=RESOURCES_PER_WORKER,
            placement_strategy="PACK",
        ),
        torch_config=TorchConfig(backend="nccl" if USE_GPU else "gloo"),
    )
    result = trainer.fit()
    sys.exit(0 if result.error is None else 1)
"""


def render_ray_train(size: JobSize, command: list[str], source: str, notes: list[str]) -> str:
    """The TorchTrainer file for ``command``: one Ray Train worker per rank, each worker's
    resources the node's sized figures divided by its ranks."""
    torchrun_invocation(command)  # the same checks as every target
    if not is_python(command[0]) or command[1:2] == ["-m"]:
        raise UserError(
            "--to ray-train runs a Python script file (python train.py ...): Ray Train calls "
            "it inside its workers"
        )
    script = command[1]
    if os.path.isfile(script):  # False for a name too long, where Path.is_file raises
        script = str(Path(script).resolve())
    ranks = int(size.ranks_per_node.value)
    gpus = int(size.gpus_per_node.value)
    resources: dict[str, float] = {"CPU": max(1, int(size.cpus_per_task.value) // ranks)}
    if gpus:
        resources["GPU"] = 1
    lines = [
        f"{HEADER}: the script under Ray Train's TorchTrainer.",
        f"# Sized from {_comment(source)}.",
        *[f"# NOTE: {_comment(n)}" for n in notes],
        f"# workers: {size.nodes} node(s) x {ranks} ranks: {_comment(size.ranks_per_node.source)}",
        f"# CPU per worker: {_comment(size.cpus_per_task.source)}, / {ranks} ranks",
        f"# GPU per worker: {'1' if gpus else 'none'}: {_comment(size.gpus_per_node.source)}",
    ]
    if size.mem_per_node is not None:
        shm = int(size.shm.value) if size.shm is not None else 0
        per_worker = (int(size.mem_per_node.value) + shm) // ranks
        resources["memory"] = float(per_worker)
        lines.append(
            f"# memory per worker {fmt_bytes(per_worker)}: {_comment(size.mem_per_node.source)}"
            f"; + {fmt_bytes(shm)} shared memory; / {ranks} ranks (placement only in Ray)"
        )
    env = {"OMP_NUM_THREADS": str(size.threads_per_rank.value)}
    lines.append(f"# OMP_NUM_THREADS: {_comment(size.threads_per_rank.source)}")
    for key, figure in sorted(size.network_env.items()):
        if key.isidentifier():
            env[key] = str(figure.value)
            lines.append(f"# {key}: {_comment(figure.source)}")
    lines.append("# The ranks run in Ray's workers, not under torchdoctor's recorder.")
    return TEMPLATE.format(
        header="\n".join(lines),
        script=script,
        args=list(command[2:]),
        env=env,
        workers=size.nodes * ranks,
        use_gpu=bool(gpus),
        resources=resources,
    )


def _comment(text: str) -> str:
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
