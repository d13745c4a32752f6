"""Peaks and breakdowns from a trace: exact bytes on the CPU, the caching allocator on CUDA."""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field

from torchdoctor.estimate.allocator import CachingAllocatorModel, OutOfMemory
from torchdoctor.estimate.cuda_costs import context_bytes, cublas_workspace_bytes
from torchdoctor.estimate.profiles import GpuProfile
from torchdoctor.estimate.trace import ACTIVATIONS, Trace

WORKSPACES = "workspaces"
KERNEL_SCRATCH = "kernel scratch"
OUTSIDE_MODULES = "(loss and code outside modules)"
_REPEAT = re.compile(r"(?<=[^.])\.\d+(?=\.|$)")  # the first numeric path component


@dataclass
class Peak:
    """The highest point of a replayed timeline and what was live there."""

    allocated: int
    event: int
    by_category: dict[str, int]
    reserved: int = 0
    context: int = 0
    out_of_memory: bool = False
    segments: int = 0
    workspace: int = 0

    @property
    def total(self) -> int:
        """What nvidia-smi would show for the process: reserved plus the CUDA context."""
        return self.reserved + self.context


def cpu_peak(trace: Trace, scratch: bool = True) -> Peak:
    """Peak of live storage bytes as the CPU allocates them, with kernels' scratch memory
    (``scratch=False``: tensor storages only)."""
    live = 0
    peak = -1
    peak_event = 0
    by: dict[str, int] = {}
    snapshot: dict[str, int] = {}
    sizes, categories = trace.sizes, trace.categories
    inserts: dict[int, int] = {}
    if scratch:
        for transient in trace.transients:
            inserts[transient.event] = inserts.get(transient.event, 0) + transient.nbytes
    for index, event in enumerate(trace.events):
        extra = inserts.get(index)
        if extra and live + extra > peak:
            peak, peak_event, snapshot = live + extra, index, dict(by)
            snapshot[KERNEL_SCRATCH] = extra
        if event >= 0:
            size = sizes[event]
            live += size
            category = categories[event]
            by[category] = by.get(category, 0) + size
            if live > peak:
                peak, peak_event, snapshot = live, index, dict(by)
        else:
            size = sizes[~event]
            live -= size
            by[categories[~event]] -= size
    return Peak(max(peak, 0), peak_event, snapshot)


def cuda_peak(
    trace: Trace,
    gpu: GpuProfile,
    capacity: int | None = None,
    allocator: CachingAllocatorModel | None = None,
) -> Peak:
    """Replay the timeline on the caching allocator model; ``capacity`` limits cudaMalloc.

    With ``allocator`` given (one that records its history), allocations carry frames naming
    the op, module and category of each storage.
    """
    labelled = allocator is not None
    if allocator is None:
        allocator = CachingAllocatorModel(capacity=capacity)
    handles: dict[int, int] = {}
    by: dict[str, int] = {}
    snapshot: dict[str, int] = {}
    peak = -1
    peak_event = 0
    sizes, categories, host = trace.sizes, trace.categories, trace.host_tokens
    workspace = cublas_workspace_bytes(gpu) if trace.first_matmul_event is not None else 0
    inserts: dict[int, list[tuple[int, str, bool]]] = {}
    if workspace:
        inserts.setdefault(trace.first_matmul_event or 0, []).append((workspace, WORKSPACES, True))
    for transient in trace.transients:
        inserts.setdefault(transient.event, []).append((transient.nbytes, "temporaries", False))

    def note_peak(index: int) -> None:
        nonlocal peak, peak_event, snapshot
        if allocator.stats.allocated > peak:
            peak, peak_event = allocator.stats.allocated, index
            snapshot = dict(by)

    out_of_memory = False
    try:
        for index, event in enumerate(trace.events):
            for nbytes, category, keep in inserts.get(index, ()):
                handle = allocator.malloc(
                    nbytes, [_frame(category, category)] if labelled else None
                )
                size = allocator.block_size(handle)
                by[category] = by.get(category, 0) + size
                note_peak(index)
                if not keep:
                    allocator.free(handle)
                    by[category] -= size
            if event >= 0:
                if event in host or sizes[event] == 0:
                    continue
                handle = allocator.malloc(
                    sizes[event], storage_frames(trace, event) if labelled else None
                )
                handles[event] = handle
                category = categories[event]
                by[category] = by.get(category, 0) + allocator.block_size(handle)
                note_peak(index)
            else:
                handle = handles.pop(~event, None)
                if handle is None:
                    continue
                by[categories[~event]] -= allocator.block_size(handle)
                allocator.free(handle)
    except OutOfMemory:
        out_of_memory = True
    return Peak(
        allocated=max(peak, 0),
        event=peak_event,
        by_category=snapshot,
        reserved=allocator.stats.peak_reserved,
        context=context_bytes(trace.uses_convolution),
        out_of_memory=out_of_memory,
        segments=allocator.stats.segments,
        workspace=workspace,
    )


