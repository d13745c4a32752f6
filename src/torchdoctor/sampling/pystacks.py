"""The main thread's Python stack of a running job, sampled from outside, and the steps it shows.

`py-spy <https://github.com/benfred/py-spy>`_ reads the target's memory with
``process_vm_readv``; with ``--nonblocking`` it never stops the target (a sample may then be
torn, and is dropped). Nothing runs inside the job and nothing of it changes.

Each sample of the main thread is put in one phase of a training step by the outermost torch
frame on its stack: ``data`` (a DataLoader iterator's ``__next__``/``_next_data``), ``forward``
(``Module.__call__``), ``backward`` (``Tensor.backward``/``torch.autograd.backward``),
``optimizer`` (``Optimizer.step``) or ``sync`` (``torch.cuda.synchronize``); anything else is
``other``. A training loop goes through the phases in that order (data, forward, backward,
optimizer) and back: a sample whose phase comes *before* the previous one's starts a new step.
That is an estimate: a step is seen when at least two of its phases are sampled, so steps
shorter than a few sampling periods merge (the rate is chosen well above the step rate of the
slow jobs worth attaching to). Time in each phase is its samples times the period.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass, field
from typing import Any

DATA, FORWARD, BACKWARD, OPTIMIZER, SYNC, OTHER = (
    "data",
    "forward",
    "backward",
    "optimizer",
    "sync",
    "other",
)
# A step goes through these in this order; going back to an earlier one starts the next step.
_ORDER = {DATA: 0, FORWARD: 1, BACKWARD: 2, OPTIMIZER: 3}
DEFAULT_RATE_HZ = 200
CHUNK_S = 5.0  # py-spy writes its samples when it ends: one run per chunk keeps steps flowing


@dataclass(slots=True)
class EstimatedStep:
    """One step as the samples show it; times in seconds (``t_*`` wall-clock epoch)."""

    t_start: float
    t_end: float
    data_wait_s: float
    forward_s: float
    backward_s: float
    optimizer_s: float


@dataclass(slots=True)
class ChunkResult:
    """What one sampling run of the main thread showed."""

    t_start: float
    t_end: float
    samples: int
    steps: list[EstimatedStep] = field(default_factory=list)
    phase_s: dict[str, float] = field(default_factory=dict)
    optimizer_seen: bool = False
    loader_kind: str | None = None  # "single-process" / "multiprocessing" iterator, if seen
    pin_memory_thread: bool = False
    dataset_type: str | None = None  # qualname of the class whose __getitem__ ran


def py_spy_path() -> str | None:
    """py-spy beside this Python (the ``attach`` extra installs it), else on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "py-spy")
    if os.access(here, os.X_OK):
        return here
    return shutil.which("py-spy")


def phase_of(frames: list[dict[str, Any]]) -> str:
    """The step phase of one stack (outermost frame first): its outermost torch phase frame."""
    for frame in frames:
        name = frame.get("name") or ""
        path = frame.get("file") or ""
        if "torch" not in path:
            continue
        if "utils/data/dataloader" in path and (
            name.endswith("Iter.__next__") or name.endswith("._next_data")
        ):
            return DATA
        if path.endswith("nn/modules/module.py") and name.endswith("_call_impl"):
            return FORWARD
        if (path.endswith("torch/_tensor.py") and name.endswith(".backward")) or (
            path.endswith("autograd/__init__.py") and name == "backward"
        ):
            return BACKWARD
        if "torch/optim/" in path and (name.endswith(".step") or name.endswith("wrapper")):
            return OPTIMIZER
        if "torch/cuda/" in path and name == "synchronize":
            return SYNC
    return OTHER


def main_profile(data: dict[str, Any], pid: int) -> dict[str, Any] | None:
    """The main thread's profile in py-spy's speedscope output (its thread id is the PID)."""
    profiles = data.get("profiles") or []
    for profile in profiles:
        name = str(profile.get("name", ""))
        if name.startswith(f"Thread {pid} ") or "MainThread" in name:
            return profile
    return None


def analyse(data: dict[str, Any], pid: int, t_end: float) -> ChunkResult:
    """Steps and phase times of a speedscope document py-spy wrote for ``pid``; ``t_end`` is
    when sampling ended (py-spy's times are relative to its start)."""
    frames = data.get("shared", {}).get("frames", [])
    profile = main_profile(data, pid)
    span = float(profile.get("endValue", 0.0)) if profile else 0.0
    result = ChunkResult(t_start=t_end - span, t_end=t_end, samples=0)
    for other in data.get("profiles") or []:
        if other is profile:
            continue
        names = {frames[i].get("name") for stack in other.get("samples", [])[:50] for i in stack}
        if any(n and n.endswith("_pin_memory_loop") for n in names):
            result.pin_memory_thread = True
    if profile is None:
        return result
    stacks = profile.get("samples", [])
    weights = profile.get("weights", [])
    result.samples = len(stacks)
    t = result.t_start
    phase_s = dict.fromkeys((DATA, FORWARD, BACKWARD, OPTIMIZER, SYNC, OTHER), 0.0)
    current: dict[str, float] | None = None  # phase times of the step under way
    start = 0.0
    last_order = None
    for stack, weight in zip(stacks, weights, strict=False):
        stack_frames = [frames[i] for i in stack]
        phase = phase_of(stack_frames)
        phase_s[phase] += weight
        if phase == OPTIMIZER:
            result.optimizer_seen = True
        if phase == DATA:
            _loader_facts(result, stack_frames)
        order = _ORDER.get(phase)
        if order is not None:
            if last_order is not None and order < last_order:
                if current is not None:
                    result.steps.append(_step(start, t, current))
                current = dict.fromkeys(_ORDER, 0.0)
                start = t
            last_order = order
        if current is not None and phase in current:
            current[phase] += weight
        t += weight
    result.phase_s = phase_s
    return result


def _step(start: float, end: float, phases: dict[str, float]) -> EstimatedStep:
    return EstimatedStep(
        t_start=start,
        t_end=end,
        data_wait_s=phases[DATA],
        forward_s=phases[FORWARD],
        backward_s=phases[BACKWARD],
        optimizer_s=phases[OPTIMIZER],
    )


def _loader_facts(result: ChunkResult, frames: list[dict[str, Any]]) -> None:
    for frame in frames:
        name = frame.get("name") or ""
        if name.startswith("_SingleProcessDataLoaderIter."):
            result.loader_kind = "single-process"
        elif name.startswith("_MultiProcessingDataLoaderIter."):
            result.loader_kind = "multiprocessing"
        elif name.endswith(".__getitem__") and result.dataset_type is None:
            result.dataset_type = name.rsplit(".", 1)[0]
