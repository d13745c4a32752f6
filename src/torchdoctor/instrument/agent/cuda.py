"""CUDA memory in the steps (allocated, reserved, peak, allocator retries, OOMs) and the out-of-
memory events, from the allocator's observer or, failing that, the uncaught exception.

An OOM event records the moment: the step, the phase (forward, backward, optimizer step, read
from the Python stack), the requested size, the allocator's statistics (allocated, reserved,
active, inactive split, the largest free block) and, with TORCHDOCTOR_MEMORY_HISTORY=PATH
(``torchdoctor run --memory-history``), a memory snapshot pickled to PATH with protocol 4, the
one the memory_viz viewer reads (``{pid}`` in PATH is the process, ``{what}`` is ``oom`` or,
for the snapshot at the end, ``memory``). The OOM itself is never caught: the job fails as it would.
With the history on and no OOM snapshot written, the process writes one more when it ends
(``<recording>.cuda-memory-<pid>.pickle``, a ``cuda-memory-snapshot`` event): what was live at
the job's peak, for ``diagnose``. The history starts when CUDA initialises (torch's lazy-init
queue), so the model's parameters are in it.
"""

from __future__ import annotations

import os
import re
import sys

ENV_MEMORY_HISTORY = "TORCHDOCTOR_MEMORY_HISTORY"
HISTORY_ENTRIES = 100_000  # the allocator's ring of alloc/free events (several KB each)
SNAPSHOT_EVENT = "cuda-memory-snapshot"  # the snapshot written at the end of the process
# What a snapshot is, for the path's {what}: run names them <recording>.cuda-{what}-<pid>.pickle.
OOM_SNAPSHOT, EXIT_SNAPSHOT = "oom", "memory"
# Statistics kept at an OOM: torch.cuda.memory_stats keys -> the event's names.
OOM_STATS = {
    "allocated_bytes.all.current": "allocated_bytes",
    "reserved_bytes.all.current": "reserved_bytes",
    "active_bytes.all.current": "active_bytes",
    "inactive_split_bytes.all.current": "inactive_split_bytes",
    "allocated_bytes.all.peak": "max_allocated_bytes",
    "reserved_bytes.large_pool.current": "reserved_large_bytes",
    "num_alloc_retries": "alloc_retries",
    "num_ooms": "ooms",
}
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_SIZE = r"([0-9.]+) (B|KiB|MiB|GiB|TiB)"
# The parts of torch.OutOfMemoryError's message (c10's CUDACachingAllocator wording).
_MESSAGE = {
    "requested_bytes": re.compile(r"Tried to allocate " + _SIZE),
    "total_bytes": re.compile(r"total capacity of " + _SIZE),
    "free_bytes": re.compile(r"of which " + _SIZE + " is free"),
    "process_bytes": re.compile(r"this process has " + _SIZE + " memory in use"),
    "allocated_bytes": re.compile(_SIZE + " is allocated by PyTorch"),
    "reserved_unallocated_bytes": re.compile(_SIZE + " is reserved by PyTorch but unallocated"),
}


def parse_oom_message(text: str) -> dict:
    """The sizes torch.OutOfMemoryError's message gives, in bytes (those present)."""
    out = {}
    for key, pattern in _MESSAGE.items():
        m = pattern.search(text)
        if m is not None:
            out[key] = int(float(m.group(1)) * _UNITS[m.group(2)])
    return out


def phase_of(frames) -> str:
    """Where in the step the code that ran out was: innermost torch frame decides."""
    for filename in frames:
        name = filename.replace("\\", "/")
        if "/torch/optim/" in name:
            return "optimizer"
        if "/torch/autograd/" in name or "/torch/_tensor.py" in name:
            return "backward"
    return "forward"


def _stack_files():
    frame = sys._getframe(1)
    files = []
    while frame is not None:
        files.append(frame.f_code.co_filename)
        frame = frame.f_back
    return files


def _traceback_files(tb):
    files = []
    while tb is not None:
        files.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    return list(reversed(files))  # innermost first, as a stack walk


