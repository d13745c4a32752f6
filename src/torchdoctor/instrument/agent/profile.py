"""A torch.profiler window over a few steps, armed by torchdoctor: no change to the job's code.

The contract with the recorder side (issue 42, part A; part B parses the trace):

- ``torchdoctor run --profile-steps A-B -- CMD`` sets ``TORCHDOCTOR_PROFILE_STEPS=A-B`` and,
  for every instrumented job, ``TORCHDOCTOR_PROFILE_DIR`` = the recording's path without
  ``.sqlite`` plus ``.profile``. ``launch`` and the queue pass the same variables when they are
  in their environment.
- On the training thread, at the step boundary where step ``A-1`` begins, the agent starts
  ``torch.profiler.profile`` (CPU activities, CUDA too when ``torch.cuda.is_available()``,
  ``record_shapes=True``, ``with_stack=False``) with one warm-up step (``A-1``) and the active
  steps ``A..B`` (at most :data:`MAX_ACTIVE_STEPS`), calls ``step()`` at each step boundary
  and, after step ``B``, exports the Chrome trace gzipped to
  ``<TORCHDOCTOR_PROFILE_DIR>/rank<R>-steps<A>-<B>.pt.trace.json.gz`` (``R``: ``RANK`` or 0).
  ``ProfilerStep#N`` in the trace is the job's step ``N`` (the recording's ``steps.step``).
- The warm-up step is recorded too, as a cycle of its own that is never exported: its event
  count is the size estimate. When ``events x BYTES_PER_EVENT x active steps`` would pass
  :data:`TRACE_CAP_BYTES`, the window ends earlier (state ``cut``, its reason the one line).
- During the active steps only, the host-device sync points (``Tensor.item``, ``.cpu``,
  ``.tolist``, ``.nonzero``, ``torch.cuda.synchronize``, ``Tensor.__repr__``/``__format__``,
  i.e. printing a tensor) are wrapped: per call site (the first frame outside torch: file,
  line, function) a count and the seconds spent in the call. The originals are put back when
  the window ends; a job without a window never has them wrapped.
- The window ends as one ``profile-window`` event (detail: ``first_step``, ``last_step``,
  ``warmup_step``, ``started_at``, ``ended_at``, ``trace_path``, ``trace_bytes``, ``state``
  ``done``/``cut``/``failed``, ``reason``, ``sites`` [[op, file, line, function, count,
  total_s], ...]). The recorder writes it into the recording's ``profile_windows`` and
  ``profile_sync_sites`` tables and, for a trace written (``done`` or ``cut``), calls
  ``torchdoctor.recording.profiles.ingest_window(writer, window_id, trace_path)`` where that
  module exists.
- Steps ``A-1`` (warm-up) to ``B+1`` (the step the export stalls) carry the ``profiled`` step
  field: every step statistic leaves them out.
- ``torchdoctor profile JOB --steps N`` writes ``request.json`` ({"id", "first_step",
  "last_step"}) into ``TORCHDOCTOR_PROFILE_DIR``; the agent looks at it at each flush (every
  half second) and arms a window from it once per request id. Every rank reads the same file,
  so every rank arms at the same step.

Never in the job's way: a failure of the profiler (or of this module) ends the window (state
``failed``, the reason recorded once); the job and the rest of the agent go on.
"""

from __future__ import annotations

import os
import sys

from .contract import ENV_PROFILE_DIR, ENV_PROFILE_STEPS, now, perf_ns

# Overrides TRACE_CAP_BYTES (bytes of JSON a window may write per process).
ENV_PROFILE_MAX_BYTES = "TORCHDOCTOR_PROFILE_MAX_BYTES"
REQUEST_FILE = "request.json"  # `torchdoctor profile JOB` writes it into ENV_PROFILE_DIR
MAX_ACTIVE_STEPS = 50
# Estimated uncompressed JSON a window may write per rank (a 1 GB trace is too much to read).
TRACE_CAP_BYTES = 200 * 2**20
# Chrome-trace JSON per event the warm-up recorded: 360 B with shapes on a CPU MLP (66 KB for
# 182 events a step, shared/reference/profiler.md 4.3), 250-450 B on real GPU traces; the
# export adds flow and metadata events, so a margin over the largest.
BYTES_PER_EVENT = 600
EVENT = "profile-window"
WAITING = ("pending", "armed")  # a window's states before its warm-up step begins

