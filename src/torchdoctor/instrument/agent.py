"""The agent that runs inside the user's job: hooks torch, buffers records, ships them out.

This module is standard-library only on purpose: the bootstrap (``sitecustomize``) loads it by
path as ``_torchdoctor_agent`` into whatever Python the job runs, which need not be the one that
has torchdoctor installed. It never imports torch itself; :func:`arm` waits for the user's code
to import torch and only then patches it.

What it hooks (all restored by :func:`uninstall`):

- ``DataLoader.__init__`` (configuration; tune's overrides), ``DataLoader.__iter__`` (epoch
  starts, first-batch latency) and ``_BaseDataLoaderIter.__next__`` (time blocked = data wait);
- the DataLoader worker loop (worker processes report their own settings, never steps);
- torch's global optimizer step post-hook: the step boundary;
- ``torch.autograd.backward`` (``Tensor.backward`` calls it): the step boundary of loops that
  update their parameters without ``torch.optim`` (see below);
- ``autocast.__enter__`` and ``GradScaler.scale`` (was AMP really on in the step);
- ``torch.set_num_threads`` (records changes; enforces tune's thread override in the trainer);
- the CUDA allocator's out-of-memory observer and ``sys.excepthook`` (OOM with its step).

Safety: every hook body runs under ``try``; the first exception switches the agent off for the
process (patches restored), is recorded once as an ``instrumentation-disabled`` event and never
reaches the user's code. The agent never writes to stdout or stderr.

Evaluation between training steps (a validation pass) is not part of any step: batches
fetched while autograd is off (``torch.no_grad()``, ``inference_mode()``: Lightning's loops and
the usual hand-written ones), and a loader's whole pass that no optimizer step interrupted (the
Hugging Face Trainer fetches its evaluation batches with autograd on) are evaluation. Their
samples, batches and waits stay out of the steps; the time from the evaluation's first
DataLoader call to the next training data request is taken out of the wall time of the step it
falls in and recorded as an ``evaluation`` event. An evaluation that no training data request
follows before the next optimizer step was that step's own data (a loop that fetches its batches
under ``no_grad``): it is counted into the step as before.

Steps without an optimizer: until the first ``torch.optim`` step is seen, each top-level
``backward()`` ends a candidate step, held back (the counters keep running). An optimizer step
discards them: the loop steps its optimizer, after one or several backward passes (gradient
accumulation), and optimizer steps are the boundary from then on. After
:data:`BACKWARD_STEPS_TO_DECIDE` backward passes without one (or at exit), the held steps are
recorded and each backward pass ends a step. The ``steps.boundary`` setting says which.

Records leave the process in batches (at most every :data:`FLUSH_INTERVAL_S` seconds or
:data:`FLUSH_MAX_STEPS` steps, from the step hook: no thread) as JSON messages over a Unix
``SOCK_SEQPACKET`` connection to the collector, or to in-process sinks (``watch``).
"""

from __future__ import annotations

# Only what every Python start-up has loaded already: the agent is loaded into every Python
# process of the job, most of which never import torch. The rest is imported when needed.
import atexit
import os
import sys
import time
from _thread import get_ident as _get_ident
from _weakref import ref as _weakref_ref

WIRE_VERSION = 1
ENV_COLLECTOR = "TORCHDOCTOR_COLLECTOR"
ENV_NO_INSTRUMENT = "TORCHDOCTOR_NO_INSTRUMENT"
ENV_OVERRIDES = "TORCHDOCTOR_OVERRIDES"
ENV_STOP_AFTER_STEPS = "TORCHDOCTOR_STOP_AFTER_STEPS"

# Exit status of a process stopped by TORCHDOCTOR_STOP_AFTER_STEPS (EX_TEMPFAIL: Python itself
# never uses it). The recording also gets a "stopped-after-steps" event.
STOPPED_EXIT_STATUS = 75

FLUSH_INTERVAL_S = 0.25
_FLUSH_INTERVAL_NS = int(FLUSH_INTERVAL_S * 1e9)
_VOLATILE_EVERY_NS = 2_000_000_000  # re-read changeable settings at most every 2 s
FLUSH_MAX_STEPS = 128
MAX_PENDING_MESSAGES = 512  # kept while the collector is slow; oldest dropped beyond
# Backward passes without an optimizer step after which the loop is taken to update its
# parameters by hand: gradient accumulation steps its optimizer long before this.
BACKWARD_STEPS_TO_DECIDE = 64

# Order of the values of one step on the wire; every message names it, so the collector never
# depends on this module's version. Times are integer nanoseconds: JSON writes an int several
# times faster than a float, and this is the bulk of what the job spends on shipping. Steps
# without CUDA figures leave the trailing CUDA values out.
STEP_FIELDS = (
    "step",
    "t_end_ns",
    "wall_ns",
    "data_wait_ns",
    "batch_size",
    "samples",
    "autocast_dtype",
    "grad_scaler",
    "cuda_allocated",
    "cuda_reserved",
    "cuda_max_allocated",
    "cuda_alloc_retries",
    "cuda_ooms",
    # Ranks only (instrument/distributed.py), after CUDA values padded with nulls.
    "forward_ns",
    "backward_ns",
    "optimizer_ns",
    "comm_ns",
    "comm_overlap_ns",
    "backward_compute_ns",
)
_AGENT_STEP_VALUES = 13  # STEP_FIELDS up to cuda_ooms

# tune's overrides: key -> accepted Python type.
OVERRIDE_TYPES = {
    "num_workers": int,
    "prefetch_factor": int,
    "pin_memory": bool,
    "persistent_workers": bool,
    "num_threads": int,
}
_DATALOADER_OVERRIDES = ("num_workers", "prefetch_factor", "pin_memory", "persistent_workers")

# Settings that can change while the job runs: re-read at every flush, sent when they change.
_VOLATILE_SETTINGS = (
    "torch.num_threads",
    "torch.num_interop_threads",
    "matmul.float32_precision",
    "matmul.allow_tf32",
    "cudnn.allow_tf32",
    "cudnn.benchmark",
    "cudnn.deterministic",
)

_perf = time.perf_counter
_perf_ns = time.perf_counter_ns
_now = time.time
_now_ns = time.time_ns


def env_flag(value: str | None) -> bool:
    """True for a set variable other than an explicit no ("", "0", "false", "no", "off")."""
    return value is not None and value.strip().lower() not in ("", "0", "false", "no", "off")


