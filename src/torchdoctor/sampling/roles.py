"""Best-effort roles of a job's processes, from the tree and the command lines.

Roles: "trainer" (the Python process running the user's script; every rank of torchrun),
"dataloader-worker" (children a trainer starts for its DataLoader), "launcher" (torchrun,
a shell or a wrapper whose children are trainers) and "other" (helpers such as the
multiprocessing resource tracker, compile workers, tools a trainer runs).
"""

from __future__ import annotations

import os
import re

TRAINER = "trainer"
WORKER = "dataloader-worker"
LAUNCHER = "launcher"
OTHER = "other"
# What the in-job agent calls a torchrun rank in its process.role setting (the agent, standard
# library only, keeps its own copy of these names).
RANK = "rank"
COMPUTE = (TRAINER, RANK)  # the processes that run the model (not workers, launchers, helpers)

# A Python interpreter's file name: python, python3, python3.12, pypy3.10, with the debug or
# ABI suffix some builds carry (python3.12d, python3.7m, Debian's python3-dbg).
_PYTHON = re.compile(r"^(python|pypy)(\d+(\.\d+)*)?(d|m|u|dm|-dbg)?$")
_SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh", "fish", "busybox"})
# Programs that start the real job as their child(ren).
_WRAPPERS = frozenset(
    {
        "torchrun",
        "accelerate",
        "deepspeed",
        "mpirun",
        "mpiexec",
        "srun",
        "env",
        "nohup",
        "timeout",
        "taskset",
        "numactl",
        "stdbuf",
        "nice",
        "ionice",
        "chrt",
        "uv",
        "poetry",
        "conda",
        "mamba",
        "pixi",
        "time",
        "xargs",
        "torchdoctor",
    }
)
_LAUNCH_MODULES = ("torch.distributed.run", "torch.distributed.launch", "accelerate.commands")
# multiprocessing helpers that are not workers themselves.
_HELPER_MARKERS = (
    "multiprocessing.resource_tracker",
    "multiprocessing.semaphore_tracker",
    "torch._inductor.compile_worker",
    "compile_worker",
)
_FORKSERVER_MARKER = "multiprocessing.forkserver"
_SPAWN_MARKERS = ("multiprocessing.spawn", "--multiprocessing-fork")


def is_python(executable: str) -> bool:
    """Whether ``executable`` (a path or a name) is a Python interpreter: the one rule for
    every part of torchdoctor that asks."""
    return bool(_PYTHON.match(os.path.basename(executable)))


class Traits:
    """What the command line says about a process; computed once per exec."""

    __slots__ = ("python", "launcher", "helper", "forkserver", "spawned")

    def __init__(self, cmdline: list[str]) -> None:
        joined = " ".join(cmdline)
        self.python = bool(cmdline) and is_python(cmdline[0])
        self.forkserver = _FORKSERVER_MARKER in joined
        self.helper = any(m in joined for m in _HELPER_MARKERS)
        self.spawned = any(m in joined for m in _SPAWN_MARKERS)
        self.launcher = _is_launcher(cmdline, self.python)


def _is_launcher(cmdline: list[str], python: bool) -> bool:
    if not cmdline:
        return False
    prog = os.path.basename(cmdline[0])
    if python:
        # "python -m torch.distributed.run ..." or "python /venv/bin/torchrun ...": the script
        # run by the interpreter is the launcher.
        args = cmdline[1:]
        for i, a in enumerate(args):
            if a == "-m" and i + 1 < len(args):
                return args[i + 1].startswith(_LAUNCH_MODULES) or args[i + 1] == "torchdoctor"
            if a.startswith("-"):
                continue
            return os.path.basename(a) in _WRAPPERS
        return False
    return prog in _SHELLS or prog in _WRAPPERS


def classify(
    traits: Traits,
    cmdline: list[str],
    parent_role: str | None,
    parent_traits: Traits | None,
    parent_cmdline: list[str] | None,
    has_children: bool,
    has_worker_children: bool,
) -> str:
    """The role of one process given its parent's (``None`` for the root of the job)."""
    if traits.helper or (traits.forkserver and not (parent_traits and parent_traits.forkserver)):
        return OTHER
    if traits.launcher:
        return LAUNCHER
    if parent_role == TRAINER:
        worker_like = traits.spawned or (parent_cmdline is not None and cmdline == parent_cmdline)
        if worker_like:
            # torch.multiprocessing.spawn starts DDP ranks the same way a DataLoader starts
            # workers; a child that has workers of its own is a trainer.
            return TRAINER if has_worker_children else WORKER
        return OTHER
    if parent_traits is not None and parent_traits.forkserver and parent_role == OTHER:
        # forkserver: the trainer asks a server process to fork the workers.
        return WORKER
    if parent_role is None or parent_role == LAUNCHER:
        if traits.python:
            return TRAINER
        return LAUNCHER if has_children else OTHER
    return OTHER


def is_worker_like(traits: Traits, cmdline: list[str], parent_cmdline: list[str] | None) -> bool:
    return traits.spawned or traits.forkserver or cmdline == parent_cmdline
