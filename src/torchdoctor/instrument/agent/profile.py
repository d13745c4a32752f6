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

REQUEST_FILE = "request.json"  # `torchdoctor profile JOB` writes it into ENV_PROFILE_DIR
MAX_ACTIVE_STEPS = 50
# Estimated uncompressed JSON a window may write per rank (a 1 GB trace is too much to read).
TRACE_CAP_BYTES = 200 * 2**20
# Chrome-trace JSON per recorded event: ~1.3 KB per CPU op, 2.2 KB with shapes (measured on
# torch 2.13 CPU, shared/reference/profiler.md 4.3); a GPU trace's kernels and runtime calls
# weigh less, so the CPU figure bounds it.
BYTES_PER_EVENT = 2200
EVENT = "profile-window"

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
    if first < 2:
        # Step A-1 is the warm-up and the window starts at the boundary where it begins: the
        # first boundary of a process is the end of its step 0.
        raise ValueError(f"profile steps {text!r}: the first step must be 2 or more")
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

    @property
    def warmup(self) -> int:
        return self.first - 1

    def marks(self, step: int) -> bool:
        """Whether step ``step`` is one the window touched (warm-up through the closing step)."""
        return self.state != "pending" and self.warmup <= step <= self.last + 1

    def steps_until_start(self, step: int) -> int:
        """Boundaries until the warm-up begins, from ``step`` (the step under way)."""
        return self.warmup - step

    # -- the step boundary ------------------------------------------------------------------

    def boundary(self, step: int) -> None:
        """Step ``step`` begins (the one before it just ended), on the training thread."""
        if step == self.handled_step:
            return  # the full path and a flush both report the same boundary
        self.handled_step = step
        try:
            self._boundary(step)
        except Exception as exc:  # never the job's problem: the window ends here
            self.fail(f"{type(exc).__name__}: {exc}")

    def _boundary(self, step: int) -> None:
        state = self.state
        if state == "pending":
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
        fit = max(1, TRACE_CAP_BYTES // per_step)
        if self.last - self.first + 1 > fit:
            self.last = self.first + fit - 1
            self.result = "cut"
            self.reason = (
                f"window cut to steps {self.first}-{self.last}: the warm-up step recorded "
                f"{events} events, ~{per_step / 2**20:.1f} MiB of trace a step, and a window "
                f"writes at most {TRACE_CAP_BYTES // 2**20} MiB"
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
        with contextlib.suppress(Exception):
            self._unwrap_sync_points()
        with contextlib.suppress(Exception):
            self._stop()
        self.state = "over"
        self._finish()

    def end_of_process(self) -> None:
        """The process ends inside the window: write what was recorded (state ``cut``)."""
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
        torch_dir = self.torch_dir
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
                    while frame is not None and frame.f_code.co_filename.startswith(torch_dir):
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
    return ProfileWindow(agent, first, last, folder, "run")


class RequestWatch:
    """``TORCHDOCTOR_PROFILE_DIR/request.json``, looked at every flush (one ``stat``): a request
    of ``torchdoctor profile`` arms a window once per request id."""

    def __init__(self, folder: str) -> None:
        self.path = os.path.join(folder, REQUEST_FILE)
        self.folder = folder
        self.seen_mtime: int | None = None
        self.done_ids: set[str] = set()

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
        except (OSError, ValueError, KeyError, TypeError):
            return  # half written (it is renamed into place) or not ours: the next flush
        if request_id in self.done_ids:
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
        if agent.step > window.warmup:
            window.fail(f"step {window.warmup} had begun when the request arrived")
            return
        agent.profile = window


def _save_action():
    from torch.profiler import ProfilerAction

    return ProfilerAction.RECORD_AND_SAVE