def parse_overrides(text: str | None) -> dict:
    """Parse TORCHDOCTOR_OVERRIDES (a JSON object); raise ValueError saying what is wrong."""
    if not text:
        return {}
    try:
        import json

        data = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{ENV_OVERRIDES} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{ENV_OVERRIDES} must be a JSON object, got {type(data).__name__}")
    out = {}
    for key, value in data.items():
        kind = OVERRIDE_TYPES.get(key)
        if kind is None:
            known = ", ".join(sorted(OVERRIDE_TYPES))
            raise ValueError(f"{ENV_OVERRIDES}: unknown key {key!r} (known: {known})")
        # bool is an int in Python: reject it where a count is expected, and vice versa.
        if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"{ENV_OVERRIDES}: {key} must be an integer, got {value!r}")
        if kind is bool and not isinstance(value, bool):
            raise ValueError(f"{ENV_OVERRIDES}: {key} must be true or false, got {value!r}")
        out[key] = value
    return out


def _dumps(value) -> str:
    import json

    return json.dumps(value, default=str, separators=(",", ":"))


def _qualname(obj) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _env_int(name: str) -> int | None:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


class SocketSink:
    """Sends messages to the collector over one SOCK_SEQPACKET connection per process.

    Sends never block the job: a message the socket cannot take now waits for the next flush
    (the exit flush waits up to ``exit_timeout``). A missing collector drops messages quietly.
    """

    def __init__(self, address: str, exit_timeout: float = 2.0) -> None:
        self.address = address
        self.exit_timeout = exit_timeout
        self._sock = None
        self._pid: int | None = None
        self._pending: list[bytes] = []
        self.dropped = 0
        self._gone = False

    def __call__(self, message: dict) -> None:
        self._pending.append(_dumps(message).encode())
        if len(self._pending) > MAX_PENDING_MESSAGES:
            del self._pending[0]
            self.dropped += 1
        self.drain(block=False)

    def _connect(self):
        if self._pid != os.getpid():
            # A forked child shares the parent's connection: never write to it.
            self._sock = None
            self._pid = os.getpid()
            self._gone = False
        if self._sock is None and not self._gone:
            import socket

            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                sock.connect(self.address)
            except OSError:
                sock.close()
                self._gone = True
                return None
            sock.setblocking(False)
            self._sock = sock
        return self._sock

    def drain(self, block: bool) -> None:
        if not self._pending:
            return
        sock = self._connect()
        if sock is None:
            self.dropped += len(self._pending)
            self._pending.clear()
            return
        deadline = _perf() + self.exit_timeout
        while self._pending:
            try:
                sock.send(self._pending[0])
            except BlockingIOError:
                if not block or _perf() > deadline:
                    return
                time.sleep(0.005)
                continue
            except OSError:
                # Collector gone (recorder ended or killed): nothing to deliver to.
                self._gone = True
                self._sock = None
                self.dropped += len(self._pending)
                self._pending.clear()
                return
            del self._pending[0]

    def close(self) -> None:
        self.drain(block=True)


class _LoaderInfo:
    __slots__ = ("loader_id", "record", "sent", "epochs", "batch_size")

    def __init__(self, loader_id: int, record: dict, batch_size: int | None) -> None:
        self.loader_id = loader_id
        self.record = record
        self.sent = False
        self.epochs = 0
        self.batch_size = batch_size


class _PassStart:
    """Where a step's figures stood when a training loader's pass began: should the pass end
    before the next optimizer step, it trained nothing and these figures are restored."""

    __slots__ = (
        "step", "t_iter", "samples", "batches", "data_wait", "boundary", "last_batch_size",
        "loader_batch_size",
    )  # fmt: skip

    def __init__(self, agent: Agent, t_iter: int) -> None:
        self.step = agent.step
        self.t_iter = t_iter
        self.samples = agent.samples
        self.batches = agent.batches
        self.data_wait = agent.data_wait
        self.boundary = agent.boundary
        self.last_batch_size = agent.last_batch_size
        self.loader_batch_size = agent.loader_batch_size