# The sync points wrapped during a window: (owner, attribute) on torch.Tensor, and torch.cuda.
TENSOR_SYNC_OPS = ("item", "cpu", "tolist", "nonzero", "__repr__", "__format__")


def parse_steps(text: str) -> tuple[int, int]:
    """``A-B`` (or ``A``) as (first, last); ValueError saying what is wrong."""
    head, sep, tail = text.strip().partition("-")
    try:
        first = int(head)
        last = int(tail) if sep else first
    except ValueError:
        raise ValueError(f"profile steps {text!r}: expected A-B, two step numbers") from None
    if first < 3:
        # Step A-1 is the warm-up, and the agent wraps the optimizer at the boundary before
        # it (see ProfileWindow.boundary): the first boundary of a process ends its step 0.
        raise ValueError(f"profile steps {text!r}: the first step must be 3 or more")
    if last < first:
        raise ValueError(f"profile steps {text!r}: the last step comes before the first")
    if last - first + 1 > MAX_ACTIVE_STEPS:
        raise ValueError(f"profile steps {text!r}: at most {MAX_ACTIVE_STEPS} steps")
    return first, last


class ProfileWindow:
    """One window of one process: pending until its warm-up step begins, then recording, then
    ``closing`` (the step after the last, stalled by the export), then over."""

    def __init__(self, agent, first: int, last: int, folder: str | None, source: str) -> None:
        self.agent = agent
        self.first = first
        self.last = last
        self.requested_last = last
        self.folder = folder
        self.source = source  # "run" (the environment) or "request" (`torchdoctor profile`)
        self.state = "pending"  # -> "recording" -> "closing" -> "over"
        self.prof = None
        self.started_at: float | None = None
        self.ended_at: float | None = None
        self.trace_path: str | None = None
        self.trace_bytes: int | None = None
        self.result = "done"
        self.reason: str | None = None
        self.estimate_bytes: int | None = None
        self.handled_step = -1
        self.sites: dict[tuple, list] = {}
        self.sync_patches: list[tuple[object, str, object, bool]] = []
        self.sync_depth = 0
        self.torch_dir = ""
        self.cap_bytes = TRACE_CAP_BYTES
        # Optimizers whose step() runs the window's transitions once it returns:
        # (optimizer, its own instance attribute "step" or None, our wrapper).
        self.wrapped: list[tuple[object, object, object]] = []
        self.due: int | None = None  # a boundary waiting for the optimizer's step() to return

    @property
    def warmup(self) -> int:
        return self.first - 1

    def marks(self, step: int) -> bool:
        """Whether step ``step`` is one the window touched (warm-up through the closing step)."""
        return self.state not in WAITING and self.warmup <= step <= self.last + 1

    def steps_until_start(self, step: int) -> int:
        """Boundaries until the agent must see one, from ``step`` (the step under way): the
        one before the warm-up's, where the optimizer is wrapped (see boundary)."""
        return self.warmup - 1 - step

    # -- the step boundary ------------------------------------------------------------------

    def boundary(self, step: int) -> None:
        """Step ``step`` begins (the one before it just ended), on the training thread."""
        if step == self.handled_step:
            return  # the full path and a flush both report the same boundary
        self.handled_step = step
        try:
            counter = self.agent.counter
            if counter is not None and counter.boundary_kind == "optimizer":
                self._at_optimizer_boundary(step, counter)
            else:
                self._boundary(step)
        except Exception as exc:  # never the job's problem: the window ends here
            self.fail(f"{type(exc).__name__}: {exc}")

    def _at_optimizer_boundary(self, step: int, counter) -> None:
        """A boundary seen in the optimizer's step post-hook, i.e. inside torch's
        ``record_function("Optimizer.step#...")``: starting or stopping torch.profiler there
        crashes torch 2.13 now and then (a segfault in ``_disable_profiler``, measured), so the
        transition waits until the optimizer's ``step()`` returns (:meth:`_wrap_optimizer`),
        which is installed one boundary before the warm-up's."""
        if self.state == "pending" and step < self.warmup - 1:
            return
        if self.state == "pending" and step >= self.warmup:
            self._boundary(step)  # too late: fails without touching the profiler
            return
        optimizer = counter.last_optimizer() if counter.last_optimizer is not None else None
        if optimizer is None:
            raise RuntimeError("no optimizer to profile the steps of")
        if self.due is not None:
            raise RuntimeError(
                f"step {self.due} began inside an optimizer step() called around torchdoctor's "
                "wrapper: the window cannot start or stop safely there"
            )
        self._wrap_optimizer(optimizer)
        if self.state == "pending":
            self.state = "armed"  # every step takes the full path from here (steps.py)
            counter.fast = False
            return
        self.due = step

    def _wrap_optimizer(self, optimizer) -> None:
        for wrapped, _, _ in self.wrapped:
            if wrapped is optimizer:
                return
        own = optimizer.__dict__.get("step")  # an LR scheduler's wrapper, or None
        bound = optimizer.step
        window = self

        def step(*args, **kwargs):
            result = bound(*args, **kwargs)
            window.after_optimizer_step()
            return result

        step.__wrapped__ = bound
        optimizer.step = step
        self.wrapped.append((optimizer, own, step))

    def after_optimizer_step(self) -> None:
        """The optimizer's step() returned: run the boundary it saw (outside torch's
        record_function)."""
        due, self.due = self.due, None
        if due is None:
            return
        try:
            self._boundary(due)
        except Exception as exc:  # never the job's problem: the window ends here
            self.fail(f"{type(exc).__name__}: {exc}")

    def _unwrap_optimizers(self) -> None:
        wrapped, self.wrapped = self.wrapped, []
        for optimizer, own, ours in wrapped:
            if optimizer.__dict__.get("step") is not ours:
                continue  # wrapped over since: ours stays, and passes the call on
            if own is None:
                del optimizer.step
            else:
                optimizer.step = own

    def _boundary(self, step: int) -> None:
        state = self.state
        if state in WAITING:
            if step == self.warmup:
                self._start()
            elif step > self.warmup:
                self.fail(f"step {self.warmup} had begun before the window was armed")
            return
        if state == "recording":
            prof = self.prof
            if step > self.last and prof.current_action != _save_action():
                # Cut while step() had already asked the schedule for this step: save now.
                prof.current_action = _save_action()
            if step == self.first:
                import warnings

                with warnings.catch_warnings():
                    # The warm-up's own cycle ends here, as planned: torch warns that a
                    # cycle's end clears its events, which is the point.
                    warnings.filterwarnings("ignore", "Warning: Profiler clears events")
                    prof.step()
            else:
                prof.step()  # exports after the last step (on_trace_ready)
            if step == self.first:
                self._wrap_sync_points()
            elif step > self.last:
                self._unwrap_sync_points()
                self._stop()
                self.state = "closing"
            return
        if state == "closing" and step > self.last + 1:
            self.state = "over"
            self._finish()

    def _start(self) -> None:
        torch = sys.modules["torch"]
        import torch.profiler as tp

        self.torch_dir = os.path.dirname(torch.__file__) + os.sep
        activities = [tp.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(tp.ProfilerActivity.CUDA)
        prof = tp.profile(
            activities=activities,
            schedule=self._schedule,
            on_trace_ready=self._trace_ready,
            record_shapes=True,
            with_stack=False,
        )
        # ProfilerStep#N is the job's step N: the schedule reads absolute step numbers.
        action = self._schedule(self.warmup)
        prof.step_num = self.warmup
        prof.current_action = action
        if hasattr(prof, "_prev_schedule_action"):
            prof._prev_schedule_action = action
        self.started_at = now()
        self.state = "recording"
        self.prof = prof
        counter = self.agent.counter
        if counter is not None:
            counter.fast = False  # every step of the window takes the full path (steps.py)
        prof.start()

    def _schedule(self, step: int):
        from torch.profiler import ProfilerAction

        if step == self.warmup:
            # The warm-up is a cycle of its own, recorded and measured, never exported: its
            # event count sizes the window (see _trace_ready).
            return ProfilerAction.RECORD_AND_SAVE
        if self.first <= step < self.last:
            return ProfilerAction.RECORD
        if step == self.last:
            return ProfilerAction.RECORD_AND_SAVE
        return ProfilerAction.NONE

    def _trace_ready(self, prof) -> None:
        if self.estimate_bytes is None:
            self._size_window(prof)
            return
        folder = self.folder
        if not folder:
            raise RuntimeError(f"{ENV_PROFILE_DIR} is not set: nowhere to write the trace")
        os.makedirs(folder, exist_ok=True)
        rank = self.agent.rank if self.agent.rank is not None else 0
        path = os.path.join(folder, f"rank{rank}-steps{self.first}-{self.last}.pt.trace.json.gz")
        prof.export_chrome_trace(path)  # a .gz path is written gzipped
        self.trace_path = path
        self.trace_bytes = os.path.getsize(path)

    def _size_window(self, prof) -> None:
        """The warm-up cycle ended: its events say how many active steps fit under the cap."""
        results = getattr(prof.profiler, "kineto_results", None)
        events = len(results.events()) if results is not None else 0
        per_step = max(1, events) * BYTES_PER_EVENT
        self.estimate_bytes = per_step
        fit = max(1, self.cap_bytes // per_step)
        if self.last - self.first + 1 > fit:
            self.last = self.first + fit - 1
            self.result = "cut"
            self.reason = (
                f"window cut to steps {self.first}-{self.last}: the warm-up step recorded "
                f"{events} events, ~{_size(per_step)} of trace a step, and a window writes "
                f"at most {_size(self.cap_bytes)}"
            )

    def _stop(self) -> None:
        prof, self.prof = self.prof, None
        if prof is None:
            return
        prof.stop()
        import torch.autograd.profiler as ap

        tracker = getattr(ap, "KinetoStepTracker", None)
        if tracker is not None:
            tracker.erase_step_count("ProfilerStep")

    # -- the end ----------------------------------------------------------------------------

    def fail(self, reason: str) -> None:
        """End the window now, recorded as failed with ``reason``; the job goes on."""
        import contextlib

        self.result = "failed"
        self.reason = reason[:500]
        self.due = None
        with contextlib.suppress(Exception):
            self._unwrap_sync_points()
        with contextlib.suppress(Exception):
            self._stop()
        self.state = "over"
        self._finish()

    def end_of_process(self) -> None:
        """The process ends inside the window: write what was recorded (state ``cut``)."""
        if self.state in WAITING:
            counter = self.agent.counter
            stepped = counter.step if counter is not None else 0
            if not stepped:
                # Never stepped (torchrun's launcher, a helper process): not a training
                # process, so no window of its own to report.
                self.state = "over"
                self._unwrap_optimizers()
                if self.agent.profile is self:
                    self.agent.profile = None
                return
            self.fail(f"the process ended at step {stepped}, before the window's warm-up")
            return
        if self.state == "recording":
            if self.handled_step >= self.first:
                self.last = max(self.first, self.handled_step - 1)
                self.result = "cut"
                self.reason = f"the process ended during step {self.handled_step}"
                try:
                    self._unwrap_sync_points()
                    prof, self.prof = self.prof, None
                    prof.stop()  # stopping a recording cycle exports it (on_trace_ready)
                except Exception as exc:
                    self.fail(f"{type(exc).__name__}: {exc}")
                    return
            else:
                self.fail(f"the process ended during the warm-up step {self.warmup}")
                return
        if self.state != "over":
            self.state = "over"
            self._finish()

    def _finish(self) -> None:
        import contextlib

        with contextlib.suppress(Exception):
            self._unwrap_optimizers()
        self.ended_at = now()
        agent = self.agent
        if agent.profile is self:
            agent.profile = None
        detail = {
            "source": self.source,
            "first_step": self.first,
            "last_step": self.last,
            "requested_last_step": self.requested_last,
            "warmup_step": self.warmup,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "trace_path": self.trace_path,
            "trace_bytes": self.trace_bytes,
            "estimated_bytes_per_step": self.estimate_bytes,
            "state": "failed" if self.trace_path is None else self.result,
            "reason": self.reason,
            "sites": [
                [*key, count, total_ns / 1e9] for key, (count, total_ns) in self.sites.items()
            ],
        }
        if detail["state"] == "failed" and detail["reason"] is None:
            detail["reason"] = "no trace was written"
        agent.event(EVENT, detail)
        counter = agent.counter
        if counter is not None:
            counter._refresh_fast()

    # -- the sync points --------------------------------------------------------------------

    def _wrap_sync_points(self) -> None:
        torch = sys.modules["torch"]
        owners = [(torch.Tensor, name) for name in TENSOR_SYNC_OPS]
        owners.append((torch.cuda, "synchronize"))
        for owner, name in owners:
            original = getattr(owner, name, None)
            if original is None:
                continue
            own = name in owner.__dict__
            wrapper = self._sync_wrapper(name, original)
            setattr(owner, name, wrapper)
            self.sync_patches.append((owner, name, original if own else None, own))

    def _unwrap_sync_points(self) -> None:
        patches, self.sync_patches = self.sync_patches, []
        for owner, name, original, own in reversed(patches):
            if own:
                setattr(owner, name, original)
            else:
                # Inherited (TensorBase's C methods): take ours away, the base's shows again.
                delattr(owner, name)

    def _sync_wrapper(self, op: str, original):
        window = self
        sites = self.sites
        # The caller is the first frame in neither torch nor this agent (the optimizer's
        # step() runs through the agent's wrapper during a window).
        skipped = (self.torch_dir, os.path.dirname(os.path.abspath(__file__)) + os.sep)
        getframe = sys._getframe

        def sync_point(*args, **kwargs):
            if window.sync_depth:  # inside another sync point (repr calls item, tolist)
                return original(*args, **kwargs)
            window.sync_depth += 1
            t0 = perf_ns()
            try:
                return original(*args, **kwargs)
            finally:
                dt = perf_ns() - t0
                window.sync_depth -= 1
                try:
                    frame = getframe(1)
                    while frame is not None and frame.f_code.co_filename.startswith(skipped):
                        frame = frame.f_back
                    if frame is not None:
                        code = frame.f_code
                        key = (op, code.co_filename, frame.f_lineno, code.co_name)
                        entry = sites.get(key)
                        if entry is None:
                            sites[key] = [1, dt]
                        else:
                            entry[0] += 1
                            entry[1] += dt
                except Exception:  # noqa: BLE001 - a site not counted, never the user's call
                    pass

        sync_point.__wrapped__ = original
        sync_point.__name__ = getattr(original, "__name__", op)
        sync_point.__doc__ = getattr(original, "__doc__", None)
        return sync_point


def from_environment(agent, environ) -> ProfileWindow | None:
    """The window ``TORCHDOCTOR_PROFILE_STEPS`` asks for (None: none); a bad value is recorded
    as a failed window's event and nothing is armed."""
    text = environ.get(ENV_PROFILE_STEPS)
    if not text:
        return None
    folder = environ.get(ENV_PROFILE_DIR) or None
    try:
        first, last = parse_steps(text)
    except ValueError as exc:
        agent.event(EVENT, {"source": "run", "state": "failed", "reason": str(exc)})
        return None
    window = ProfileWindow(agent, first, last, folder, "run")
    cap = environ.get(ENV_PROFILE_MAX_BYTES)
    if cap:
        import contextlib

        with contextlib.suppress(ValueError):  # not a number: the default cap
            window.cap_bytes = max(1, int(cap))
    return window


class RequestWatch:
    """``TORCHDOCTOR_PROFILE_DIR/request.json``, looked at every flush (one ``stat``): a request
    of ``torchdoctor profile`` arms a window once per request id."""

    def __init__(self, folder: str) -> None:
        self.path = os.path.join(folder, REQUEST_FILE)
        self.folder = folder
        self.seen_mtime: int | None = None
        self.done_ids: set[str] = set()
        # A request older than this process was for the processes before it (a restarted
        # rank must not arm a window meant for the steps of its predecessor).
        self.since = now()

    def poll(self, agent) -> None:
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except OSError:
            return
        if mtime == self.seen_mtime:
            return
        self.seen_mtime = mtime
        import json

        try:
            with open(self.path, encoding="utf-8") as fh:
                request = json.load(fh)
            request_id = str(request["id"])
            first, last = int(request["first_step"]), int(request["last_step"])
            asked_at = float(request.get("requested_at") or 0.0)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return  # not a request of ours: the next one replaces it
        if request_id in self.done_ids or asked_at < self.since:
            return
        self.done_ids.add(request_id)
        if agent.profile is not None:
            agent.event(
                EVENT,
                {"source": "request", "state": "failed", "reason": "a window is already armed"},
            )
            return
        last = min(last, first + MAX_ACTIVE_STEPS - 1)
        window = ProfileWindow(agent, first, last, self.folder, "request")
        if agent.step >= window.warmup:
            window.fail(f"step {window.warmup} had begun when the request arrived")
            return
        agent.profile = window


def _save_action():
    from torch.profiler import ProfilerAction

    return ProfilerAction.RECORD_AND_SAVE


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"
