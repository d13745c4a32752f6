"""Tuning inside a notebook: ``torchdoctor.tune_dataloader(dataset, batch_size=...)``.

The same search and verification as `torchdoctor tune`, but each trial builds a DataLoader in
this process with the candidate settings, takes batches from it (calling your ``step`` on
each, when given) and times them. Nothing of yours is changed: the torch thread count is put
back after every trial, and every trial's workers are shut down before the next one starts.

    >>> import torchdoctor
    >>> result = torchdoctor.tune_dataloader(train_set, batch_size=64, step=train_step,
    ...                                      budget="2m")
    >>> result.dataloader_kwargs        # paste into DataLoader(...)
    {'num_workers': 2, 'prefetch_factor': 4, 'persistent_workers': False, 'pin_memory': False}
    >>> result.gain                     # verified speed-up, or None
    1.8
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

from torchdoctor.errors import UserError, require_torch
from torchdoctor.sampling.hostinfo import whole_cpus_here
from torchdoctor.tune.measure import trial_warmup
from torchdoctor.tune.result import FAILED, INTERRUPTED, OK, REJECTED, Measurement, TuneResult
from torchdoctor.tune.search import Search, SearchLimits
from torchdoctor.tune.space import Config, Space
from torchdoctor.tune.tuner import KEEP_FREE
from torchdoctor.units import parse_duration

MIN_WINDOW_S = 1.0
MAX_WINDOW_S = 10.0
MIN_STEPS = 10
MAX_STEPS = 5000
MEMORY_POLL_S = 0.2


def tune_dataloader(
    dataset: Any,
    batch_size: int | None = 1,
    step: Callable[[Any], Any] | None = None,
    budget: float | str = 120.0,
    *,
    num_workers: int = 0,
    prefetch_factor: int | None = None,
    pin_memory: bool = False,
    persistent_workers: bool = False,
    num_threads: int | None = None,
    trial_steps: int | None = None,
    batch_timeout: float = 60.0,
    keep_free: float = KEEP_FREE,
    on_trial: Callable[[Measurement], None] | None = None,
    **loader_kwargs: Any,
) -> TuneResult:
    """Find the fastest DataLoader settings (and torch threads) for ``dataset`` here.

    ``num_workers``, ``prefetch_factor``, ``pin_memory``, ``persistent_workers`` and
    ``num_threads`` (default: torch's current count) are your current settings: the search
    starts there, and they are kept unless a faster configuration is verified. Other
    DataLoader arguments (``collate_fn``, ``shuffle``, ``sampler``...) go in ``loader_kwargs``
    and are used as given. ``step(batch)`` runs your training step on each batch so that the
    loader is tuned with the model in the loop; without it the loader alone is measured.
    ``budget`` (seconds, or "90s", "2m") is a hard limit. A batch that takes longer than
    ``batch_timeout`` seconds in a worker fails its trial.
    """
    torch = require_torch("tune_dataloader")
    budget_s = parse_duration(budget) if isinstance(budget, str) else float(budget)
    if budget_s <= 0:
        raise UserError(f"budget must be positive, got {budget!r}")
    if trial_steps is not None and trial_steps < 5:
        raise UserError(f"trial_steps={trial_steps} is too few: use 5 or more (default: auto)")
    for reserved in ("num_workers", "prefetch_factor", "pin_memory", "persistent_workers"):
        loader_kwargs.pop(reserved, None)
    original = Config(
        num_workers=num_workers,
        num_threads=num_threads or torch.get_num_threads(),
        prefetch_factor=prefetch_factor,
        persistent_workers=persistent_workers,
        pin_memory=pin_memory,
    ).normalized()
    measurer = _InProcess(
        torch,
        dataset,
        batch_size,
        step,
        loader_kwargs,
        trial_steps,
        window_s=min(MAX_WINDOW_S, max(MIN_WINDOW_S, budget_s / 40)),
        batch_timeout=batch_timeout,
        keep_free=keep_free,
        on_trial=on_trial,
    )
    started = time.monotonic()
    deadline = started + budget_s
    first = measurer(original, "original", deadline)
    if first.status == FAILED and measurer.original_error is not None:
        raise measurer.original_error
    space = Space.for_machine(
        whole_cpus_here(),
        tune_pin_memory=bool(torch.cuda.is_available()),
        tune_persistent=measurer.epochs_per_trial > 1,
        include=original,
    )
    search = Search(space, measurer, original, limits=SearchLimits(deadline=deadline), first=first)
    result = search.run()
    result.elapsed_s = time.monotonic() - started
    result.budget_s = budget_s
    if result.stopped == "budget":
        result.notes.append("The budget ended the search before it converged.")
    if result.candidate not in (None, original) and not (
        result.verification and result.verification.confirmed
    ):
        why = result.verification.reason if result.verification else "no verification ran"
        result.notes.append(f"Keeping your settings: the search's pick was not verified ({why}).")
    return result


class _InProcess:
    """The search's ``measure``: one DataLoader per trial, timed batch by batch."""

    def __init__(
        self,
        torch,
        dataset,
        batch_size,
        step,
        loader_kwargs,
        trial_steps,
        *,
        window_s: float,
        batch_timeout: float,
        keep_free: float,
        on_trial,
    ) -> None:
        self.torch = torch
        self.dataset = dataset
        self.batch_size = batch_size
        self.step = step
        self.loader_kwargs = loader_kwargs
        self.measured_steps = trial_steps
        self.window_s = window_s
        self.batch_timeout = batch_timeout
        self.keep_free = keep_free
        self.on_trial = on_trial
        self.index = 0
        self.interrupted = False
        self.original_error: BaseException | None = None
        self.epochs_per_trial = 1

    def __call__(self, config: Config, purpose: str, deadline: float | None) -> Measurement:
        m = Measurement(self.index, config, purpose, FAILED)
        self.index += 1
        if self.interrupted:
            m.status, m.reason = INTERRUPTED, "interrupted"
        else:
            started = time.monotonic()
            try:
                self._run(m, config, deadline)
            except KeyboardInterrupt:
                self.interrupted = True
                m.status, m.reason = INTERRUPTED, "interrupted"
            except Exception as exc:  # noqa: BLE001 - a failing trial is a result, not a crash
                m.status, m.reason = FAILED, f"{type(exc).__name__}: {exc}"
                if purpose == "original" and self.index == 1:
                    self.original_error = exc
            m.duration_s = time.monotonic() - started
        if self.on_trial is not None:
            self.on_trial(m)
        return m

    def _loader(self, config: Config):
        kwargs = dict(self.loader_kwargs)
        kwargs.update(config.dataloader_kwargs())
        if config.num_workers > 0:
            kwargs["timeout"] = self.batch_timeout
        with warnings.catch_warnings():
            # More workers than torch's rule of thumb is a question tune answers by measuring.
            warnings.filterwarnings("ignore", message="This DataLoader will create")
            return self.torch.utils.data.DataLoader(
                self.dataset, batch_size=self.batch_size, **kwargs
            )

    def _run(self, m: Measurement, config: Config, deadline: float | None) -> None:
        torch = self.torch
        warmup = trial_warmup(config)
        target = self.measured_steps or MAX_STEPS
        threads = torch.get_num_threads()
        guard = _MemoryGuard(self.keep_free)
        loader = self._loader(config)
        iterator = None
        ends: list[float] = []
        waits: list[float] = []
        samples = 0
        epochs = 1
        perf = time.perf_counter
        try:
            torch.set_num_threads(config.num_threads)
            guard.start()
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="This DataLoader will create")
                iterator = iter(loader)
            while len(ends) < warmup + target:
                t0 = perf()
                try:
                    batch = next(iterator)
                except StopIteration:
                    epochs += 1
                    iterator = iter(loader)
                    batch = next(iterator)
                t1 = perf()
                if self.step is not None:
                    self.step(batch)
                t_end = perf()
                waits.append(t1 - t0)
                ends.append(t_end)
                if len(ends) > warmup:
                    samples += _batch_len(batch, torch) or 0
                now = time.monotonic()
                if guard.violation:
                    m.status, m.reason = REJECTED, guard.violation
                    return
                if deadline is not None and now >= deadline:
                    m.status, m.reason = INTERRUPTED, "budget reached"
                    return
                measured = len(ends) - warmup
                if (
                    self.measured_steps is None
                    and measured >= MIN_STEPS
                    and t_end - ends[warmup - 1] >= self.window_s
                ):
                    break
        finally:
            guard.stop()
            torch.set_num_threads(threads)
            if iterator is not None and hasattr(iterator, "_shutdown_workers"):
                with contextlib.suppress(Exception):
                    iterator._shutdown_workers()
        epoch_len = _len(loader)
        del iterator, loader
        measured = len(ends) - warmup
        if measured < 5:
            m.reason = f"too few batches to measure: {len(ends)}, {warmup} of them warm-up"
            return
        span = ends[-1] - ends[warmup - 1]
        m.status = OK
        m.steps = measured
        m.warmup_steps = warmup
        m.throughput = measured / span
        m.samples_per_s = samples / span if samples else None
        walls = [b - a for a, b in zip(ends[warmup - 1 : -1], ends[warmup:], strict=True)]
        m.data_wait_share = sum(waits[warmup:]) / sum(walls) if sum(walls) > 0 else None
        m.spread = _block_spread(ends[warmup - 1 :])
        m.peak_memory = guard.peak_used
        if self.measured_steps is None:
            self.measured_steps = max(MIN_STEPS, measured)
        # persistent_workers only matters when a trial crosses an epoch's end.
        if epochs > 1 or (epoch_len and epoch_len < warmup + self.measured_steps):
            self.epochs_per_trial = max(self.epochs_per_trial, epochs, 2)