class Agent:
    """Per-process state of the instrumentation. One instance: :data:`AGENT`."""

    def __init__(self) -> None:
        self.armed = False  # import hook or patches in place
        self.active = False  # patches in place and working
        self.disabled_reason: str | None = None
        self.torch = None
        self.sinks: list = []
        self.overrides: dict = {}
        self.stop_after: int | None = None
        self._patches: list[tuple[object, str, object, object]] = []
        self._hook_handle = None
        self._fork_registered = False
        self._atexit_registered = False
        self._finder = None
        self.distributed = None  # the rank hooks (instrument/distributed.py) in a torchrun rank
        self._reset_process()

    # -- per-process state ------------------------------------------------------------------

    def _reset_process(self) -> None:
        self.pid = os.getpid()
        self.rank = _env_int("RANK")
        self.role = "trainer"
        self.steps: list[list] = []
        self.loaders: list[dict] = []
        self.settings: list[list] = []
        self.events: list[list] = []
        self.pending_loaders: list[_LoaderInfo] = []
        self.next_loader_id = 0
        self.step = 0
        self.boundary: int | None = None  # perf_counter_ns of the last step boundary
        self.start_ns = _perf_ns()
        self.data_wait = 0  # ns blocked in DataLoader next() since the boundary
        self.samples = 0
        self.last_batch_size: int | None = None
        self.loader_batch_size: int | None = None
        self.autocast_dtype: str | None = None
        self.scaler_used = False
        self.step_thread: int | None = None  # thread id of the first optimizer step
        self.last_optimizer = None  # weakref to the optimizer that ended the last step
        self.loader_seen = False
        self.batches = 0  # DataLoader batches since the last step boundary
        self.settings_done = False
        self.setting_values: dict[str, str] = {}
        self.last_flush = _perf_ns()
        self.last_volatile = 0
        self.awaiting_first_batch = 0  # iterators whose first batch is still to come
        self.cuda_seen = False
        self.cuda_stats_ok = True
        self.oom_observer = False
        self.oom_recorded_step: int | None = None
        self.threads_override_pending = False
        self.stopping = False
        # The evaluation under way (perf_counter_ns of its first DataLoader call), its figures,
        # and evaluation time already taken out of the current step.
        self.eval_start: int | None = None
        self.eval_detected_by = ""
        self.eval_last = 0  # perf_counter_ns at the end of its last DataLoader call
        self.eval_batches = 0
        self.eval_samples = 0
        self.eval_samples_known = True
        self.eval_wait = 0
        self.eval_last_size: int | None = None
        self.eval_ns = 0
        self.prev_step_fed: bool | None = None  # did the last step take DataLoader batches
        # What ends a step: None until known, then "optimizer" or "backward". Candidate steps
        # ended by backward passes while it is unknown, and the counters at the last of them.
        self.boundary_kind: str | None = None
        self.backward_depth = 0
        self.held_steps: list[list] = []
        self.held_mark: tuple[int, int, int, int, int] | None = None

    # -- lifecycle ----------------------------------------------------------------------------

    def configure_from_env(self, environ=os.environ) -> bool:
        """Read the collector address, overrides and stop rule; False when told not to run."""
        if env_flag(environ.get(ENV_NO_INSTRUMENT)):
            return False
        address = environ.get(ENV_COLLECTOR)
        if address:
            self.sinks.append(SocketSink(address))
        try:
            self.overrides = parse_overrides(environ.get(ENV_OVERRIDES))
        except ValueError as exc:
            self.overrides = {}
            self.event("overrides-invalid", {"error": str(exc)})
        stop = environ.get(ENV_STOP_AFTER_STEPS)
        if stop:
            try:
                self.stop_after = max(1, int(stop))
            except ValueError:
                self.event("stop-after-invalid", {"value": stop})
        return True

    def arm(self) -> None:
        """Install as soon as torch is imported (now, when it already is)."""
        if self.armed:
            return
        self.armed = True
        self._register_process_hooks()
        torch = sys.modules.get("torch")
        if torch is not None and hasattr(torch, "optim"):
            self._install_guarded(torch)
            return
        self._finder = _TorchImportFinder(self._install_guarded)
        sys.meta_path.insert(0, self._finder)

    def start_session(self, sink) -> bool:
        """Send records to ``sink`` too (in-process ``watch``); True when this call armed the
        agent (then :meth:`end_session` uninstalls it), False when it was already running."""
        if self.active or self.finder_active():
            self.sinks.append(sink)
            return False
        self.disabled_reason = None
        self._reset_process()
        self.sinks = [sink]
        self.arm()
        return True

    def end_session(self, sink, armed_here: bool) -> None:
        """Deliver what is buffered, stop sending to ``sink``; uninstall if armed for it."""
        if armed_here:
            self.uninstall()
        else:
            self.flush()
        if sink in self.sinks:
            self.sinks.remove(sink)

    def _register_process_hooks(self) -> None:
        if not self._fork_registered:
            os.register_at_fork(after_in_child=self._after_fork)
            self._fork_registered = True
        if not self._atexit_registered:
            atexit.register(self._at_exit)
            self._atexit_registered = True

    def _install_guarded(self, torch) -> None:
        if self.finder_active():
            self._remove_finder()
        if self.active or not self.armed:
            return
        try:
            self._install(torch)
        except Exception as exc:
            self.disable("install", exc)

    def finder_active(self) -> bool:
        return self._finder is not None

    def _remove_finder(self) -> None:
        finder, self._finder = self._finder, None
        if finder is not None and finder in sys.meta_path:
            sys.meta_path.remove(finder)

    def uninstall(self) -> None:
        """Restore everything torch had before and stop recording (buffers are flushed)."""
        self._remove_finder()
        was_active = self.active
        self.active = False
        self.armed = False
        self._restore_patches()
        if was_active:
            self._end_open_evaluation()
            self._emit_pending_loaders()
            self.flush(final=True)

    def disable(self, where: str, exc: BaseException) -> None:
        """Switch off for this process after a failure inside the instrumentation."""
        if self.disabled_reason is not None:
            return
        self.disabled_reason = f"{type(exc).__name__}: {exc}"[:500]
        self.active = False
        self.armed = False
        self._remove_finder()
        import contextlib

        with contextlib.suppress(Exception):
            self._restore_patches()
        try:
            self.event("instrumentation-disabled", {"where": where, "error": self.disabled_reason})
            self.flush(final=True)
        except Exception:
            pass

    # -- installation -------------------------------------------------------------------------

    def _patch(self, owner, name: str, replacement) -> None:
        original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        self._patches.append((owner, name, original, replacement))
        setattr(owner, name, replacement)

    def _restore_patches(self) -> None:
        while self._patches:
            owner, name, original, replacement = self._patches.pop()
            current = owner.__dict__.get(name) if isinstance(owner, type) else None
            if current is None:
                current = getattr(owner, name, None)
            if current is not replacement:
                continue  # someone patched over us since: theirs stays (ours is inert now)
            import contextlib

            with contextlib.suppress(Exception):
                setattr(owner, name, original)
        if self.distributed is not None:
            self.distributed, rank_hooks = None, self.distributed
            import contextlib

            with contextlib.suppress(Exception):
                rank_hooks.uninstall()
        handle, self._hook_handle = self._hook_handle, None
        if handle is not None:
            import contextlib

            with contextlib.suppress(Exception):
                handle.remove()

    def _install(self, torch) -> None:
        import torch.optim.optimizer as optimizer_mod
        import torch.utils.data._utils.worker as worker_mod
        import torch.utils.data.dataloader as dataloader_mod

        global _MAPPING
        from collections.abc import Mapping

        _MAPPING = Mapping
        self.torch = torch
        self.tensor_type = torch.Tensor
        self.grad_enabled = torch.is_grad_enabled
        self.cuda_is_initialized = torch.cuda.is_initialized
        self.start_ns = _perf_ns()
        self.role = _guess_role()
        dl_cls = dataloader_mod.DataLoader
        it_cls = dataloader_mod._BaseDataLoaderIter
        self._patch(dl_cls, "__init__", _make_dataloader_init(self, dl_cls.__init__))
        self._patch(dl_cls, "__iter__", _make_dataloader_iter(self, dl_cls.__iter__))
        self._patch(it_cls, "__next__", _make_iterator_next(self, it_cls.__next__))
        self._patch(worker_mod, "_worker_loop", _make_worker_loop(self, worker_mod._worker_loop))
        self._patch(torch, "set_num_threads", _make_set_num_threads(self, torch.set_num_threads))
        autocast_cls = getattr(getattr(torch, "amp", None), "autocast_mode", None)
        autocast_cls = getattr(autocast_cls, "autocast", None)
        if autocast_cls is not None and "__enter__" in autocast_cls.__dict__:
            self._patch(
                autocast_cls, "__enter__", _make_autocast_enter(self, autocast_cls.__enter__)
            )
        scaler_mod = getattr(torch.amp, "grad_scaler", None)
        scaler_cls = getattr(scaler_mod, "GradScaler", None)
        if scaler_cls is not None and "scale" in scaler_cls.__dict__:
            self._patch(scaler_cls, "scale", _make_scaler_scale(self, scaler_cls.scale))
        self._patch(sys, "excepthook", _make_excepthook(self, sys.excepthook))
        self._hook_handle = optimizer_mod.register_optimizer_step_post_hook(_make_step_hook(self))
        autograd = torch.autograd
        self._patch(autograd, "backward", _make_backward(self, autograd.backward))
        self.active = True
        self.event("process-start", self._process_detail())
        if self.role == "rank":
            self.distributed = _load_sibling("distributed").install(self, torch)
        if self.overrides:
            self.setting("overrides", self.overrides)
        if "num_threads" in self.overrides:
            # In a multiprocessing child (DataLoader worker or mp.spawn rank) wait until the
            # process shows what it is: a worker must keep torch's one thread.
            if _in_multiprocessing_child():
                self.threads_override_pending = True
            else:
                self._apply_threads_override()
        if self._cuda_initialized():
            self._on_cuda_seen()

    def _process_detail(self) -> dict:
        argv = [a[:200] for a in sys.argv[:32]]
        return {
            "argv": argv,
            "executable": sys.executable,
            "ppid": os.getppid(),
            "role": self.role,
            "rank": self.rank,
            "local_rank": _env_int("LOCAL_RANK"),
            "world_size": _env_int("WORLD_SIZE"),
            "torch_version": getattr(self.torch, "__version__", None),
            "python_version": sys.version.split()[0],
        }

    def _apply_threads_override(self) -> None:
        self.threads_override_pending = False
        if self.role == "dataloader-worker":
            return
        n = self.overrides["num_threads"]
        self._original_set_num_threads()(n)
        self.event("override-applied", {"num_threads": n})

    def _original_set_num_threads(self):
        for owner, name, original, _ in self._patches:
            if owner is self.torch and name == "set_num_threads":
                return original
        return self.torch.set_num_threads

    # -- records ------------------------------------------------------------------------------

    def event(self, kind: str, detail: dict, t: float | None = None) -> None:
        self.events.append([_now() if t is None else t, kind, _dumps(detail)])

    def setting(self, key: str, value) -> None:
        encoded = _dumps(value)
        if self.setting_values.get(key) == encoded:
            return
        self.setting_values[key] = encoded
        self.settings.append([_now(), key, encoded])

    def on_batch(self, it, batch, t0: int, dt: int) -> None:
        # Only the thread that steps the optimizer waits for data in the step's time (a loader
        # drained by a background prefetch thread hides its waits from the step), and only its
        # autograd mode tells evaluation from training (the mode is per thread).
        if self.step_thread is None or _get_ident() == self.step_thread:
            if not self.grad_enabled():
                self._on_evaluation_batch(it, batch, t0, dt)
                return
            if self.eval_start is not None:
                self._end_evaluation(t0, "training-data")
            self.data_wait += dt
        self.batches += 1
        self.loader_seen = True
        if self.boundary is None:
            self.boundary = t0
        n = _batch_len(batch, self.tensor_type)
        if n is None:
            n = self.loader_batch_size
        if n is not None:
            self.samples += n
            self.last_batch_size = n
        if self.awaiting_first_batch:
            self._first_batch(it, t0 + dt)

    def _first_batch(self, it, t_end: int) -> None:
        first = it.__dict__.pop("_torchdoctor_first", None)
        if first is not None:
            self.awaiting_first_batch -= 1
            info, t_iter = first
            info.record["first_batch_s"] = (t_end - t_iter) / 1e9
            self._emit_loader(info)

    def on_exhausted(self, it, t0: int, dt: int) -> None:
        """``next()`` raised (StopIteration at the end of a pass, or the loader's own error)."""
        if self.step_thread is not None and _get_ident() != self.step_thread:
            return
        if not self.grad_enabled():
            if self.eval_start is None:
                self._begin_evaluation(t0, "grad-disabled")
            self.eval_wait += dt
            self.eval_last = t0 + dt
            return
        if self.eval_start is not None:
            # Training code ran out of data (accelerate finds the end of the training loader
            # one batch ahead, so this may be all a step asks of it after an evaluation).
            self._end_evaluation(t0, "training-data")
        self.data_wait += dt
        started = it.__dict__.pop("_torchdoctor_pass", None)
        if started is not None and started.step == self.step and self.batches > started.batches:
            self._evaluation_pass(started, t0 + dt)

    def _evaluation_pass(self, started: _PassStart, t_end: int) -> None:
        """A loader's whole pass went by without an optimizer step: it trained nothing, so it
        was an evaluation (the Hugging Face Trainer's, fetched with autograd on). Its batches
        were counted into the step: move them out, back to the figures at its start."""
        self._begin_evaluation(started.t_iter, "loader-pass")
        self.eval_batches = self.batches - started.batches
        self.eval_samples = self.samples - started.samples
        self.eval_wait = self.data_wait - started.data_wait
        self.eval_last_size = self.last_batch_size
        self.eval_last = t_end
        self.batches = started.batches
        self.samples = started.samples
        self.data_wait = started.data_wait
        self.boundary = started.boundary
        self.last_batch_size = started.last_batch_size
        self.loader_batch_size = started.loader_batch_size

    def _on_evaluation_batch(self, it, batch, t0: int, dt: int) -> None:
        if self.eval_start is None:
            self._begin_evaluation(t0, "grad-disabled")
        self.eval_batches += 1
        self.eval_wait += dt
        self.eval_last = t0 + dt
        n = _batch_len(batch, self.tensor_type)
        if n is None:
            n = it.__dict__.get("_torchdoctor_batch_size")
        if n is None:
            self.eval_samples_known = False
        else:
            self.eval_samples += n
            self.eval_last_size = n
        if self.awaiting_first_batch:
            self._first_batch(it, t0 + dt)

    def _begin_evaluation(self, t: int, detected_by: str) -> None:
        self.eval_start = t
        self.eval_detected_by = detected_by
        self.eval_batches = self.eval_samples = self.eval_wait = 0
        self.eval_samples_known = True
        self.eval_last_size = None
        self.eval_last = t

    def _end_evaluation(self, t_end: int, ended_by: str) -> None:
        """Record the evaluation under way as ending at ``t_end`` (perf_counter_ns); the part
        of it after the last step boundary leaves the wall time of the step under way."""
        start = self.eval_start
        self.eval_start = None
        if self.boundary is not None and ended_by != "process-end":
            self.eval_ns += max(0, t_end - max(start, self.boundary))
        ago_s = (_perf_ns() - start) / 1e9
        self.event(
            "evaluation",
            {
                "step": self.step,  # the training step it came before
                "seconds": max(0, t_end - start) / 1e9,
                "batches": self.eval_batches,
                "samples": self.eval_samples if self.eval_samples_known else None,
                "data_wait_s": self.eval_wait / 1e9,
                "detected_by": self.eval_detected_by,
                "ended_by": ended_by,
            },
            t=_now() - ago_s,
        )

    def _settle_evaluation_at_step(self) -> None:
        """An evaluation is still open at an optimizer step: no training data came after it."""
        if self.prev_step_fed is False:
            # The job trains without a DataLoader and evaluates with one: the evaluation ended
            # somewhere before this step; its last batch is the last thing seen of it.
            self._end_evaluation(self.eval_last, "last-evaluation-batch")
            return
        # Otherwise its batches were this step's own (fetched under no_grad, or an extra
        # loader's complete pass inside the step): count them in as any batch.
        if self.boundary is None:
            self.boundary = self.eval_start
        self.eval_start = None
        self.batches += self.eval_batches
        self.samples += self.eval_samples
        self.data_wait += self.eval_wait
        if self.eval_last_size is not None:
            self.last_batch_size = self.eval_last_size
        if self.eval_batches:
            self.loader_seen = True

    def on_step(self, optimizer) -> None:
        now = _perf_ns()
        t_end = _now_ns()
        if self.role == "dataloader-worker":
            return
        if self.eval_start is not None:
            self._settle_evaluation_at_step()
        last = self.last_optimizer() if self.last_optimizer is not None else None
        if last is not optimizer:
            if last is not None and self.loader_seen and not self.batches:
                return  # another optimizer (GAN, multi-task) on the same batch: the same step
            self.last_optimizer = _weakref_ref(optimizer)
        if self.boundary_kind != "optimizer":
            # Backward passes before it were parts of this step (gradient accumulation).
            self.held_steps = []
            self.held_mark = None
            if self.boundary_kind is None:
                self.boundary_kind = "optimizer"
                self.setting("steps.boundary", "optimizer")
        if self.threads_override_pending:
            self._apply_threads_override()
        if not self.settings_done:
            self.settings_done = True
            self.step_thread = _get_ident()
            self._capture_settings(optimizer)
        self._close_step(now, t_end)

    def _step_row(self, now: int, t_end: int, boundary: int) -> list:
        row = [
            self.step,
            t_end,
            now - boundary - self.eval_ns,
            self.data_wait,
            self.last_batch_size,
            self.samples or None,
            self.autocast_dtype,
            self.scaler_used,
        ]
        if self.cuda_seen or self.cuda_is_initialized():
            cuda = self._cuda_step_stats()
            if cuda is not None:
                row.extend(cuda)
        extra = self.distributed.step_values(now) if self.distributed is not None else None
        if extra is not None:
            row.extend([None] * (_AGENT_STEP_VALUES - len(row)))
            row.extend(extra)
        return row

    def on_backward(self) -> None:
        """A top-level backward pass ended: a step boundary unless an optimizer ends steps."""
        if self.boundary_kind == "optimizer" or self.role == "dataloader-worker":
            return
        if self.step_thread is not None and _get_ident() != self.step_thread:
            return
        now = _perf_ns()
        t_end = _now_ns()
        if self.eval_start is not None:
            self._settle_evaluation_at_step()
        if self.boundary_kind == "backward":
            self._close_step(now, t_end)
            return
        # Not known yet: hold a candidate step, the figures since the last candidate.
        mark = self.held_mark
        if mark is None:
            start = self.boundary if self.boundary is not None else self.start_ns
            mark = (start, 0, 0, 0, 0)
        t0, wait0, samples0, _, eval0 = mark
        row = self._step_row(now, t_end, t0)
        row[2] = now - t0 - (self.eval_ns - eval0)
        row[3] = self.data_wait - wait0
        row[5] = (self.samples - samples0) or None
        self.held_steps.append(row)
        # The AMP flags stay: an optimizer step that discards the candidates reads them.
        self.held_mark = (now, self.data_wait, self.samples, self.batches, self.eval_ns)
        if len(self.held_steps) >= BACKWARD_STEPS_TO_DECIDE:
            self._steps_end_at_backward()

    def _steps_end_at_backward(self, at_exit: bool = False) -> None:
        """No optimizer steps the loop: record the held candidates as its steps."""
        self.boundary_kind = "backward"
        self.setting("steps.boundary", "backward")
        if not self.settings_done:
            self.settings_done = True
            self.step_thread = _get_ident()
            self._capture_settings(None)
        held, self.held_steps = self.held_steps, []
        for row in held:
            row[0] = self.step
            self.steps.append(row)
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
            self._after_step(mark[0] if mark is not None else _perf_ns())

    def _close_step(self, now: int, t_end: int) -> None:
        boundary = self.boundary if self.boundary is not None else self.start_ns
        self.steps.append(self._step_row(now, t_end, boundary))
        self.step += 1
        self.boundary = now
        self.prev_step_fed = self.batches > 0
        self.data_wait = 0
        self.samples = 0
        self.batches = 0
        self.eval_ns = 0
        self.autocast_dtype = None
        self.scaler_used = False
        if self.distributed is not None:
            self.distributed.step_closed()
        self._after_step(now)

    def _after_step(self, now: int) -> None:
        if len(self.steps) >= FLUSH_MAX_STEPS or now - self.last_flush >= _FLUSH_INTERVAL_NS:
            self.flush()
        if self.stop_after is not None and self.step >= self.stop_after and not self.stopping:
            self.stopping = True
            self.event("stopped-after-steps", {"steps": self.step, "status": STOPPED_EXIT_STATUS})
            self.flush(final=True)
            raise SystemExit(STOPPED_EXIT_STATUS)

    def _capture_settings(self, optimizer) -> None:
        """The job's settings at its first step; ``optimizer`` is None when backward passes
        end the steps."""
        torch = self.torch
        self._refresh_rank()
        self.setting("process.role", self.role)
        self.setting("torch.version", torch.__version__)
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            self.setting(f"env.{name}", os.environ.get(name))
        self._capture_volatile()
        if optimizer is not None:
            self._capture_optimizer(optimizer)
        self.setting("amp.autocast", self.autocast_dtype)
        self.setting("amp.grad_scaler", self.scaler_used)
        self.setting("distributed.rank", self.rank)
        self.setting("distributed.local_rank", _env_int("LOCAL_RANK"))
        self.setting("distributed.world_size", _env_int("WORLD_SIZE"))
        self.setting("distributed.backend", self._dist_backend())

    def _capture_optimizer(self, optimizer) -> None:
        self.setting("optimizer.class", _qualname(optimizer))
        defaults = getattr(optimizer, "defaults", {}) or {}
        self.setting("optimizer.foreach", defaults.get("foreach"))
        self.setting("optimizer.fused", defaults.get("fused"))
        seen: set[int] = set()
        count = nbytes = 0
        devices: set[str] = set()
        dtypes: set[str] = set()
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) in seen:
                    continue
                seen.add(id(p))
                numel = p.numel()
                count += numel
                nbytes += numel * p.element_size()
                devices.add(str(p.device))
                dtypes.add(str(p.dtype).replace("torch.", ""))
        self.setting("optimizer.param_groups", len(optimizer.param_groups))
        self.setting("params.count", count)
        self.setting("params.bytes", nbytes)
        self.setting("params.devices", sorted(devices))
        self.setting("params.dtypes", sorted(dtypes))

    def _capture_volatile(self) -> None:
        import warnings

        torch = self.torch
        backends = torch.backends
        # Reading some flags warns about their successors in newer torch: the user's stderr
        # must not change, so warnings are silenced for these reads only.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            values = {
                "torch.num_threads": torch.get_num_threads(),
                "torch.num_interop_threads": torch.get_num_interop_threads(),
                "matmul.float32_precision": torch.get_float32_matmul_precision(),
                "matmul.allow_tf32": bool(backends.cuda.matmul.allow_tf32),
                "cudnn.allow_tf32": bool(backends.cudnn.allow_tf32),
                "cudnn.benchmark": bool(backends.cudnn.benchmark),
                "cudnn.deterministic": bool(backends.cudnn.deterministic),
            }
        for key in _VOLATILE_SETTINGS:
            self.setting(key, values[key])

    def _refresh_rank(self) -> None:
        if self.rank is not None:
            return
        dist = getattr(self.torch, "distributed", None)
        try:
            if dist is not None and dist.is_available() and dist.is_initialized():
                self.rank = dist.get_rank()
        except Exception:
            pass

    def _dist_backend(self) -> str | None:
        dist = getattr(self.torch, "distributed", None)
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return None
        return str(dist.get_backend())

    # -- DataLoaders --------------------------------------------------------------------------

    def on_loader_created(self, loader) -> None:
        dataset = loader.dataset
        try:
            dataset_len = len(dataset)
        except Exception:
            dataset_len = None  # IterableDataset without __len__, or a failing __len__
        sampler = getattr(loader, "batch_sampler", None) or getattr(loader, "sampler", None)
        sampler_type = type(loader.sampler).__name__ if loader.sampler is not None else None
        if sampler is not None and getattr(loader, "batch_size", None) is None:
            sampler_type = type(sampler).__name__
        record = {
            "loader_id": self.next_loader_id,
            "t": _now(),
            "batch_size": loader.batch_size,
            "num_workers": loader.num_workers,
            "pin_memory": bool(loader.pin_memory),
            "persistent_workers": bool(loader.persistent_workers),
            "prefetch_factor": loader.prefetch_factor if loader.num_workers > 0 else None,
            "drop_last": bool(loader.drop_last),
            "multiprocessing_context": _start_method(loader),
            "dataset_type": _qualname(dataset),
            "dataset_len": dataset_len,
            "sampler_type": sampler_type,
            "first_batch_s": None,
        }
        info = _LoaderInfo(self.next_loader_id, record, loader.batch_size)
        self.next_loader_id += 1
        object.__setattr__(loader, "_torchdoctor_info", info)
        self.pending_loaders.append(info)

    def on_loader_iter(self, loader, it, t_iter: int) -> None:
        info = loader.__dict__.get("_torchdoctor_info")
        if info is None:
            # Built before the agent was installed (watch() started after the DataLoader).
            self.on_loader_created(loader)
            info = loader.__dict__["_torchdoctor_info"]
        detail = {"loader_id": info.loader_id, "epoch": info.epochs, "step": self.step}
        if self.step_thread is None or _get_ident() == self.step_thread:
            if not self.grad_enabled():
                if self.eval_start is None:
                    self._begin_evaluation(t_iter, "grad-disabled")
                it.__dict__["_torchdoctor_batch_size"] = info.batch_size
                detail["evaluation"] = True
            else:
                if self.eval_start is not None:
                    self._end_evaluation(t_iter, "training-data")
                self.loader_batch_size = info.batch_size
                it.__dict__["_torchdoctor_pass"] = _PassStart(self, t_iter)  # _evaluation_pass
        else:
            self.loader_batch_size = info.batch_size
        self.event("epoch-start", detail)
        info.epochs += 1
        if not info.sent and "_torchdoctor_first" not in it.__dict__:
            it.__dict__["_torchdoctor_first"] = (info, t_iter)
            self.awaiting_first_batch += 1

    def _emit_loader(self, info: _LoaderInfo) -> None:
        if info.sent:
            return
        info.sent = True
        if info in self.pending_loaders:
            self.pending_loaders.remove(info)
        record = info.record
        if record["num_workers"] > 0 and record["multiprocessing_context"] is None:
            import multiprocessing

            # Workers have started by now, so this is the method they were started with.
            record["multiprocessing_context"] = multiprocessing.get_start_method(allow_none=True)
        self.loaders.append(record)

    def _emit_pending_loaders(self) -> None:
        for info in list(self.pending_loaders):
            self._emit_loader(info)

    def apply_loader_overrides(self, init, args: tuple, kwargs: dict):
        """Return (args, kwargs, changes) for DataLoader.__init__ with tune's overrides."""
        import inspect

        bound = inspect.signature(init).bind(*args, **kwargs)
        arguments = bound.arguments
        changes = {}
        user_workers = arguments.get("num_workers", 0)
        iterable = isinstance(arguments.get("dataset"), self.torch.utils.data.IterableDataset)
        for key in _DATALOADER_OVERRIDES:
            if key not in self.overrides:
                continue
            if key == "num_workers" and iterable and user_workers == 0:
                # An IterableDataset that was never split across workers would yield every
                # sample once per worker: more workers would change what the job trains on.
                self.event("override-skipped", {"num_workers": "iterable dataset, no workers"})
                continue
            arguments[key] = self.overrides[key]
            changes[key] = self.overrides[key]
        if not changes:
            return args, kwargs, changes
        if arguments.get("num_workers", 0) == 0:
            # Multiprocessing-only options are rejected without workers.
            arguments["prefetch_factor"] = None
            arguments["persistent_workers"] = False
        return bound.args, bound.kwargs, changes

    # -- DataLoader workers -------------------------------------------------------------------

    def enter_worker(self, worker_id, num_workers) -> None:
        self.role = "dataloader-worker"
        self.threads_override_pending = False
        self.event("dataloader-worker-start", {"worker_id": worker_id, "ppid": os.getppid()})
        self.setting("process.role", self.role)
        self.setting("dataloader.worker_id", worker_id)
        self.setting("dataloader.num_workers", num_workers)
        self.setting("dataloader.parent_pid", os.getppid())
        import multiprocessing

        self.setting("dataloader.start_method", multiprocessing.get_start_method(allow_none=True))
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            self.setting(f"env.{name}", os.environ.get(name))

    def on_set_num_threads(self) -> None:
        self.setting("torch.num_threads", self.torch.get_num_threads())
        if self.role == "dataloader-worker":
            self.flush(final=True)  # a worker's settings are all it ever sends

    # -- CUDA ---------------------------------------------------------------------------------

    def _cuda_initialized(self) -> bool:
        return self.cuda_is_initialized()

    def _on_cuda_seen(self) -> None:
        self.cuda_seen = True
        attach = getattr(self.torch._C, "_cuda_attach_out_of_memory_observer", None)
        if attach is not None and not self.oom_observer:
            self.oom_observer = True
            try:
                attach(_make_oom_observer(self))
            except Exception as exc:
                # Some allocator back-ends (cudaMallocAsync, pluggable) have no observers:
                # an uncaught OOM is still recorded by the excepthook.
                self.event("cuda-oom-observer-unavailable", {"error": f"{exc}"[:300]})

    def _cuda_step_stats(self):
        if not self.cuda_seen:
            self._on_cuda_seen()
        if not self.cuda_stats_ok:
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
            self.cuda_stats_ok = False
            self.event("cuda-stats-unavailable", {"error": f"{type(exc).__name__}: {exc}"})
            return None

    def on_cuda_oom(self, device, requested, allocated, free) -> None:
        self.oom_recorded_step = self.step
        self.event(
            "cuda-oom",
            {
                "step": self.step,
                "batch_size": self.last_batch_size,
                "device": device,
                "requested_bytes": requested,
                "allocated_bytes": allocated,
                "free_bytes": free,
                "source": "allocator",
            },
        )
        self.flush(final=True)

    def on_uncaught(self, exc_type) -> None:
        if exc_type.__name__ != "OutOfMemoryError" or self.oom_recorded_step == self.step:
            return
        detail = {"step": self.step, "batch_size": self.last_batch_size, "source": "uncaught"}
        if self._cuda_initialized():
            cuda = self.torch.cuda
            detail["allocated_bytes"] = cuda.memory_allocated()
            detail["reserved_bytes"] = cuda.memory_reserved()
            detail["max_allocated_bytes"] = cuda.max_memory_allocated()
        self.event("cuda-oom", detail)
        self.flush(final=True)

    # -- shipping -----------------------------------------------------------------------------

    def flush(self, final: bool = False) -> None:
        """Send what is buffered to every sink; at most FLUSH_MAX_STEPS steps per message."""
        now = self.last_flush = _perf_ns()
        if self.active and self.settings_done and now - self.last_volatile >= _VOLATILE_EVERY_NS:
            self.last_volatile = now
            import contextlib

            with contextlib.suppress(Exception):
                self._capture_volatile()
        if not (self.steps or self.loaders or self.settings or self.events):
            if final:
                for sink in self.sinks:
                    _close_sink(sink)
            return
        steps, self.steps = self.steps, []
        loaders, self.loaders = self.loaders, []
        settings, self.settings = self.settings, []
        events, self.events = self.events, []
        header = {"v": WIRE_VERSION, "pid": self.pid, "rank": self.rank, "role": self.role}
        chunks = [steps[i : i + FLUSH_MAX_STEPS] for i in range(0, len(steps), FLUSH_MAX_STEPS)]
        messages = []
        for i, chunk in enumerate(chunks or [[]]):
            msg = dict(header)
            msg["step_fields"] = STEP_FIELDS
            msg["steps"] = chunk
            if i == 0:
                msg["dataloaders"] = loaders
                msg["settings"] = settings
                msg["events"] = events
            messages.append(msg)
        for sink in self.sinks:
            for msg in messages:
                sink(msg)
            if final:
                _close_sink(sink)

    def _end_open_evaluation(self) -> None:
        """The process ends after an evaluation (the one after the last step): record it."""
        if self.eval_start is not None and self.role != "dataloader-worker":
            self._end_evaluation(self.eval_last, "process-end")

    def _after_fork(self) -> None:
        # The child must never resend what the parent buffered, nor write on its connection.
        self._reset_process()
        self.role = "forked-child"

    def _at_exit(self) -> None:
        try:
            if self.active or self.events:
                if self.held_steps and self.active:
                    self._steps_end_at_backward(at_exit=True)  # no optimizer step came
                self._end_open_evaluation()
                self._emit_pending_loaders()
                self.flush(final=True)
        except Exception:
            pass


