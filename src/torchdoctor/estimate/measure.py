"""Measure the real peak of a CPU training step, two independent ways.

- ``storage_peak``: the step runs on real tensors with the same storage tracking the estimator
  uses (so it checks fake tensors against real kernels, not the accounting itself);
- ``allocator_peak``: the step runs under ``torch.profiler`` with ``profile_memory=True``, which
  records every allocation and free of PyTorch's CPU allocator (c10's ``reportMemoryUsage``),
  including buffers that kernels allocate and free internally, which no dispatch mode sees.

Used by the accuracy benchmark and the tests.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from torchdoctor.estimate.analysis import cpu_peak
from torchdoctor.estimate.real_sizes import quiet_profiler
from torchdoctor.estimate.setup import Target, TrainingSetup
from torchdoctor.estimate.step import (
    apply_checkpointing,
    cast_batch,
    make_optimizer,
    run_training,
)
from torchdoctor.estimate.trace import _cast_floating_state, _tensors, trace_step
from torchdoctor.estimate.tracker import LiveStorageTracker
from torchdoctor.estimate.workload import Workload


@dataclass
class RealPeak:
    storage_peak: int
    allocator_peak: int
    seconds: float


def measure_cpu_peak(workload: Workload, setup: TrainingSetup) -> RealPeak:
    """Peak bytes of a real CPU run of ``setup``'s step, by storages and by the allocator."""
    started = time.perf_counter()
    storage = cpu_peak(trace_step(workload, setup, Target(), real=True), scratch=False).allocated
    allocator = allocator_peak(workload, setup)
    return RealPeak(storage, allocator, time.perf_counter() - started)


def allocator_peak(workload: Workload, setup: TrainingSetup) -> int:
    """Bytes live at the CPU allocator's peak during the step, plus what existed before it."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    model = workload.build_model()
    if setup.precision == "bf16":
        _cast_floating_state(model, torch.bfloat16)
    if setup.checkpointing:
        apply_checkpointing(model)
    model.train(not setup.inference)
    batch = workload.make_batch(model, setup.batch_size)
    if setup.precision == "bf16":
        batch = cast_batch(batch, torch.bfloat16)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = None if setup.inference else make_optimizer(params, setup, Target())
    existing: dict[int, int] = {}
    for tensor in [*model.parameters(), *model.buffers(), *_tensors(batch)]:
        storage = tensor.untyped_storage()
        existing[storage.data_ptr()] = storage.nbytes()
    phases = LiveStorageTracker()  # only collects phase marks; not entered as a mode
    with quiet_profiler(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run_training(model, batch, workload.loss_fn, optimizer, setup, phases, _nothing, _nothing)
    allocations: list[tuple[int, int]] = []

    def walk(node: object) -> None:
        stack = [node]
        while stack:
            item = stack.pop()
            stack.extend(item.children)  # type: ignore[attr-defined]
            if item.tag == _EventType.Allocation:  # type: ignore[attr-defined]
                fields = item.extra_fields  # type: ignore[attr-defined]
                if fields.device.type == "cpu":
                    allocations.append((item.start_time_ns, fields.alloc_size))  # type: ignore[attr-defined]

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    allocations.sort(key=lambda item: item[0])
    live = peak = 0
    for _, size in allocations:
        live += size
        peak = max(peak, live)
    with contextlib.suppress(NameError):
        del model, optimizer, batch
    return sum(existing.values()) + peak


def _nothing() -> None:
    return None
