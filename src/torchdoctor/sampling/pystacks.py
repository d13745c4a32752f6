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
That is an estimate: a step is seen when at least two of its phases are sampled, so a step whose
work between two data waits is shorter than a sampling period can go unseen and merge into the
next one. Each step keeps how many samples its non-data part got: when the steps got under two
such samples on average, many went unseen and the count is a lower bound (:func:`merging_note`);
the data-wait share holds either way. Time in each phase is its samples times the period.
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
    samples: int = 0
    # Samples of the step's work outside the data wait (forward, backward, optimizer and the
    # loop's own code): about 1 a step means that work fits inside a sampling period.
    work_samples: int = 0


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
    n = work = 0  # samples of the step under way, in all and outside its data wait
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
                    result.steps.append(_step(start, t, current, n, work))
                current = dict.fromkeys(_ORDER, 0.0)
                n = work = 0
                start = t
            last_order = order
        if current is not None:
            if phase in current:
                current[phase] += weight
            n += 1
            work += phase != DATA
        t += weight
    result.phase_s = phase_s
    return result


def _step(
    start: float, end: float, phases: dict[str, float], samples: int, work: int
) -> EstimatedStep:
    return EstimatedStep(
        t_start=start,
        t_end=end,
        data_wait_s=phases[DATA],
        forward_s=phases[FORWARD],
        backward_s=phases[BACKWARD],
        optimizer_s=phases[OPTIMIZER],
        samples=samples,
        work_samples=work,
    )


# Steps merge when the work between two data waits is short against the sampling period T: a
# step is seen only when a sample lands in its work. py-spy's samples are not evenly spaced (it
# falls behind on a busy machine), so take them as random, at rate 1/T: a step's work w then gets
# a Poisson number of samples, mean L = w/T; it is missed with probability exp(-L), and the steps
# seen get L / (1 - exp(-L)) samples of work on average. Under 2.0 of them means L < 1.6: over
# a fifth of the steps went unseen (the demo job at 1.5 a step: 0.58 of them seen by this model,
# 0.6 in fact). A loop whose whole step is that short merges the same way, and then most steps
# seen span under four samples. Judged from three steps on: a loop whose work is far under a
# period is seen a few times a minute (5 steps in 20 s of a 27 steps/s loop), and its rate is
# then the most wrong.
MERGING_MIN_STEPS = 3
MERGING_WORK_SAMPLES = 2.0
MERGING_SHORT_SAMPLES = 4


def merging_note(steps: list[EstimatedStep], rate_hz: int) -> str | None:
    """What to say of sampled ``steps`` that merge: their count and rate are lower bounds
    (None when they do not, or when there are too few to tell)."""
    if len(steps) < MERGING_MIN_STEPS:
        return None
    per_step = sum(s.work_samples for s in steps) / len(steps)
    short = sum(s.samples < MERGING_SHORT_SAMPLES for s in steps)
    period = f"{1000.0 / rate_hz:g} ms"
    if per_step < MERGING_WORK_SAMPLES:
        why = f"the work between data waits got {per_step:.2f} samples a step, {period} apart"
    elif short >= len(steps) / 2:
        why = f"{short} of {len(steps)} steps spanned under four samples, {period} apart"
    else:
        return None
    return (
        f"{why}: steps this short go unseen and merge into the next, so the step count and"
        " rate are lower bounds (the data-wait share holds; `torchdoctor run` counts every step)"
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