def _close_sink(sink) -> None:
    close = getattr(sink, "close", None)
    if close is not None:
        close()


def _start_method(loader) -> str | None:
    context = loader.multiprocessing_context
    return context.get_start_method() if context is not None else None


def _in_multiprocessing_child() -> bool:
    import multiprocessing

    parent = getattr(multiprocessing, "parent_process", None)
    return parent is not None and parent() is not None


def _guess_role() -> str:
    argv0 = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if argv0 == "torchrun" or sys.argv[0].endswith(os.path.join("distributed", "run.py")):
        return "launcher"
    if _in_multiprocessing_child():
        return "multiprocessing-child"  # a spawned DataLoader worker says so when it starts
    if _env_int("RANK") is not None:
        return "rank"
    return "trainer"


def _load_sibling(name: str):
    """A module of this folder loaded by path (standard library only), as the bootstrap loads
    this one: the job's Python need not have torchdoctor installed."""
    key = f"_torchdoctor_{name}"
    module = sys.modules.get(key)
    if module is None:
        from importlib.machinery import SourceFileLoader

        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
        loader = SourceFileLoader(key, path)
        module = type(sys)(key)
        module.__file__ = path
        module.__loader__ = loader
        sys.modules[key] = module
        try:
            loader.exec_module(module)
        except BaseException:
            del sys.modules[key]
            raise
    return module


