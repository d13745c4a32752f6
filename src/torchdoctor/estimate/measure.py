"""Measure the real peak of a CPU training step, with more or less in common with the estimator.

- ``storage_peak``: the estimator's own step code on real tensors, with its own storage tracking
  (it checks fake tensors against real kernels, not the accounting or the loop: a unit check);
- ``allocator_peak``: the estimator's step code under ``torch.profiler`` with
  ``profile_memory=True``, which records every allocation and free of PyTorch's CPU allocator
  (c10's ``reportMemoryUsage``), buffers that kernels allocate inside one op included, which no
  dispatch mode sees (independent accounting, same loop code);
- ``profiled_peak(run)``: the allocator's peak while any code runs: a loop written by hand, a
  real ``transformers.Trainer.train()`` or ``lightning.Trainer.fit()``. It shares nothing with
  the estimator, so it is the truth the accuracy suite measures each loop against.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from torchdoctor.estimate.analysis import cpu_peak
from torchdoctor.estimate.real_sizes import quiet_profiler
from torchdoctor.estimate.setup import Target, TrainingSetup
from torchdoctor.estimate.step import (
    apply_checkpointing,
    apply_loop_settings,
    make_batches,
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
    """Bytes live at the CPU allocator's peak during the estimator's step, plus what existed
    before it."""
    model = workload.build_model()
    if setup.precision == "bf16":
        _cast_floating_state(model, torch.bfloat16)
    if setup.checkpointing:
        apply_checkpointing(model)
    model.train(not setup.inference)
    apply_loop_settings(model, setup)
    batches = make_batches(workload, model, setup)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = None if setup.inference else make_optimizer(params, setup, Target())
    phases = LiveStorageTracker()  # only collects phase marks; not entered as a mode

    def step() -> None:
        run_training(model, batches, workload.loss_fn, optimizer, setup, phases, _nothing, _nothing)

    return profiled_peak(step, [*model.parameters(), *model.buffers(), *_tensors(batches)])


def profiled_peak(run: Callable[[], object], existing: Iterable[torch.Tensor] = ()) -> int:
    """Peak bytes of PyTorch's CPU allocator while ``run()`` runs, plus the storages of
    ``existing`` (tensors alive before it: parameters, buffers, a batch).

    ``torch.profiler`` with ``profile_memory=True`` records every allocation and free that c10's
    CPU allocator reports, kernel scratch included: it shares nothing with the estimator's
    storage tracking, so it is the independent truth for any loop, a framework's included.
    """
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    sizes: dict[int, int] = {}
    for tensor in existing:
        storage = tensor.untyped_storage()
        sizes[storage.data_ptr()] = storage.nbytes()
    with quiet_profiler(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    allocations: list[tuple[int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        item = stack.pop()
        stack.extend(item.children)
        if item.tag == _EventType.Allocation:
            fields = item.extra_fields
            if fields.device.type == "cpu":
                allocations.append((item.start_time_ns, fields.alloc_size))
    allocations.sort(key=lambda item: item[0])
    live = peak = 0
    for _, size in allocations:
        live += size
        peak = max(peak, live)
    return sum(sizes.values()) + peak


def _nothing() -> None:
    return None
