"""One node of `torchdoctor launch`: plan torchrun, check the plan, record every rank here.

The CLI (``cli/launch.py``) turns its options into :class:`LaunchOptions` and calls
:func:`launch_node`; everything between the options and the exit status happens here.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torchdoctor.errors import UserError
from torchdoctor.instrument.agent.contract import ENV_DIE_WITH
from torchdoctor.launch.plan import (
    LaunchOptions,
    launch_meta,
    plan_launch,
    split_script,
    torchrun_supports_numa_binding,
)
from torchdoctor.launch.preflight import preflight
from torchdoctor.recording.paths import prepare_folder, removed_if_unused
from torchdoctor.run.interpreter import JobPython


@dataclass(frozen=True, slots=True)
class NodeResult:
    status: int  # torchrun's exit status: the command's own
    recording: Path


def launch_node(
    opts: LaunchOptions,
    argv: list[str],
    *,
    out: str,
    interval: float,
    force: bool = False,
    python: JobPython | None = None,
    say: Callable[[str], None] | None = None,
    keep: str = "compact",
) -> NodeResult:
    """Plan and preflight the launch of ``argv`` (``SCRIPT ARGS`` or ``-m MODULE ARGS``),
    then run torchrun recorded into a new file in ``out``; torchrun's status and the file.

    ``say`` gets our progress lines (the plan, its notes, the preflight). A preflight error
    stops the launch unless ``force``; an error before the job starts leaves no file.
    ``python`` runs torchrun and so every rank (default: ours; see
    :func:`torchdoctor.run.interpreter.find_job_python`).
    """
    from torchdoctor.run.process import resolve_command
    from torchdoctor.run.session import claim_file, record_command
    from torchdoctor.sampling.gpus import GpuReader

    say = say or (lambda line: None)
    script = split_script(list(argv))
    # `-m pkg.train --epochs 3` is named after the module, `train.py ...` after the script
    target = script[1].rsplit(".", 1)[-1] if script[0] == "-m" else Path(script[0]).stem
    path = claim_file(None, f"{target}-node{opts.node_rank}", folder=out)
    with removed_if_unused(path):
        fr_dir = path.resolve().with_suffix(".fr")
        gpus = GpuReader()
        gpu_count = len(gpus.status.gpus) if gpus.status.available else 0
        plan = plan_launch(
            opts,
            script,
            env=dict(os.environ),
            fr_dir=fr_dir,
            gpu_count=gpu_count,
            python=python.executable if python is not None else sys.executable,
            numa_binding=torchrun_supports_numa_binding(),
        )
        report = preflight(plan, gpu_status=gpus.status)
        say(
            f"torchdoctor launch: {plan.nproc_per_node} rank(s) on node {plan.node_rank} of "
            f"{plan.nnodes} (world size {plan.world_size}), rendezvous {plan.rendezvous}"
        )
        say(f"torchdoctor launch: recording this node into {path}")
        if python is not None and not python.is_ours:
            say(f"  torchrun and the ranks run with {python.describe()}")
        for line in (*plan.notes, *report.lines()):
            say(f"  {line}")
        gpus.close()  # the recorder opens its own
        if report.errors and not force:
            raise UserError(
                f"preflight found {len(report.errors)} error(s) ({report.errors[0]}); "
                "fix them, or start anyway with --force"
            )
        prepare_folder(fr_dir, "--out")
        # torchrun dies with this process, and stops its ranks then (see ENV_DIE_WITH): a
        # launcher killed with SIGKILL left every rank running, holding its memory.
        plan.env[ENV_DIE_WITH] = str(os.getpid())
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
            keep=keep,
            say=say,
        )
    if not any(fr_dir.iterdir()):
        fr_dir.rmdir()  # no rank dumped its flight recorder
    return NodeResult(status, path)
