"""Evaluation between training steps (a validation pass): its figures while it runs, and the
arithmetic that moves batches between it and the step counters. Plain numbers, no torch.

Batches fetched while autograd is off (``torch.no_grad()``, ``inference_mode()``: Lightning's
loops and the usual hand-written ones), and a loader's whole pass that no optimizer step
interrupted (the Hugging Face Trainer fetches its evaluation batches with autograd on) are
evaluation. Their samples, batches and waits stay out of the steps; the time from the
evaluation's first DataLoader call to the next training data request is taken out of the wall
time of the step it falls in and recorded as an ``evaluation`` event. An evaluation that no
training data request follows before the next optimizer step was that step's own data (a loop
that fetches its batches under ``no_grad``): it is counted into the step (:meth:`settle_into`).

Times are ``perf_counter_ns`` values. The step counters are :class:`.steps.StepCounter`'s
(``batches``, ``samples``, ``data_wait``, ``boundary``, ``last_batch_size``, ...).
"""

from __future__ import annotations


class Evaluation:
    """An evaluation under way: from its first DataLoader call to the end of its last."""

    __slots__ = (
        "start", "detected_by", "last", "batches", "samples", "samples_known", "wait",
        "last_size",
    )  # fmt: skip

    def __init__(self, start: int, detected_by: str) -> None:
        self.start = start
        self.detected_by = detected_by  # "grad-disabled" or "loader-pass"
        self.last = start  # the end of its last DataLoader call
        self.batches = 0
        self.samples = 0
        self.samples_known = True
        self.wait = 0  # ns blocked in DataLoader next()
        self.last_size: int | None = None

    def add_batch(self, n: int | None, wait: int, t_end: int) -> None:
        """One evaluation batch of ``n`` samples (None: unknown), fetched in ``wait`` ns."""
        self.batches += 1
        self.wait += wait
        self.last = t_end
        if n is None:
            self.samples_known = False
        else:
            self.samples += n
            self.last_size = n

    def add_wait(self, wait: int, t_end: int) -> None:
        """A DataLoader call that gave no batch (the end of the evaluation loader's pass)."""
        self.wait += wait
        self.last = t_end

    def time_in_step(self, boundary: int, t_end: int) -> int:
        """The part of it, ending at ``t_end``, after the step boundary ``boundary``."""
        return max(0, t_end - max(self.start, boundary))

    def detail(self, step: int, t_end: int, ended_by: str) -> dict:
        """The ``evaluation`` event of it ending at ``t_end``, before training step ``step``."""
        return {
            "step": step,
            "seconds": max(0, t_end - self.start) / 1e9,
            "batches": self.batches,
            "samples": self.samples if self.samples_known else None,
            "data_wait_s": self.wait / 1e9,
            "detected_by": self.detected_by,
            "ended_by": ended_by,
        }

    def settle_into(self, counter) -> None:
        """No training data came after it before an optimizer step: its batches were that
        step's own (fetched under no_grad, or an extra loader's pass inside the step)."""
        if counter.boundary is None:
            counter.boundary = self.start
        counter.batches += self.batches
        counter.samples += self.samples
        counter.data_wait += self.wait
        if self.last_size is not None:
            counter.last_batch_size = self.last_size
        if self.batches:
            counter.loader_seen = True


# The step counters a pass that trained nothing gives back (PassStart keeps them).
_RESTORED = (
    "samples", "batches", "data_wait", "boundary", "last_batch_size", "loader_batch_size",
)  # fmt: skip


class PassStart:
    """Where a step's figures stood when a training loader's pass began: should the pass end
    before the next optimizer step, it trained nothing and these figures are restored."""

    __slots__ = ("step", "t_iter", *_RESTORED)

    def __init__(self, counter, t_iter: int) -> None:
        # Written out rather than a getattr/setattr loop over _RESTORED: once per pass, with
        # the interpreter's cache cold from the training steps between (~3x the time).
        self.step = counter.step
        self.t_iter = t_iter
        self.samples = counter.samples
        self.batches = counter.batches
        self.data_wait = counter.data_wait
        self.boundary = counter.boundary
        self.last_batch_size = counter.last_batch_size
        self.loader_batch_size = counter.loader_batch_size


def rewind(counter, started: PassStart, t_end: int) -> Evaluation:
    """A loader's whole pass went by without an optimizer step: it trained nothing, so it was
    an evaluation (the Hugging Face Trainer's, fetched with autograd on). Its batches were
    counted into the step: move them out, back to the figures at its start."""
    evaluation = Evaluation(started.t_iter, "loader-pass")
    evaluation.batches = counter.batches - started.batches
    evaluation.samples = counter.samples - started.samples
    evaluation.wait = counter.data_wait - started.data_wait
    evaluation.last_size = counter.last_batch_size
    evaluation.last = t_end
    for name in _RESTORED:
        setattr(counter, name, getattr(started, name))
    return evaluation
