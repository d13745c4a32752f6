"""CUDA memory in the steps (allocated, reserved, peak, allocator retries, OOMs) and the out-of-
memory events, from the allocator's observer or, failing that, the uncaught exception."""

from __future__ import annotations


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

    def on_seen(self) -> None:
        """CUDA is initialised: attach the out-of-memory observer (once per process)."""
        self.seen = True
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
        agent = self.agent
        counter = agent.counter
        self.oom_recorded_step = counter.step
        agent.event(
            "cuda-oom",
            {
                "step": counter.step,
                "batch_size": counter.last_batch_size,
                "device": device,
                "requested_bytes": requested,
                "allocated_bytes": allocated,
                "free_bytes": free,
                "source": "allocator",
            },
        )
        agent.flush(final=True)

    def on_uncaught(self, exc_type) -> None:
        """An exception ends the program: an OOM the observer did not see is recorded here."""
        agent = self.agent
        counter = agent.counter
        if exc_type.__name__ != "OutOfMemoryError" or self.oom_recorded_step == counter.step:
            return
        detail = {"step": counter.step, "batch_size": counter.last_batch_size, "source": "uncaught"}
        cuda = self.torch.cuda
        if cuda.is_initialized():
            detail["allocated_bytes"] = cuda.memory_allocated()
            detail["reserved_bytes"] = cuda.memory_reserved()
            detail["max_allocated_bytes"] = cuda.max_memory_allocated()
        agent.event("cuda-oom", detail)
        agent.flush(final=True)
