"""What every doctor check returns, and what it is given.

A check is a plain :class:`Check`: its name (``family.what``), a status, what it saw and the
exact fix. ``details`` carries the same facts for programs (the launcher's preflight reads
the interface a run should use from ``network.route``'s details, for instance).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

OK = "ok"
WARNING = "warning"
ERROR = "error"
# The check could not run here (no GPU, no NVML, nothing to compare): ``saw`` says why.
SKIPPED = "skipped"
STATUSES = (OK, WARNING, ERROR, SKIPPED)


@dataclass(slots=True)
class Check:
    """The outcome of one check."""

    name: str  # "family.what", e.g. "network.route"
    status: str  # ok | warning | error | skipped
    saw: str  # what it found, in words, with the figures
    fix: str = ""  # the exact change to make ("" when there is nothing to do)
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def family(self) -> str:
        return self.name.split(".", 1)[0]


@dataclass(slots=True)
class Plan:
    """The run the checks are for, and where they look.

    ``env`` is the environment the run will get (default: this process's). ``nvml_module`` is
    the NVML bindings (``None``: the installed ``pynvml``; tests pass their fake) and
    ``pid_namespace`` how NVML's PIDs map to ours (``None``: detected from /proc).
    ``gpu_status`` is the GPUs as the caller already read them (``launch`` has; ``None``: the
    checks read them).
    """

    master_addr: str | None = None
    master_port: int | None = None
    nnodes: int = 1
    nproc_per_node: int | None = None
    workers: int | None = None  # DataLoader workers per rank, when known
    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    nvml_module: Any = None
    pid_namespace: Any = None
    bench: bool = False
    gpu_status: Any = None  # a torchdoctor.sampling.types.GpuStatus

    def __post_init__(self) -> None:
        if self.master_addr is None:
            self.master_addr = self.env.get("MASTER_ADDR") or None
        if self.master_port is None:
            # Only a real port: 'abc' or 99999 stays None, and the rendezvous check says why
            self.master_port = env_port(self.env)

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1


def env_port(env: Mapping[str, str]) -> int | None:
    """$MASTER_PORT when it is a TCP port torch.distributed can use (1-65535), else None."""
    text = env.get("MASTER_PORT", "").strip()
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        return None
    return int(text)