_MAPPING: type = dict  # collections.abc.Mapping once torch is there (imported lazily)


def _batch_len(batch, tensor_type) -> int | None:
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
        elif kind is dict or isinstance(batch, _MAPPING):
            if not batch:
                return None
            batch = next(iter(batch.values()))
        else:
            return None
    return None


# -- the hooks ------------------------------------------------------------------------------
# Each hook checks ``agent.active`` first so that a disabled agent costs one attribute read,
# and catches every exception of its own so that none reaches the user's code.


def _make_iterator_next(agent: Agent, original):
    def __next__(self):
        if not agent.active:
            return original(self)
        t0 = _perf_ns()
        try:
            batch = original(self)
        except BaseException:
            if agent.active:
                try:
                    agent.on_exhausted(self, t0, _perf_ns() - t0)
                except Exception as exc:
                    agent.disable("dataloader-next", exc)
            raise
        dt = _perf_ns() - t0
        if agent.active:
            try:
                agent.on_batch(self, batch, t0, dt)
            except Exception as exc:
                agent.disable("dataloader-next", exc)
        return batch

    __next__.__wrapped__ = original
    return __next__


def _make_dataloader_iter(agent: Agent, original):
    def __iter__(self):
        if not agent.active:
            return original(self)
        t0 = _perf_ns()
        it = original(self)
        if agent.active:
            try:
                agent.on_loader_iter(self, it, t0)
            except Exception as exc:
                agent.disable("dataloader-iter", exc)
        return it

    __iter__.__wrapped__ = original
    return __iter__


