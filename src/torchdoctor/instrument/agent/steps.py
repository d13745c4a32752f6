"""Step accounting: where steps begin and end, the data wait, samples and batches of each, the
AMP flags, and the evaluations between them (:mod:`.evaluation`). Loaded once torch is.

The step boundary is torch's global optimizer step post-hook. Steps without an optimizer:
until the first ``torch.optim`` step is seen, each top-level ``backward()`` ends a candidate
step, held back (the counters keep running). An optimizer step discards them: the loop steps
its optimizer, after one or several backward passes (gradient accumulation), and optimizer
steps are the boundary from then on. After ``BACKWARD_STEPS_TO_DECIDE`` backward passes
without one (or at exit), the held steps are recorded and each backward pass ends a step. The
``steps.boundary`` setting says which.
"""

from __future__ import annotations

from _thread import get_ident
from _weakref import ref as weakref_ref
from collections.abc import Mapping

from . import settings
from .compiled import CounterFields, read_grad_mode_natively
from .contract import (
    AGENT_STEP_VALUES,
    BACKWARD_STEPS_TO_DECIDE,
    FLUSH_INTERVAL_NS,
    PROFILED_VALUE,
    WORKER,
    now,
    perf_ns,
)
from .evaluation import Evaluation, PassStart, rewind


