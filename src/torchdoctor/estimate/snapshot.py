"""The traced step as a PyTorch memory snapshot, to explore in https://pytorch.org/memory_viz.

The file has the shape of ``torch.cuda.memory._snapshot()``: ``device_traces`` holds every
allocation and free of the step in order (each labelled with the op that made it, its category
and its module), ``segments`` the allocator's segments at the end. For a CUDA target it is the
replay on the caching allocator model; for the CPU, each storage gets an address of its own.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

from torchdoctor.estimate.allocator import CachingAllocatorModel
from torchdoctor.estimate.analysis import cuda_peak, storage_frames
from torchdoctor.estimate.profiles import GpuProfile
from torchdoctor.estimate.trace import Trace
from torchdoctor.output_files import open_output_file


def memory_snapshot(trace: Trace, gpu: GpuProfile | None) -> dict[str, Any]:
    """The snapshot dictionary of ``trace`` (replayed on ``gpu``'s allocator when given)."""
    history: list[dict] = []
    if gpu is not None:
        allocator = CachingAllocatorModel(history=history)
        cuda_peak(trace, gpu, allocator=allocator)
        segments = allocator.segments()
    else:
        segments = []
        address = 0x10000000
        addresses: dict[int, int] = {}
        for event in trace.events:
            token = event if event >= 0 else ~event
            size = trace.sizes[token]
            if event >= 0:
                addresses[token] = address
                address += max(size, 1)
                action = ["alloc"]
            else:
                action = ["free_requested", "free_completed"]
            frames = storage_frames(trace, token)
            for name in action:
                history.append(
                    {
                        "action": name,
                        "addr": addresses[token],
                        "size": size,
                        "stream": 0,
                        "frames": frames,
                    }
                )
    return {"segments": segments, "device_traces": [history], "allocator_settings": {}}


def write_memory_snapshot(
    trace: Trace, gpu: GpuProfile | None, path: str | Path, *, force: bool = True
) -> Path:
    """Write the snapshot as a pickle, the format memory_viz opens, by the rules of
    :mod:`torchdoctor.output_files` (an existing file replaced only with ``force``; a
    recording, a folder or a device never)."""
    with open_output_file(path, "memory_snapshot", force=force, binary=True) as handle:
        pickle.dump(memory_snapshot(trace, gpu), handle)
    return Path(path)
