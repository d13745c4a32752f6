"""The agent's state in one process: lifecycle (configure, arm, install, uninstall, disable),
the registry of what it patched, the record buffers and their flush, fork and exit.

What happens at a step, a batch or an evaluation lives in the parts :mod:`.hooks` builds once
torch is imported (:mod:`.steps`, :mod:`.loaders`, :mod:`.cuda`); this module loads at every
Python start-up and holds only what a process that never imports torch needs.
"""

import atexit
import os
import sys

from . import TorchImportFinder
from .contract import (
    ENV_COLLECTOR,
    ENV_NO_INSTRUMENT,
    ENV_OVERRIDES,
    ENV_PROFILE_DIR,
    ENV_PROFILE_STEPS,
    ENV_STOP_AFTER_STEPS,
    FLUSH_INTERVAL_NS,
    FLUSH_MAX_STEPS,
    FORKED_CHILD,
    SHORT_STEP_VALUES,
    STEP_FIELDS,
    STOPPED_EXIT_STATUS,
    TRAINER,
    VOLATILE_EVERY_NS,
    WIRE_VERSION,
    WORKER,
    dumps,
    env_flag,
    env_int,
    message_steps,
    now,
    now_ns,
    pack_steps,
    parse_overrides,
    perf_ns,
)
from .sink import SocketSink, close_sink