class StepCounter(CounterFields):
    """The figures of the step under way in this process, and the rows of the steps ended.

    Its hot fields are :data:`.compiled.COUNTER_FIELDS` (the base class: slots, or the
    compiled path's struct); :meth:`on_batch` and :meth:`on_step` are the reference for what
    the compiled path does in the common case and do all the rest."""

    def __init__(self, agent, torch) -> None:
        self.agent = agent
        self.tensor_type = torch.Tensor
        self.batch_len = batch_len
        self.grad_enabled = torch.is_grad_enabled
        read_grad_mode_natively(self, torch)  # the compiled path's batches, where it can
        self.cuda_is_initialized = torch.cuda.is_initialized
        # torch.cuda.is_initialized() is `_initialized and not _is_in_bad_fork()`: reading the
        # flag first spares every full step of a CPU job a Python call (None: call it).
        flag = getattr(torch.cuda, "_initialized", None)
        self.cuda_module = torch.cuda if isinstance(flag, bool) else None
        # The short path never asks whether CUDA has started: torch tells (watch_cuda_start).
        self.cuda_started = False
        self.cuda_watched = False
        self.loaders = None  # loaders.Loaders, set by hooks.install
        self.backward_patch = None  # hooks.BackwardPatch, set by hooks.install
        self.reset()

    def reset(self) -> None:
        self.discard_rows()
        self.step = 0
        self.boundary: int | None = None  # perf_counter_ns of the last step boundary
        self.start_ns = perf_ns()
        self.data_wait = 0  # ns blocked in DataLoader next() since the boundary
        self.samples = 0
        self.batches = 0  # DataLoader batches since the last step boundary
        self.last_batch_size: int | None = None
        self.loader_batch_size: int | None = None
        self.autocast_dtype: str | None = None
        self.scaler_used = False
        self.step_thread: int | None = None  # thread id of the first optimizer step
        self.last_optimizer = None  # weakref to the optimizer that ended the last step
        self.loader_seen = False
        self.first_batches_due = 0  # iterators whose first batch is still to come (loaders.py)
        self.optimizers = settings.Optimizers()  # every optimizer stepped, recorded once
        # The evaluation under way, and evaluation time already taken out of the step.
        self.evaluation: Evaluation | None = None
        self.eval_ns = 0
        self.prev_step_fed: bool | None = None  # did the last step take DataLoader batches
        # What ends a step: None until known, then "optimizer" or "backward". Candidate steps
        # ended by backward passes while it is unknown, and the counters at the last of them.
        self.boundary_kind: str | None = None
        self.backward_depth = 0
        self.held_steps: list[list] = []
        self.held_mark: tuple[int, int, int, int, int] | None = None
        self.fast = False  # on_step's short path applies (set after each full step)
        if self.backward_patch is not None:
            # A forked child counts afresh: its steps may end at backward passes.
            self.backward_patch.restore()

    def watch_cuda_start(self, torch) -> None:
        """Have torch call :meth:`on_cuda_start` when CUDA initialises (at once if it has):
        the short step path needs CUDA off and no longer reads torch's flag every step."""
        lazy_call = getattr(torch.cuda, "_lazy_call", None)
        if self.cuda_watched or lazy_call is None or self.cuda_module is None:
            return  # no way to be told: every step takes the full path
        self.cuda_watched = True
        lazy_call(self.on_cuda_start)

    def on_cuda_start(self) -> None:
        # Runs inside torch.cuda's lazy init: two stores, nothing that can raise.
        self.cuda_started = True
        self.fast = False

    def on_step_thread(self) -> bool:
        """Only the thread that steps the optimizer waits for data in the step's time (a loader
        drained by a background prefetch thread hides its waits from the step), and only its
        autograd mode tells evaluation from training (the mode is per thread)."""
        return self.step_thread is None or get_ident() == self.step_thread

    # -- DataLoader batches -------------------------------------------------------------------

    def on_batch(self, it, batch, t0: int, dt: int) -> None:
        # on_step_thread(), written out: this runs on every batch.
        if self.step_thread is None or get_ident() == self.step_thread:
            grad_enabled = self.grad_enabled  # a plain read: calling it as a method is not
            if not grad_enabled():  # specialised by CPython 3.11 (an instance attribute)
                self._on_evaluation_batch(it, batch, t0, dt)
                return
            if self.evaluation is not None:
                self.end_evaluation(t0, "training-data")
            self.data_wait += dt
        self.batches += 1
        self.loader_seen = True
        if self.boundary is None:
            self.boundary = t0
        # batch_len's commonest cases first, without its call: (inputs, targets) and a tensor.
        kind = type(batch)
        if (kind is tuple or kind is list) and batch and type(batch[0]) is self.tensor_type:
            shape = batch[0].shape
            n = shape[0] if shape else None
        elif kind is self.tensor_type:
            shape = batch.shape
            n = shape[0] if shape else None
        else:
            n = batch_len(batch, self.tensor_type)
        if n is None:
            n = self.loader_batch_size
        if n is not None:
            self.samples += n
            self.last_batch_size = n
        if self.first_batches_due:
            self.loaders.first_batch(it, t0 + dt)

    def on_exhausted(self, it, t0: int, dt: int) -> None:
        """``next()`` raised (StopIteration at the end of a pass, or the loader's own error)."""
        if self.step_thread is not None and get_ident() != self.step_thread:
            return
        if not self.grad_enabled():
            if self.evaluation is None:
                self.evaluation = Evaluation(t0, "grad-disabled")
            self.evaluation.add_wait(dt, t0 + dt)
            return
        if self.evaluation is not None:
            # Training code ran out of data (accelerate finds the end of the training loader
            # one batch ahead, so this may be all a step asks of it after an evaluation).
            self.end_evaluation(t0, "training-data")
        self.data_wait += dt
        started = self.loaders.pass_of.pop(it)
        if started is not None and started.step == self.step and self.batches > started.batches:
            self.evaluation = rewind(self, started, t0 + dt)

    def on_pass_start(self, it, t_iter: int, batch_size: int | None, evaluating: bool) -> None:
        """A loader's pass began (``iter(loader)``) on the stepping thread."""
        if evaluating:
            if self.evaluation is None:
                self.evaluation = Evaluation(t_iter, "grad-disabled")
            self.loaders.batch_size_of.set(it, batch_size)
            return
        if self.evaluation is not None:
            self.end_evaluation(t_iter, "training-data")
        self.loader_batch_size = batch_size
        self.loaders.pass_of.set(it, PassStart(self, t_iter))  # see on_exhausted

    def _on_evaluation_batch(self, it, batch, t0: int, dt: int) -> None:
        if self.evaluation is None:
            self.evaluation = Evaluation(t0, "grad-disabled")
        n = batch_len(batch, self.tensor_type)
        if n is None:
            n = self.loaders.batch_size_of.get(it)
        self.evaluation.add_batch(n, dt, t0 + dt)
        if self.first_batches_due:
            self.loaders.first_batch(it, t0 + dt)

    def end_evaluation(self, t_end: int, ended_by: str) -> None:
        """Record the evaluation under way as ending at ``t_end`` (perf_counter_ns); the part
        of it after the last step boundary leaves the wall time of the step under way."""
        evaluation, self.evaluation = self.evaluation, None
        if self.boundary is not None and ended_by != "process-end":
            self.eval_ns += evaluation.time_in_step(self.boundary, t_end)
        ago_s = (perf_ns() - evaluation.start) / 1e9
        detail = evaluation.detail(self.step, t_end, ended_by)  # the step it came before
        self.agent.event("evaluation", detail, t=now() - ago_s)

    def _settle_evaluation_at_step(self) -> None:
        """An evaluation is still open at an optimizer step: no training data came after it."""
        if self.prev_step_fed is False:
            # The job trains without a DataLoader and evaluates with one: the evaluation ended
            # somewhere before this step; its last batch is the last thing seen of it.
            self.end_evaluation(self.evaluation.last, "last-evaluation-batch")
            return
        evaluation, self.evaluation = self.evaluation, None
        evaluation.settle_into(self)

    # -- step boundaries ----------------------------------------------------------------------

    def on_step(self, optimizer) -> None:
        t = perf_ns()
        # The common step: nothing to settle, the same optimizer, CPU only, no rank figures,
        # no stop rule (``fast`` says the rest held at the previous step, see _refresh_fast;
        # CUDA's start clears it). It appends the step's values and zeroes the counters; the
        # message is built at flush time (contract.pack_steps).
        last_optimizer = self.last_optimizer  # read, then called: see on_batch
        if self.fast and self.evaluation is None and last_optimizer() is optimizer:
            agent = self.agent
            steps = agent.steps
            step = self.step
            steps.append(
                (
                    step,
                    t,
                    t - self.boundary - self.eval_ns,
                    self.data_wait,
                    self.last_batch_size,
                    self.samples or None,
                    self.autocast_dtype,
                    self.scaler_used,
                )
            )
            self.step = step + 1
            self.boundary = t
            self.prev_step_fed = self.batches > 0
            self.data_wait = self.samples = self.batches = self.eval_ns = 0
            if self.autocast_dtype is not None or self.scaler_used:
                self.autocast_dtype = None
                self.scaler_used = False
            if len(steps) >= agent.flush_max_steps or t - agent.last_flush >= FLUSH_INTERVAL_NS:
                agent.after_step(t)
            return
        self._on_step(optimizer, t)

    def _refresh_fast(self) -> None:
        """Whether the next step may take on_step's short path: what it skips cannot apply."""
        agent = self.agent
        self.fast = bool(
            self.boundary_kind == "optimizer"
            and self.boundary is not None
            and self.last_optimizer is not None
            and agent.role != WORKER
            and agent.settings_done
            and not agent.threads_override_pending
            and agent.stop_after is None
            and agent.distributed is None
            and (agent.profile is None or agent.profile.state == "pending")
            and self.cuda_watched
            and not self.cuda_started
            and not agent.cuda.seen
        )

    def _on_step(self, optimizer, t: int) -> None:
        agent = self.agent
        if agent.role == WORKER:
            return
        if self.evaluation is not None:
            self._settle_evaluation_at_step()
        last = self.last_optimizer() if self.last_optimizer is not None else None
        if last is not optimizer:
            if agent.settings_done:
                # Another optimizer than the last (GAN, multi-task): recorded beside the first.
                self.optimizers.add(agent, optimizer)
            if last is not None and self.loader_seen and not self.batches:
                return  # another optimizer (GAN, multi-task) on the same batch: the same step
            self.last_optimizer = weakref_ref(optimizer)
        if self.boundary_kind != "optimizer":
            # Backward passes before it were parts of this step (gradient accumulation).
            self.held_steps = []
            self.held_mark = None
            if self.boundary_kind is None:
                self.boundary_kind = "optimizer"
                agent.setting("steps.boundary", "optimizer")
            self.backward_patch.drop()
        if agent.threads_override_pending:
            settings.apply_threads_override(agent)
        if not agent.settings_done:
            agent.settings_done = True
            self.step_thread = get_ident()
            settings.capture_settings(agent, optimizer)
        self._close_step(t)
        self._refresh_fast()

    def on_backward(self) -> None:
        """A top-level backward pass ended: a step boundary unless an optimizer ends steps."""
        if self.boundary_kind == "optimizer" or self.agent.role == WORKER:
            return
        if self.step_thread is not None and get_ident() != self.step_thread:
            return
        t = perf_ns()
        if self.evaluation is not None:
            self._settle_evaluation_at_step()
        if self.boundary_kind == "backward":
            self._close_step(t)
            return
        # Not known yet: hold a candidate step, the figures since the last candidate.
        mark = self.held_mark
        if mark is None:
            start = self.boundary if self.boundary is not None else self.start_ns
            mark = (start, 0, 0, 0, 0)
        t0, wait0, samples0, _, eval0 = mark
        row = self._step_row(t, t0)
        row[2] = t - t0 - (self.eval_ns - eval0)
        row[3] = self.data_wait - wait0
        row[5] = (self.samples - samples0) or None
        self.held_steps.append(row)
        # The AMP flags stay: an optimizer step that discards the candidates reads them.
        self.held_mark = (t, self.data_wait, self.samples, self.batches, self.eval_ns)
        if len(self.held_steps) >= BACKWARD_STEPS_TO_DECIDE:
            self.steps_end_at_backward()

    def steps_end_at_backward(self, at_exit: bool = False) -> None:
        """No optimizer steps the loop: record the held candidates as its steps."""
        agent = self.agent
        self.boundary_kind = "backward"
        agent.setting("steps.boundary", "backward")
        if not agent.settings_done:
            agent.settings_done = True
            self.step_thread = get_ident()
            settings.capture_settings(agent, None)
        held, self.held_steps = self.held_steps, []
        self.drain_rows(agent.steps)  # rows of the compiled short path come first
        for row in held:
            row[0] = self.step
            agent.steps.append(row)
            self.step += 1
        mark, self.held_mark = self.held_mark, None
        if mark is not None:
            # What came after the last backward pass belongs to the next step.
            self.boundary = mark[0]
            self.data_wait -= mark[1]
            self.samples -= mark[2]
            self.prev_step_fed = self.batches > mark[3]
            self.batches -= mark[3]
            self.eval_ns -= mark[4]
        if not at_exit:
            agent.after_step(mark[0] if mark is not None else perf_ns())

    def _step_row(self, t: int, boundary: int) -> list:
        row = [
            self.step,
            t,  # perf_counter_ns: the flush sends the offset to UNIX time
            t - boundary - self.eval_ns,
            self.data_wait,
            self.last_batch_size,
            self.samples or None,
            self.autocast_dtype,
            self.scaler_used,
        ]
        cuda = self.agent.cuda
        module = self.cuda_module
        if cuda.seen or ((module is None or module._initialized) and self.cuda_is_initialized()):
            values = cuda.step_stats()
            if values is not None:
                row.extend(values)
        distributed = self.agent.distributed
        extra = distributed.step_values(t) if distributed is not None else None
        if extra is not None:
            row.extend([None] * (AGENT_STEP_VALUES - len(row)))
            row.extend(extra)
        return row

    def _close_step(self, t: int) -> None:
        boundary = self.boundary if self.boundary is not None else self.start_ns
        agent = self.agent
        self.drain_rows(agent.steps)  # rows of the compiled short path come first
        row = self._step_row(t, boundary)
        window = agent.profile
        if window is not None and window.marks(self.step):
            row.extend([None] * (PROFILED_VALUE - len(row)))
            row.append(True)
        agent.steps.append(row)
        self.step += 1
        self.boundary = t
        self.prev_step_fed = self.batches > 0
        self.data_wait = 0
        self.samples = 0
        self.batches = 0
        self.eval_ns = 0
        self.autocast_dtype = None
        self.scaler_used = False
        if agent.distributed is not None:
            agent.distributed.step_closed()
        if window is not None:
            window.boundary(self.step)
        # Agent.after_step's conditions, checked here first: most steps need neither.
        if (
            len(agent.steps) >= agent.flush_max_steps
            or t - agent.last_flush >= FLUSH_INTERVAL_NS
            or agent.stop_after is not None
        ):
            agent.after_step(t)


def batch_len(batch, tensor_type) -> int | None:
    """Samples in a collated batch: the leading dimension of its first tensor.

    Runs on every batch: exact type checks first (``isinstance`` against torch.Tensor is slow
    for non-tensors), ``isinstance`` only for subclasses (HF BatchEncoding, namedtuples).
    """
    for _ in range(4):
        kind = type(batch)
        if kind is tensor_type or (
            kind is not tuple
            and kind is not list
            and kind is not dict
            and isinstance(batch, tensor_type)
        ):
            shape = batch.shape
            return shape[0] if shape else None
        if kind is tuple or kind is list or isinstance(batch, (list, tuple)):
            if not batch:
                return None
            first = batch[0]
            kind = type(first)
            if (
                kind is not tensor_type
                and kind is not tuple
                and kind is not list
                and kind is not dict
                and not isinstance(first, (tensor_type, list, tuple, dict))
            ):
                return len(batch)  # e.g. a list of strings
            batch = first
        elif kind is dict or isinstance(batch, Mapping):
            if not batch:
                return None
            batch = next(iter(batch.values()))
        else:
            return None
    return None
