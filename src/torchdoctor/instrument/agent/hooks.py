"""What the agent patches in torch, once torch is imported, and the wrappers it patches in.

- ``DataLoader.__init__`` (configuration; tune's overrides), ``DataLoader.__iter__`` (epoch
  starts, first-batch latency) and ``_BaseDataLoaderIter.__next__`` (time blocked = data wait);
- the DataLoader worker loop (worker processes report their own settings, never steps);
- torch's global optimizer step post-hook: the step boundary;
- ``torch.autograd.backward`` (``Tensor.backward`` calls it): the step boundary of loops that
  update their parameters without ``torch.optim`` (see :mod:`.steps`), and whether an
  out-of-memory error came inside backward; taken out again while nothing needs it
  (:class:`BackwardPatch`);
- ``autocast.__enter__`` and ``GradScaler.scale`` (was AMP really on in the step);
- ``torch.set_num_threads`` (records changes; enforces tune's thread override in the trainer);
- ``no_grad``/``inference_mode`` ``__enter__``/``__exit__`` (evaluation without a DataLoader:
  see :mod:`.eval_forward`);
- ``nn.DataParallel.__init__`` and ``GradScaler._maybe_opt_step`` (events for the rules
  dataparallel-used and grad-scale-falling: see :mod:`.pitfalls`);
- the CUDA allocator's out-of-memory observer and ``sys.excepthook`` (OOM with its step).

Each wrapper checks ``agent.active`` first, so that a disabled agent costs one attribute read,
and calls the agent's handlers through :func:`guard`: the first exception of a handler switches
the agent off for the process and never reaches the user's code. All of it is undone by
``Agent.uninstall``.
"""

from __future__ import annotations

import sys

from . import compiled, eval_forward, pitfalls, settings
from .contract import FLUSH_INTERVAL_NS, RANK, WORKER, perf_ns
from .cuda import CudaMemory
from .loaders import Loaders
from .steps import StepCounter


def guard(agent, where: str, handler, fallback=None):
    """``handler`` made safe for a hook body: its first exception switches ``agent`` off
    (recorded once as ``instrumentation-disabled`` with ``where``) and ``fallback`` is
    returned instead. BaseExceptions that are not Exceptions (the stop rule's SystemExit,
    KeyboardInterrupt) go through, as the user's own would.

    The handlers of every batch and step (no argument, one, four) get a wrapper of their own
    arity: calling through ``*args`` costs about twice as much, on every batch and step."""

    def failed(exc: Exception):
        agent.disable(where, exc)
        return fallback

    arity = _arity(handler)
    if arity == 0:

        def guarded():
            try:
                return handler()
            except Exception as exc:
                return failed(exc)

    elif arity == 1:

        def guarded(a):
            try:
                return handler(a)
            except Exception as exc:
                return failed(exc)

    elif arity == 4:

        def guarded(a, b, c, d):
            try:
                return handler(a, b, c, d)
            except Exception as exc:
                return failed(exc)

    else:

        def guarded(*args):
            try:
                return handler(*args)
            except Exception as exc:
                return failed(exc)

    return guarded


def _arity(handler) -> int | None:
    """Positional parameters ``handler`` takes (None: not a plain function or method)."""
    function = getattr(handler, "__func__", handler)
    code = getattr(function, "__code__", None)
    if code is None or code.co_flags & 0x0C or code.co_kwonlyargcount:  # *args, **kwargs
        return None
    if function.__defaults__:
        return None
    return code.co_argcount - (function is not handler)


