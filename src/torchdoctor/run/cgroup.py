"""A memory cgroup of the job's own: its RAM limit enforced by the kernel, not only promised.

A queued job's ``--mem`` becomes the ``memory.max`` (v2) or ``memory.limit_in_bytes`` (v1) of a
cgroup made for it, so a job that outgrows what it asked for is the one the OOM killer ends,
not a neighbour sharing the machine. Making cgroups needs root (or a delegated subtree); where
the machine does not allow it, :meth:`MemoryCgroup.create` says why and the job runs unlimited.

v2 forbids processes in a cgroup whose children have controllers ("no internal processes"),
so the job's cgroup goes under the root of the hierarchy (``/sys/fs/cgroup/torchdoctor/``); v1
hierarchies have no such rule and the job's cgroup goes under ours, inheriting its limits.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

from torchdoctor.sampling import procfs

GROUP = "torchdoctor"


@dataclass(slots=True)
class MemoryCgroup:
    version: int
    path: str
    limit: int

    @classmethod
    def create(cls, name: str, limit: int) -> MemoryCgroup:
        """A fresh cgroup named ``name`` limited to ``limit`` bytes (swap too); OSError: why not."""
        paths = procfs.cgroup_paths("self")
        if paths.memory_version is None or not paths.memory_dirs:
            raise OSError("no memory cgroup controller is mounted")
        if paths.memory_version == 2:
            root = paths.memory_dirs[-1]  # the mount point: the hierarchy's root
            parent = os.path.join(root, GROUP)
            _enable_memory(root)
            os.makedirs(parent, exist_ok=True)
            _enable_memory(parent)
        else:
            parent = paths.memory_dirs[0]
        path = os.path.join(parent, name)
        os.mkdir(path)
        group = cls(paths.memory_version, path, limit)
        try:
            group._limit()
        except OSError:
            group.remove()
            raise
        return group

    def _limit(self) -> None:
        if self.version == 2:
            _write(os.path.join(self.path, "memory.max"), str(self.limit))
            # Without this a job at its limit swaps instead of being stopped, and slows the box.
            with contextlib.suppress(FileNotFoundError):
                _write(os.path.join(self.path, "memory.swap.max"), "0")
        else:
            _write(os.path.join(self.path, "memory.limit_in_bytes"), str(self.limit))
            with contextlib.suppress(FileNotFoundError):  # swap accounting is off on many kernels
                _write(os.path.join(self.path, "memory.memsw.limit_in_bytes"), str(self.limit))

    def add(self, pid: int) -> None:
        _write(os.path.join(self.path, "cgroup.procs"), str(pid))

    def remove(self, timeout_s: float = 2.0) -> None:
        """Remove the cgroup once empty (a killed process leaves it a moment after its exit)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.05)


def _enable_memory(directory: str) -> None:
    """Let the children of ``directory`` limit memory."""
    control = os.path.join(directory, "cgroup.subtree_control")
    if "memory" not in (procfs.read_text(control) or "").split():
        _write(control, "+memory")


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