def _make_dataloader_init(agent: Agent, original):
    def __init__(self, *args, **kwargs):
        if not agent.active:
            return original(self, *args, **kwargs)
        applied = None
        if agent.overrides and agent.role != "dataloader-worker":
            try:
                new_args, new_kwargs, applied = agent.apply_loader_overrides(
                    original, (self, *args), kwargs
                )
            except Exception as exc:
                agent.disable("dataloader-overrides", exc)
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
            try:
                agent.on_loader_created(self)
                if applied:
                    agent.event(
                        "override-applied",
                        {"loader_id": agent.next_loader_id - 1, **applied},
                    )
                    if agent.threads_override_pending:
                        agent._apply_threads_override()
            except Exception as exc:
                agent.disable("dataloader-init", exc)
        return None

    __init__.__wrapped__ = original
    return __init__


def _make_worker_loop(agent: Agent, original):
    def _worker_loop(*args, **kwargs):
        if agent.active:
            try:
                import inspect

                bound = inspect.signature(original).bind(*args, **kwargs).arguments
                agent.enter_worker(bound.get("worker_id"), bound.get("num_workers"))
            except Exception as exc:
                agent.disable("dataloader-worker", exc)
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


def _make_set_num_threads(agent: Agent, original):
    def set_num_threads(n):
        if not agent.active:
            return original(n)
        requested = n
        try:
            wanted = agent.overrides.get("num_threads")
            if wanted is not None and agent.role != "dataloader-worker":
                if n != wanted:
                    agent.event("override-applied", {"num_threads": wanted, "requested": n})
                n = wanted
        except Exception as exc:
            agent.disable("set-num-threads", exc)
            n = requested
        result = original(n)
        try:
            agent.on_set_num_threads()
        except Exception as exc:
            agent.disable("set-num-threads", exc)
        return result

    set_num_threads.__wrapped__ = original
    set_num_threads.__doc__ = original.__doc__
    set_num_threads.__name__ = "set_num_threads"
    return set_num_threads


