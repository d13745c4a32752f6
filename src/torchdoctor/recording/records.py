"""Records produced inside the job, as the recording stores them.

Times are UNIX seconds (``time.time()`` based, so they join with the host series); durations
are seconds; memory is bytes. ``pid`` and ``rank`` tell processes and distributed ranks apart.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class StepRecord:
    """One optimizer step: the step boundary is ``optimizer.step()`` returning."""

    pid: int
    rank: int | None
    step: int  # 0-based index within the process
    t_start: float  # end of the previous step (or the first data request)
    t_end: float
    wall_s: float
    data_wait_s: float  # time blocked in DataLoader ``next()`` within the step
    batch_size: int | None = None
    samples: int | None = None  # samples consumed in the step (sum over micro-batches)
    autocast_dtype: str | None = None  # None: autocast was not active in the step
    grad_scaler: bool | None = None
    cuda_allocated: int | None = None
    cuda_reserved: int | None = None
    cuda_max_allocated: int | None = None  # peak within this step (reset every step)
    cuda_alloc_retries: int | None = None  # cumulative num_alloc_retries
    cuda_ooms: int | None = None  # cumulative num_ooms
    # Ranks of a distributed job (instrument/agent/ranks.py); None where not visible.
    forward_s: float | None = None  # in DistributedDataParallel.forward
    backward_s: float | None = None  # in torch.autograd.backward (DDP's all-reduce wait too)
    optimizer_s: float | None = None  # optimizer.step()
    # DDP's own runtime figures, on the iterations DDP samples (1-10, then every 100th):
    comm_s: float | None = None  # backward all-reduce, first bucket start to last end
    comm_overlap_s: float | None = None  # of which overlapped with backward compute
    backward_compute_s: float | None = None  # backward compute (no waiting)
    # A profiler window touched the step (its warm-up through the step its export stalled):
    # step statistics leave it out. None: not profiled (and every step recorded before).
    profiled: bool | None = None


@dataclass(slots=True)
class DataLoaderRecord:
    """Configuration of one DataLoader as the job built it, and its start-up latency."""

    pid: int
    rank: int | None
    loader_id: int  # stable within the process, in creation order
    t: float
    batch_size: int | None
    num_workers: int
    pin_memory: bool
    persistent_workers: bool
    prefetch_factor: int | None
    drop_last: bool
    multiprocessing_context: str | None
    dataset_type: str
    dataset_len: int | None
    sampler_type: str | None
    first_batch_s: float | None = None  # first next() of the first iterator: worker start-up


@dataclass(slots=True)
class SettingRecord:
    """One setting in force in a process (threads, env, amp, matmul precision...)."""

    pid: int
    rank: int | None
    t: float
    key: str  # e.g. "torch.num_threads", "env.OMP_NUM_THREADS", "optimizer.class"
    value: str  # JSON-encoded


@dataclass(slots=True)
class JobEvent:
    """Something that happened at one instant: an epoch start, a CUDA OOM, instrumentation off."""

    pid: int
    rank: int | None
    t: float
    kind: str  # "epoch-start", "cuda-oom", "instrumentation-disabled", "process-start", ...
    detail: str  # JSON-encoded object


# A profiler window's states: the trace written in full, written shorter than asked (its size
# cap, the process ended), or not written (the reason says why).
PROFILE_STATES = ("done", "cut", "failed")


@dataclass(slots=True)
class ProfileWindow:
    """One torch.profiler window of one process (``torchdoctor run --profile-steps A-B``,
    ``torchdoctor profile``): the steps it recorded and where its trace is."""

    id: int
    rank: int | None
    pid: int
    first_step: int | None  # the first active step (A): ProfilerStep#A in the trace
    last_step: int | None  # the last active step written (B, or earlier when cut)
    warmup_step: int | None  # A - 1: recorded, not in the trace
    started_at: float | None
    ended_at: float | None
    trace_path: str | None  # the gzipped Chrome trace; None when none was written
    trace_bytes: int | None
    state: str  # one of PROFILE_STATES
    reason: str | None  # why cut or failed, one line


@dataclass(slots=True)
class ProfileSyncSite:
    """A source line that called a host-device sync point during a window's active steps."""

    window_id: int
    op: str  # item, cpu, tolist, nonzero, __repr__, __format__, synchronize
    file: str
    line: int
    function: str
    count: int
    total_s: float  # time inside those calls