class CudaMemory:
    """What the agent reads of the CUDA caching allocator; nothing until CUDA is initialised."""

    def __init__(self, agent, torch) -> None:
        self.agent = agent
        self.torch = torch
        self.oom_observer = None  # the observer to attach (hooks.install builds it, guarded)
        self.reset()

    def reset(self) -> None:
        self.seen = False
        self.stats_ok = True
        self.observer_attached = False
        self.oom_recorded_step: int | None = None
        self.history_path: str | None = None
        self.history_started = False
        self.snapshot_written = False  # an OOM's: the end of the process writes none then

    def watch_init(self) -> None:
        """With the history asked for, start it inside CUDA's lazy init (before the first
        allocation: the model's parameters are recorded); on_seen starts it otherwise."""
        lazy_call = getattr(self.torch.cuda, "_lazy_call", None)
        if lazy_call is not None and os.environ.get(ENV_MEMORY_HISTORY):
            lazy_call(self._start_history_at_init)

    def _start_history_at_init(self) -> None:
        # Runs inside torch.cuda's lazy init, where an exception would fail the user's call.
        try:
            self._start_history()
        except Exception:  # noqa: BLE001 - on_seen tries again and says why
            self.history_started = False

    def _start_history(self) -> None:
        if self.history_started:
            return
        self.history_started = True
        wanted = os.environ.get(ENV_MEMORY_HISTORY) or None
        # One file per process: each rank of a job records its own device.
        self.history_path = wanted.replace("{pid}", str(os.getpid())) if wanted else None
        if self.history_path:
            try:
                self.torch.cuda.memory._record_memory_history(
                    max_entries=HISTORY_ENTRIES, stacks="python"
                )
            except Exception as exc:
                self.history_path = None
                self.agent.event("memory-history-unavailable", {"error": f"{exc}"[:300]})

    def on_seen(self) -> None:
        """CUDA is initialised: attach the out-of-memory observer (once per process)."""
        self.seen = True
        self._start_history()
        attach = getattr(self.torch._C, "_cuda_attach_out_of_memory_observer", None)
        if attach is not None and not self.observer_attached and self.oom_observer is not None:
            self.observer_attached = True
            try:
                attach(self.oom_observer)
            except Exception as exc:
                # Some allocator back-ends (cudaMallocAsync, pluggable) have no observers:
                # an uncaught OOM is still recorded by the excepthook.
                self.agent.event("cuda-oom-observer-unavailable", {"error": f"{exc}"[:300]})

    def step_stats(self):
        """The CUDA values of a step row (peak reset for the next), or None when unreadable."""
        if not self.seen:
            self.on_seen()
        if not self.stats_ok:
            return None
        try:
            cuda = self.torch.cuda
            device = cuda.current_device()
            stats = cuda.memory_stats(device)
            cuda.reset_peak_memory_stats(device)
            return (
                stats.get("allocated_bytes.all.current"),
                stats.get("reserved_bytes.all.current"),
                stats.get("allocated_bytes.all.peak"),
                stats.get("num_alloc_retries"),
                stats.get("num_ooms"),
            )
        except Exception as exc:
            # Memory figures are a bonus: lose them, keep the steps.
            self.stats_ok = False
            self.agent.event("cuda-stats-unavailable", {"error": f"{type(exc).__name__}: {exc}"})
            return None

    def on_oom(self, device, requested, allocated, free) -> None:
        """What the CUDA caching allocator calls when an allocation fails, before it raises."""
        counter = self.agent.counter
        if self.oom_recorded_step == counter.step:
            return  # cuDNN retries with less workspace: one event per failing step
        self.oom_recorded_step = counter.step
        detail = {
            "device": device,
            "requested_bytes": requested,
            "device_limit_bytes": allocated,  # the device's total, or the fraction cap
            "free_bytes": free,
            "source": "allocator",
            # Backward runs its CUDA work on autograd's own threads, which have no Python
            # stack: the step counter knows it is inside backward().
            "phase": "backward" if counter.backward_depth else phase_of(_stack_files()),
        }
        self._record(detail, device)

    def on_uncaught(self, exc_type, exc=None, tb=None) -> None:
        """An exception ends the program: an OOM the observer did not see is recorded here."""
        counter = self.agent.counter
        if exc_type.__name__ != "OutOfMemoryError" or self.oom_recorded_step == counter.step:
            return
        self.oom_recorded_step = counter.step
        phase = "backward" if counter.backward_depth else phase_of(_traceback_files(tb))
        detail = {"source": "uncaught", "phase": phase}
        detail.update(parse_oom_message(str(exc) if exc is not None else ""))
        self._record(detail, None)

    def _record(self, detail: dict, device) -> None:
        agent = self.agent
        counter = agent.counter
        detail["step"] = counter.step
        detail["batch_size"] = counter.last_batch_size
        detail.update(self._allocator_state(device))
        if self.history_path:
            detail["snapshot"] = self._dump_snapshot(
                self.history_path.replace("{what}", OOM_SNAPSHOT)
            )
            self.snapshot_written = detail["snapshot"] is not None
        agent.event("cuda-oom", detail)
        agent.flush(final=True)

    def _allocator_state(self, device) -> dict:
        """allocated / reserved / active / inactive split, and the largest free cached block."""
        cuda = self.torch.cuda
        out = {}
        try:
            if not cuda.is_initialized():
                return out
            stats = cuda.memory_stats(device)
            for key, name in OOM_STATS.items():
                if key in stats:
                    out[name] = stats[key]
            largest = 0
            try:
                segments = cuda.memory.memory_snapshot(include_traces=False)
            except TypeError:  # torch before 2.6 has no include_traces
                segments = cuda.memory.memory_snapshot()
            for segment in segments:
                if device is not None and segment.get("device") not in (None, device):
                    continue
                for block in segment.get("blocks", ()):
                    if block.get("state") == "inactive":
                        largest = max(largest, block.get("size", 0))
            out["largest_free_block_bytes"] = largest
        except Exception as exc:
            out["stats_error"] = f"{type(exc).__name__}: {exc}"[:300]
        return out

    def on_exit(self) -> None:
        """The process ends: write what the history holds, unless an OOM's snapshot was."""
        if not self.history_path or self.snapshot_written or not self.seen:
            return
        path = self.history_path
        if "{what}" in path:
            path = path.replace("{what}", EXIT_SNAPSHOT)
        else:  # a PATH set by hand names the OOM's file: the end's goes beside it
            root, ext = os.path.splitext(path)
            path = f"{root}.exit{ext}"
        if self._dump_snapshot(path) is not None:
            self.snapshot_written = True
            self.agent.event(SNAPSHOT_EVENT, {"snapshot": path, "reason": "exit"})

    def _dump_snapshot(self, path: str) -> str | None:
        import pickle

        try:
            snapshot = self.torch.cuda.memory._snapshot()
            with open(path, "wb") as f:
                pickle.dump(snapshot, f, protocol=4)  # 5 (3.14's default) breaks memory_viz
            return path
        except Exception as exc:
            # Said once: no later OOM or the end of the process tries again.
            self.history_path = None
            self.agent.event("memory-snapshot-failed", {"error": f"{exc}"[:300]})
            return None