def install(agent, torch) -> None:
    """Build the agent's torch-time parts and patch torch (raises on failure: the caller
    switches the agent off)."""
    import torch.optim.optimizer as optimizer_mod
    import torch.utils.data._utils.worker as worker_mod
    import torch.utils.data.dataloader as dataloader_mod

    agent.torch = torch
    if agent.counter is None:
        # Built once per agent: like the rest of its state they outlive an uninstall, and
        # only a new process (or a new watch session) resets them.
        counter = StepCounter(agent, torch)
        loaders = Loaders(agent, torch)
        cuda = CudaMemory(agent, torch)
        counter.loaders = loaders
        counter.backward_patch = BackwardPatch(agent, counter, torch)
        cuda.oom_observer = _oom_observer(agent, guard(agent, "cuda-oom", cuda.on_oom))
        cuda.watch_init()  # run --memory-history: the history from CUDA's first allocation
        agent.counter, agent.loader_state, agent.cuda = counter, loaders, cuda
    counter, loaders, cuda = agent.counter, agent.loader_state, agent.cuda
    counter.start_ns = perf_ns()
    counter.fast = False  # until a full step has checked what this install set up
    agent.role = settings.guess_role()
    dl_cls = dataloader_mod.DataLoader
    it_cls = dataloader_mod._BaseDataLoaderIter
    patch = agent.patch
    patch(dl_cls, "__init__", _dataloader_init(agent, loaders, dl_cls.__init__))
    patch(dl_cls, "__iter__", _dataloader_iter(agent, loaders, dl_cls.__iter__))
    fast = compiled.fast
    if fast is not None:
        on_exhausted = guard(agent, "dataloader-next", counter.on_exhausted)
        next_wrapper = fast.NextWrapper(counter, it_cls.__next__, counter.on_batch, on_exhausted)
        step_hook = fast.StepHook(counter, counter._on_step, FLUSH_INTERVAL_NS)
    else:
        next_wrapper = _iterator_next(agent, counter, it_cls.__next__)
        step_hook = _step_hook(agent, counter.on_step)
    patch(it_cls, "__next__", next_wrapper)
    patch(worker_mod, "_worker_loop", _worker_loop(agent, loaders, worker_mod._worker_loop))
    patch(torch, "set_num_threads", _set_num_threads(agent, torch.set_num_threads))
    autocast_cls = getattr(getattr(torch, "amp", None), "autocast_mode", None)
    autocast_cls = getattr(autocast_cls, "autocast", None)
    if autocast_cls is not None and "__enter__" in autocast_cls.__dict__:
        patch(autocast_cls, "__enter__", _autocast_enter(agent, counter, autocast_cls.__enter__))
    scaler_mod = getattr(torch.amp, "grad_scaler", None)
    scaler_cls = getattr(scaler_mod, "GradScaler", None)
    if scaler_cls is not None and "scale" in scaler_cls.__dict__:
        patch(scaler_cls, "scale", _scaler_scale(agent, counter, scaler_cls.scale))
    patch(sys, "excepthook", _excepthook(agent, cuda, sys.excepthook))
    eval_forward.install(agent, torch, counter, guard)  # evaluation without a DataLoader
    pitfalls.install_data_parallel(agent, torch, guard)
    pitfalls.install_grad_scaler(agent, torch, guard)
    agent._hook_handle = optimizer_mod.register_optimizer_step_post_hook(step_hook)
    counter.backward_patch.install()
    counter.watch_cuda_start(torch)
    agent.active = True
    agent.event("process-start", settings.process_detail(agent))
    agent.setting("agent.fast_path", compiled.FAST_PATH)
    if agent.role == RANK:
        from . import ranks

        agent.distributed = ranks.install(agent, torch)
    if agent.overrides:
        agent.setting("overrides", agent.overrides)
    if "num_threads" in agent.overrides:
        # In a multiprocessing child (DataLoader worker or mp.spawn rank) wait until the
        # process shows what it is: a worker must keep torch's one thread.
        if settings.in_multiprocessing_child():
            agent.threads_override_pending = True
        else:
            settings.apply_threads_override(agent)
    if torch.cuda.is_initialized():
        cuda.on_seen()
    if counter.boundary_kind == "optimizer":
        counter.backward_patch.drop()  # installed again (watch): known before
    steps_text, folder = agent.profile_env
    if steps_text or folder:
        _arm_profile(agent, steps_text, folder)


def _arm_profile(agent, steps_text, folder) -> None:
    """The profiler window TORCHDOCTOR_PROFILE_STEPS asks for, and the watch on `torchdoctor
    profile`'s requests (loaded only then: most jobs never profile)."""
    if agent.role == WORKER:
        return  # DataLoader workers never step
    from . import profile

    if folder:
        agent.profile_watch = profile.RequestWatch(folder)
    if steps_text and agent.profile is None:
        import os

        environ = {**os.environ, profile.ENV_PROFILE_STEPS: steps_text}
        environ[profile.ENV_PROFILE_DIR] = folder or ""  # as read at start-up
        agent.profile = profile.from_environment(agent, environ)
    agent._profile_flush(agent.counter)  # a pending window's start is due as a flush