class Agent:
    """Per-process state of the instrumentation. One instance: ``AGENT``."""

    # Slots: the hooks read the agent's attributes at every batch and step, and CPython keeps
    # an instance's attribute values inline (its fast path) only up to ~30 names; a slot is
    # read as fast whatever their number. __dict__ stays for what tests attach. The four the
    # compiled path reads at every batch and step come first: side by side in the object, they
    # share a cache line or two (cold ones, in the job's loop).
    __slots__ = (
        "active", "steps", "flush_max_steps", "last_flush",
        "armed", "disabled_reason", "torch", "sinks", "overrides", "stop_after",
        "_patches", "_hook_handle", "_fork_registered", "_atexit_registered", "_finder",
        "distributed", "counter", "loader_state", "cuda",
        "pid", "rank", "role", "loaders", "settings", "events", "settings_done",
        "setting_values", "last_volatile", "threads_override_pending", "stopping",
        "profile", "profile_watch", "profile_env",
        "__dict__",
    )  # fmt: skip

    def __init__(self) -> None:
        self.flush_max_steps = FLUSH_MAX_STEPS  # steps buffered before a flush
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
        self.distributed = None  # ranks.RankInstrument in a torchrun rank
        # A torch.profiler window (profile.ProfileWindow) and the watch on `torchdoctor
        # profile`'s requests, built at install from profile_env: (steps, folder) as read.
        self.profile_env: tuple[str | None, str | None] = (None, None)
        self.profile_watch = None
        # The parts that exist once torch is imported (built by hooks.install).
        self.counter = None  # steps.StepCounter: step boundaries, waits, samples, evaluations
        self.loader_state = None  # loaders.Loaders: DataLoader records and first batches
        self.cuda = None  # cuda.CudaMemory: per-step memory figures, out-of-memory events
        self._reset_process()

    # -- per-process state ------------------------------------------------------------------

    def _reset_process(self) -> None:
        self.pid = os.getpid()
        self.rank = env_int("RANK")
        self.role = TRAINER
        self.steps: list[list] = []
        self.loaders: list[dict] = []
        self.settings: list[list] = []
        self.events: list[list] = []
        self.settings_done = False
        self.setting_values: dict[str, str] = {}
        self.last_flush = perf_ns()
        self.last_volatile = 0
        self.threads_override_pending = False
        self.stopping = False
        # A window is the process's own: a forked child does not inherit its parent's.
        self.profile = None
        for part in (self.counter, self.loader_state, self.cuda):
            if part is not None:
                part.reset()

    @property
    def step(self) -> int:
        """Steps this process has ended so far (the next step's index)."""
        return self.counter.step if self.counter is not None else 0

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
        self.profile_env = (environ.get(ENV_PROFILE_STEPS), environ.get(ENV_PROFILE_DIR))
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
        self._finder = TorchImportFinder(self._install_guarded)
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
            # Loaded only now: most processes of a job never import torch.
            from . import hooks

            hooks.install(self, torch)
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
        self._end_profile_window()
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
            self._end_profile_window()
        with contextlib.suppress(Exception):
            self._restore_patches()
        try:
            self.event("instrumentation-disabled", {"where": where, "error": self.disabled_reason})
            self.flush(final=True)
        except Exception:
            pass

    # -- the patch registry -------------------------------------------------------------------

    def patch(self, owner, name: str, replacement) -> None:
        """Set ``owner.name`` to ``replacement``, remembering the original for uninstall."""
        original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        self._patches.append((owner, name, original, replacement))
        setattr(owner, name, replacement)

    def original(self, owner, name: str):
        """What ``owner.name`` was before the agent patched it (the current value if not)."""
        for patched, patched_name, original, _ in self._patches:
            if patched is owner and patched_name == name:
                return original
        return getattr(owner, name)

    def _restore_patches(self) -> None:
        import contextlib

        while self._patches:
            owner, name, original, replacement = self._patches.pop()
            current = owner.__dict__.get(name) if isinstance(owner, type) else None
            if current is None:
                current = getattr(owner, name, None)
            if current is not replacement:
                continue  # someone patched over us since: theirs stays (ours is inert now)
            with contextlib.suppress(Exception):
                setattr(owner, name, original)
        if self.distributed is not None:
            self.distributed, rank_hooks = None, self.distributed
            with contextlib.suppress(Exception):
                rank_hooks.uninstall()
        handle, self._hook_handle = self._hook_handle, None
        if handle is not None:
            with contextlib.suppress(Exception):
                handle.remove()

    # -- records ------------------------------------------------------------------------------

    def event(self, kind: str, detail: dict, t: float | None = None) -> None:
        self.event_json(kind, dumps(detail), t)

    def event_json(self, kind: str, detail: str, t: float | None = None) -> None:
        """An event whose detail is already JSON. A DataLoader pass's epoch-start writes its
        few integers with an f-string: the JSON encoder, cold between a training loop's
        passes, costs ~17 µs a call there."""
        self.events.append([now() if t is None else t, kind, detail])

    def setting(self, key: str, value) -> None:
        encoded = dumps(value)
        if self.setting_values.get(key) == encoded:
            return
        self.setting_values[key] = encoded
        self.settings.append([now(), key, encoded])

    def after_step(self, t: int) -> None:
        """A step was recorded: flush when due, stop when TORCHDOCTOR_STOP_AFTER_STEPS says."""
        window = self.profile
        if window is not None:
            # A step boundary: the compiled and short paths come here when a flush is due,
            # and flush() makes one due where a pending window starts (see _profile_flush).
            window.boundary(self.counter.step)
        buffered = len(self.steps) + self.counter.pending_rows  # the compiled path's kept too
        if buffered >= self.flush_max_steps or t - self.last_flush >= FLUSH_INTERVAL_NS:
            self.flush()
        stop_after = self.stop_after
        if stop_after is not None and self.counter.step >= stop_after and not self.stopping:
            self.stopping = True
            self.event(
                "stopped-after-steps", {"steps": self.counter.step, "status": STOPPED_EXIT_STATUS}
            )
            self.flush(final=True)
            raise SystemExit(STOPPED_EXIT_STATUS)

    # -- shipping -----------------------------------------------------------------------------

    def flush(self, final: bool = False) -> None:
        """Send what is buffered to every sink, in messages of at most ``message_steps`` steps."""
        t = self.last_flush = perf_ns()
        counter = self.counter
        if self.profile_watch is not None or self.profile is not None:
            self._profile_flush(counter)
        if self.active and self.settings_done and t - self.last_volatile >= VOLATILE_EVERY_NS:
            self.last_volatile = t
            import contextlib

            from . import settings

            with contextlib.suppress(Exception):
                settings.capture_volatile(self)
        kept = counter.pending_rows if counter is not None else 0
        if not (self.steps or kept or self.loaders or self.settings or self.events):
            if final:
                for sink in self.sinks:
                    close_sink(sink)
            return
        # The steps as (count, columns) per message. The compiled path's steps come as numbers
        # and are packed there; rows of the full path (and any kept steps after them) here.
        parts: list[tuple[int, list]] = []
        if self.steps:
            if kept:
                counter.drain_rows(self.steps)
            steps, self.steps = self.steps, []
            size = message_steps(max(map(len, steps)))
            for i in range(0, len(steps), size):
                chunk = steps[i : i + size]
                parts.append((len(chunk), pack_steps(chunk)))
        else:
            size = message_steps(SHORT_STEP_VALUES)
            while counter is not None and counter.pending_rows:
                count = min(size, counter.pending_rows)
                parts.append((count, counter.pack_rows(count)))
        loaders, self.loaders = self.loaders, []
        settings_rows, self.settings = self.settings, []
        events, self.events = self.events, []
        header = {"v": WIRE_VERSION, "pid": self.pid, "rank": self.rank, "role": self.role}
        # Step ends are perf_counter_ns (one clock read per step): the offset to UNIX time,
        # read now, goes with them.
        header["clock_offset_ns"] = now_ns() - perf_ns()
        messages = []
        for i, (count, columns) in enumerate(parts or [(0, [])]):
            msg = dict(header)
            msg["step_fields"] = STEP_FIELDS
            msg["step_count"] = count
            msg["step_columns"] = columns
            if i == 0:
                msg["dataloaders"] = loaders
                msg["settings"] = settings_rows
                msg["events"] = events
            messages.append(msg)
        for sink in self.sinks:
            for msg in messages:
                sink(msg)
            if final:
                close_sink(sink)

    def _profile_flush(self, counter) -> None:
        """At a flush: look for a `torchdoctor profile` request, and have the step paths call
        the agent (after_step) exactly at the boundary where a pending window starts: the
        steps buffered until then is what makes the next flush due."""
        watch = self.profile_watch
        if watch is not None and counter is not None and not self.stopping:
            try:
                watch.poll(self)
            except Exception:  # noqa: BLE001 - a request not read, never the job's problem
                self.profile_watch = None
        window = self.profile
        wanted = FLUSH_MAX_STEPS
        if window is not None and window.state == "pending" and counter is not None:
            wanted = max(1, min(FLUSH_MAX_STEPS, window.steps_until_start(counter.step)))
        self.flush_max_steps = wanted

    def _end_profile_window(self) -> None:
        window = self.profile
        if window is not None:
            window.end_of_process()

    def _end_open_evaluation(self) -> None:
        """The process ends after an evaluation (the one after the last step): record it."""
        counter = self.counter
        if counter is not None and counter.evaluation is not None and self.role != WORKER:
            counter.end_evaluation(counter.evaluation.last, "process-end")

    def _emit_pending_loaders(self) -> None:
        if self.loader_state is not None:
            self.loader_state.emit_pending()

    def _after_fork(self) -> None:
        # The child must never resend what the parent buffered, nor write on its connection.
        self._reset_process()
        self.role = FORKED_CHILD

    def _at_exit(self) -> None:
        try:
            if self.active and self.profile is not None:
                self._end_profile_window()
            if self.active or self.events:
                counter = self.counter
                if counter is not None and counter.held_steps and self.active:
                    counter.steps_end_at_backward(at_exit=True)  # no optimizer step came
                self._end_open_evaluation()
                self._emit_pending_loaders()
                if self.active and self.cuda is not None:
                    import contextlib

                    # run --memory-history: the end's snapshot; lost, never the final flush
                    with contextlib.suppress(Exception):
                        self.cuda.on_exit()
                self.flush(final=True)
        except Exception:
            pass