def _len(loader) -> int | None:
    try:
        return len(loader)
    except TypeError:  # an IterableDataset without __len__
        return None


def _batch_len(batch, torch) -> int | None:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else None
    if isinstance(batch, (list, tuple)) and batch:
        return _batch_len(batch[0], torch)
    if isinstance(batch, dict) and batch:
        return _batch_len(next(iter(batch.values())), torch)
    return None


def _block_spread(ends: list[float], blocks: int = 4) -> float | None:
    """Relative standard error of the rate from consecutive blocks of step end times."""
    import math
    import statistics

    size = (len(ends) - 1) // blocks
    if size < 2:
        return None
    rates = [size / (ends[(b + 1) * size] - ends[b * size]) for b in range(blocks)]
    return statistics.stdev(rates) / statistics.fmean(rates) / math.sqrt(blocks)


class _MemoryGuard:
    """Watches the host while a trial runs: the RAM available must stay above ``keep_free``
    of what it was at the start, and nothing may be swapped out."""

    def __init__(self, keep_free: float) -> None:
        import psutil

        from torchdoctor.sampling.hostinfo import available_ram, read_host_info

        self._psutil = psutil
        self._host = read_host_info()  # its cgroup memory limit, read once
        self._available_ram = available_ram
        self.start_available = available_ram(self._host)
        self.floor = self.start_available * keep_free
        self.start_swapped = psutil.swap_memory().sout
        self.violation: str | None = None
        self.peak_used = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="torchdoctor-tune-memory")
        self._thread.daemon = True

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        self._check()

    def _loop(self) -> None:
        while not self._stop.wait(MEMORY_POLL_S):
            self._check()

    def _check(self) -> None:
        available = self._available_ram(self._host)
        self.peak_used = max(self.peak_used, self.start_available - available)
        if self.violation is not None:
            return
        if available < self.floor:
            self.violation = (
                f"RAM available fell to {available / 2**30:.2f} GiB, under the "
                f"{self.floor / 2**30:.2f} GiB to keep free"
            )
        elif self._psutil.swap_memory().sout > self.start_swapped:
            self.violation = "the host swapped memory out"