def _frame(where: str, what: str) -> dict:
    return {"filename": where, "line": 0, "name": what}


def storage_frames(trace: Trace, token: int) -> list[dict]:
    """Frames for memory_viz: the op that made the storage, its category, and its module."""
    module = trace.alloc_module[token]
    if not trace.alloc_ops[token]:
        return [_frame("(model and batch, before the step)", f"[{trace.categories[token]}]")]
    where = trace.module_names[module] if module > 0 else OUTSIDE_MODULES
    if module > 0 and trace.module_classes[module]:
        where += f" ({trace.module_classes[module]})"
    return [_frame(where, f"aten.{trace.alloc_ops[token]} [{trace.categories[token]}]")]


@dataclass
class PhaseAt:
    phase: str
    step: int


def phase_at(trace: Trace, event: int) -> PhaseAt:
    """The phase (forward, backward, optimizer, zero_grad) running at ``event``."""
    starts = [mark[0] for mark in trace.phase_marks]
    index = bisect.bisect_right(starts, event) - 1
    if index < 0:
        return PhaseAt("before the step", 0)
    _, phase, step = trace.phase_marks[index]
    return PhaseAt(phase, step)


@dataclass
class ModuleShare:
    module: str  # repeated blocks are grouped: "blocks.*.mlp.0"
    type: str
    bytes: int
    count: int = 1


@dataclass
class Activations:
    total: int
    modules: list[ModuleShare] = field(default_factory=list)


def activations_by_module(trace: Trace, top: int = 5) -> Activations:
    """Activation bytes saved by each module (innermost) in the last step's forward pass."""
    forward_starts = [(i, mark) for i, mark in enumerate(trace.phase_marks) if mark[1] == "forward"]
    if not forward_starts:
        return Activations(0)
    last_index, last_mark = forward_starts[-1]
    end = (
        trace.phase_marks[last_index + 1][0]
        if last_index + 1 < len(trace.phase_marks)
        else len(trace.events)
    )
    by_module: dict[int, int] = {}
    for event in trace.events[last_mark[0] : end]:
        if event >= 0 and trace.categories[event] == ACTIVATIONS:
            module = trace.alloc_module[event]
            by_module[module] = by_module.get(module, 0) + trace.sizes[event]
    groups: dict[tuple[str, str], list[int]] = {}
    for module, nbytes in by_module.items():
        name = (
            _REPEAT.sub(".*", trace.module_names[module], count=1)
            if module > 0
            else OUTSIDE_MODULES
        )
        entry = groups.setdefault((name, trace.module_classes[module]), [0, 0])
        entry[0] += nbytes
        entry[1] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]
    shares = [ModuleShare(name, cls, nbytes, count) for (name, cls), (nbytes, count) in ranked]
    return Activations(sum(by_module.values()), shares)