def _make_autocast_enter(agent: Agent, original):
    def __enter__(self):
        result = original(self)
        if agent.active:
            try:
                if self._enabled:
                    agent.autocast_dtype = str(self.fast_dtype).replace("torch.", "")
            except Exception as exc:
                agent.disable("autocast", exc)
        return result

    __enter__.__wrapped__ = original
    return __enter__


def _make_scaler_scale(agent: Agent, original):
    def scale(self, outputs):
        if agent.active:
            try:
                if self._enabled:
                    agent.scaler_used = True
            except Exception as exc:
                agent.disable("grad-scaler", exc)
        return original(self, outputs)

    scale.__wrapped__ = original
    return scale


def _make_backward(agent: Agent, original):
    def backward(*args, **kwargs):
        if not agent.active:
            return original(*args, **kwargs)
        agent.backward_depth += 1  # a backward pass run from inside one is part of it
        try:
            result = original(*args, **kwargs)
        finally:
            agent.backward_depth -= 1
        if agent.active and not agent.backward_depth:
            try:
                agent.on_backward()
            except Exception as exc:
                agent.disable("backward", exc)
        return result

    backward.__wrapped__ = original
    backward.__doc__ = original.__doc__
    backward.__name__ = "backward"
    return backward


def _make_step_hook(agent: Agent):
    def torchdoctor_step_hook(optimizer, args, kwargs):
        if not agent.active:
            return
        try:
            agent.on_step(optimizer)
        except Exception as exc:
            agent.disable("optimizer-step", exc)

    return torchdoctor_step_hook