# -- the wrappers ---------------------------------------------------------------------------
# Timing and the call only: the handlers are guarded (see guard). The __next__ wrapper and the
# step hook are the pure-Python path's; the compiled path has its own (compiled.py, _fast.c).


def _iterator_next(agent, counter, original):
    on_batch = counter.on_batch
    on_exhausted = guard(agent, "dataloader-next", counter.on_exhausted)

    def __next__(self):
        if not agent.active:
            return original(self)
        t0 = perf_ns()
        try:
            batch = original(self)
        except BaseException:
            if agent.active:
                on_exhausted(self, t0, perf_ns() - t0)
            raise
        dt = perf_ns() - t0
        if agent.active:
            # guard() written out: this runs on every batch, and its call costs as much as
            # the handler's common path.
            try:
                on_batch(self, batch, t0, dt)
            except Exception as exc:
                agent.disable("dataloader-next", exc)
        return batch

    __next__.__wrapped__ = original
    return __next__


def _dataloader_iter(agent, loaders, original):
    on_iter = guard(agent, "dataloader-iter", loaders.on_iter)

    def __iter__(self):
        if not agent.active:
            return original(self)
        t0 = perf_ns()
        it = original(self)
        if agent.active:
            on_iter(self, it, t0)
        return it

    __iter__.__wrapped__ = original
    return __iter__


def _dataloader_init(agent, loaders, original):
    apply_overrides = guard(agent, "dataloader-overrides", loaders.apply_overrides)

    def created(loader, applied) -> None:
        loaders.on_created(loader)
        if applied:
            agent.event("override-applied", {"loader_id": loaders.next_id - 1, **applied})
            if agent.threads_override_pending:
                settings.apply_threads_override(agent)

    on_created = guard(agent, "dataloader-init", created)

    def __init__(self, *args, **kwargs):
        if not agent.active:
            return original(self, *args, **kwargs)
        applied = None
        if agent.overrides and agent.role != WORKER:
            result = apply_overrides(original, (self, *args), kwargs)
            if result is not None:
                new_args, new_kwargs, applied = result
        if applied:
            try:
                original(*new_args, **new_kwargs)
            except Exception as exc:
                # Rejected override: build the loader exactly as the user asked (their own
                # error, if any, propagates from here), then switch off.
                original(self, *args, **kwargs)
                agent.disable("dataloader-overrides", exc)
                return None
        else:
            original(self, *args, **kwargs)
        if agent.active:
            on_created(self, applied)
        return None

    __init__.__wrapped__ = original
    return __init__


def _worker_loop(agent, loaders, original):
    def started(args, kwargs) -> None:
        import inspect

        arguments = inspect.signature(original).bind(*args, **kwargs).arguments
        loaders.enter_worker(arguments.get("worker_id"), arguments.get("num_workers"))

    started = guard(agent, "dataloader-worker", started)

    def _worker_loop(*args, **kwargs):
        if agent.active:
            started(args, kwargs)
        try:
            return original(*args, **kwargs)
        finally:
            # Forked workers end with os._exit (no atexit): send what is left now.
            import contextlib

            with contextlib.suppress(Exception):
                agent.flush(final=True)

    _worker_loop.__wrapped__ = original
    _worker_loop.__module__ = original.__module__
    _worker_loop.__qualname__ = original.__qualname__
    _worker_loop.__name__ = original.__name__
    return _worker_loop


def _set_num_threads(agent, original):
    def threads_for(n):
        return settings.threads_for(agent, n)

    threads_for = guard(agent, "set-num-threads", threads_for)
    recorded = guard(agent, "set-num-threads", settings.on_set_num_threads)

    def set_num_threads(n):
        if not agent.active:
            return original(n)
        wanted = threads_for(n)
        result = original(n if wanted is None else wanted)
        recorded(agent)
        return result

    set_num_threads.__wrapped__ = original
    set_num_threads.__doc__ = original.__doc__
    set_num_threads.__name__ = "set_num_threads"
    return set_num_threads


def _autocast_enter(agent, counter, original):
    def entered(autocast) -> None:
        if autocast._enabled:
            counter.autocast_dtype = str(autocast.fast_dtype).replace("torch.", "")

    entered = guard(agent, "autocast", entered)

    def __enter__(self):
        result = original(self)
        if agent.active:
            entered(self)
        return result

    __enter__.__wrapped__ = original
    return __enter__


def _scaler_scale(agent, counter, original):
    def scaling(scaler) -> None:
        if scaler._enabled:
            counter.scaler_used = True

    scaling = guard(agent, "grad-scaler", scaling)

    def scale(self, outputs):
        if agent.active:
            scaling(self)
        return original(self, outputs)

    scale.__wrapped__ = original
    return scale


class BackwardPatch:
    """The wrapper of ``torch.autograd.backward``, and its removal while nothing needs it.

    It is needed until optimizer steps are known to end the steps (before, each backward pass
    may end one), and in a process using CUDA (an out-of-memory error raised on autograd's own
    threads has no Python stack: only the depth it keeps says it came inside backward). Once a
    CPU job's optimizer ends its steps, nothing reads it, yet it costs every step a call
    through ``*args``: :meth:`drop` restores torch's own function, and the wrapper comes back
    when CUDA is initialised (``torch.cuda._lazy_call``, run inside its lazy init before any
    allocation) or when a forked child starts counting afresh (:meth:`restore`)."""

    def __init__(self, agent, counter, torch) -> None:
        self.agent = agent
        self.counter = counter
        self.torch = torch
        self.original = None
        self.wrapper = None
        self.dropped = False
        self.cuda_call_queued = False

    def install(self) -> None:
        autograd = self.torch.autograd
        self.original = autograd.backward
        self.wrapper = _backward(self.agent, self.counter, self.original)
        self.dropped = False
        self.agent.patch(autograd, "backward", self.wrapper)

    def drop(self) -> None:
        """Take the wrapper out, where it is torch's current function and CUDA is not in use."""
        torch = self.torch
        lazy_call = getattr(torch.cuda, "_lazy_call", None)
        if (
            self.dropped
            or lazy_call is None
            or torch.autograd.backward is not self.wrapper  # wrapped over (ranks, the user)
            or torch.cuda.is_initialized()
        ):
            return
        torch.autograd.backward = self.original
        self.dropped = True
        if not self.cuda_call_queued:
            self.cuda_call_queued = True
            lazy_call(self._cuda_initialised)

    def restore(self) -> None:
        """Put the wrapper back, where it was dropped and the agent is still installed."""
        if not self.dropped:
            return
        self.dropped = False
        autograd = self.torch.autograd
        if self.agent.active and autograd.backward is self.original:
            autograd.backward = self.wrapper

    def _cuda_initialised(self) -> None:
        # Runs inside torch.cuda's lazy init, where an exception would fail the user's call.
        self.cuda_call_queued = False
        try:
            self.restore()
        except Exception as exc:
            self.agent.disable("backward-restore", exc)


def _backward(agent, counter, original):
    on_backward = guard(agent, "backward", counter.on_backward)

    def backward(*args, **kwargs):
        if not agent.active:
            return original(*args, **kwargs)
        counter.backward_depth += 1  # a backward pass run from inside one is part of it
        try:
            result = original(*args, **kwargs)
        finally:
            counter.backward_depth -= 1
        if agent.active and not counter.backward_depth:
            on_backward()
        return result

    backward.__wrapped__ = original
    backward.__doc__ = original.__doc__
    backward.__name__ = "backward"
    return backward


def _step_hook(agent, on_step):
    """The step boundary: ``on_step`` guarded by hand (see _iterator_next)."""

    def torchdoctor_step_hook(optimizer, args, kwargs):
        if agent.active:
            try:
                on_step(optimizer)
            except Exception as exc:
                agent.disable("optimizer-step", exc)

    return torchdoctor_step_hook


def _oom_observer(agent, on_oom):
    def torchdoctor_oom_observer(device, requested, allocated, free):
        if agent.active:
            on_oom(device, requested, allocated, free)

    return torchdoctor_oom_observer


def _excepthook(agent, cuda, previous):
    def excepthook(exc_type, exc, tb):
        if agent.active:
            import contextlib

            # Never switches the agent off: the program is ending anyway.
            with contextlib.suppress(Exception):
                cuda.on_uncaught(exc_type, exc, tb)
        return previous(exc_type, exc, tb)

    excepthook.__wrapped__ = previous
    return excepthook