def _make_oom_observer(agent: Agent):
    def torchdoctor_oom_observer(device, requested, allocated, free):
        if not agent.active:
            return
        try:
            agent.on_cuda_oom(device, requested, allocated, free)
        except Exception as exc:
            agent.disable("cuda-oom", exc)

    return torchdoctor_oom_observer


def _make_excepthook(agent: Agent, previous):
    def excepthook(exc_type, exc, tb):
        if agent.active:
            import contextlib

            with contextlib.suppress(Exception):
                agent.on_uncaught(exc_type)
        return previous(exc_type, exc, tb)

    excepthook.__wrapped__ = previous
    return excepthook


class _TorchImportFinder:
    """A meta-path finder that lets the real finders load torch, then calls ``on_loaded``."""

    def __init__(self, on_loaded) -> None:
        self.on_loaded = on_loaded
        self._busy = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch" or self._busy:
            return None
        import importlib.util

        self._busy = True
        try:
            spec = importlib.util.find_spec("torch")
        except Exception:
            return None
        finally:
            self._busy = False
        if spec is None or spec.loader is None:
            return None
        spec.loader = _NotifyingLoader(spec.loader, self.on_loaded)
        return spec


class _NotifyingLoader:
    def __init__(self, loader, on_loaded) -> None:
        self._loader = loader
        self._on_loaded = on_loaded

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        # torch sees its own loader, as without torchdoctor.
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        self._on_loaded(module)

    def __getattr__(self, name):
        return getattr(self._loader, name)


AGENT = Agent()


def arm_from_env() -> bool:
    """Entry point of the bootstrap: arm the agent unless the environment says no."""
    if not AGENT.configure_from_env():
        return False
    AGENT.arm()
    return True
