"""The main thread's Python stack of a running job, sampled from outside, and the steps it shows.

`py-spy <https://github.com/benfred/py-spy>`_ reads the target's memory with
``process_vm_readv``; with ``--nonblocking`` it never stops the target (a sample may then be
torn, and is dropped). Nothing runs inside the job and nothing of it changes.

Each sample of the main thread is put in one phase of a training step by the outermost torch
frame on its stack: ``data`` (a DataLoader iterator's ``__next__``/``_next_data``), ``forward``
(``Module.__call__``), ``backward`` (``Tensor.backward``/``torch.autograd.backward``),
``optimizer`` (``Optimizer.step``) or ``sync`` (``torch.cuda.synchronize``); anything else is
``other``. A training loop goes through the phases in that order (data, forward, backward,
optimizer) and back: a sample whose phase comes *before* the previous one's starts a new step.
That is an estimate: a step is seen when at least two of its phases are sampled, so steps
shorter than a few sampling periods merge (the rate is chosen well above the step rate of the
slow jobs worth attaching to). Time in each phase is its samples times the period.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

DATA, FORWARD, BACKWARD, OPTIMIZER, SYNC, OTHER = (
    "data",
    "forward",
    "backward",
    "optimizer",
    "sync",
    "other",
)
# A step goes through these in this order; going back to an earlier one starts the next step.
_ORDER = {DATA: 0, FORWARD: 1, BACKWARD: 2, OPTIMIZER: 3}
DEFAULT_RATE_HZ = 200
CHUNK_S = 5.0  # py-spy writes its samples when it ends: one run per chunk keeps steps flowing


@dataclass(slots=True)
class EstimatedStep:
    """One step as the samples show it; times in seconds (``t_*`` wall-clock epoch)."""

    t_start: float
    t_end: float
    data_wait_s: float
    forward_s: float
    backward_s: float
    optimizer_s: float


@dataclass(slots=True)
class ChunkResult:
    """What one sampling run of the main thread showed."""

    t_start: float
    t_end: float
    samples: int
    steps: list[EstimatedStep] = field(default_factory=list)
    phase_s: dict[str, float] = field(default_factory=dict)
    optimizer_seen: bool = False
    loader_kind: str | None = None  # "single-process" / "multiprocessing" iterator, if seen
    pin_memory_thread: bool = False
    dataset_type: str | None = None  # qualname of the class whose __getitem__ ran


def py_spy_path() -> str | None:
    """py-spy beside this Python (the ``attach`` extra installs it), else on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "py-spy")
    if os.access(here, os.X_OK):
        return here
    return shutil.which("py-spy")


def phase_of(frames: list[dict[str, Any]]) -> str:
    """The step phase of one stack (outermost frame first): its outermost torch phase frame."""
    for frame in frames:
        name = frame.get("name") or ""
        path = frame.get("file") or ""
        if "torch" not in path:
            continue
        if "utils/data/dataloader" in path and (
            name.endswith("Iter.__next__") or name.endswith("._next_data")
        ):
            return DATA
        if path.endswith("nn/modules/module.py") and name.endswith("_call_impl"):
            return FORWARD
        if (path.endswith("torch/_tensor.py") and name.endswith(".backward")) or (
            path.endswith("autograd/__init__.py") and name == "backward"
        ):
            return BACKWARD
        if "torch/optim/" in path and (name.endswith(".step") or name.endswith("wrapper")):
            return OPTIMIZER
        if "torch/cuda/" in path and name == "synchronize":
            return SYNC
    return OTHER


def main_profile(data: dict[str, Any], pid: int) -> dict[str, Any] | None:
    """The main thread's profile in py-spy's speedscope output (its thread id is the PID)."""
    profiles = data.get("profiles") or []
    for profile in profiles:
        name = str(profile.get("name", ""))
        if name.startswith(f"Thread {pid} ") or "MainThread" in name:
            return profile
    return None


def analyse(data: dict[str, Any], pid: int, t_end: float) -> ChunkResult:
    """Steps and phase times of a speedscope document py-spy wrote for ``pid``; ``t_end`` is
    when sampling ended (py-spy's times are relative to its start)."""
    frames = data.get("shared", {}).get("frames", [])
    profile = main_profile(data, pid)
    span = float(profile.get("endValue", 0.0)) if profile else 0.0
    result = ChunkResult(t_start=t_end - span, t_end=t_end, samples=0)
    for other in data.get("profiles") or []:
        if other is profile:
            continue
        names = {frames[i].get("name") for stack in other.get("samples", [])[:50] for i in stack}
        if any(n and n.endswith("_pin_memory_loop") for n in names):
            result.pin_memory_thread = True
    if profile is None:
        return result
    stacks = profile.get("samples", [])
    weights = profile.get("weights", [])
    result.samples = len(stacks)
    t = result.t_start
    phase_s = dict.fromkeys((DATA, FORWARD, BACKWARD, OPTIMIZER, SYNC, OTHER), 0.0)
    current: dict[str, float] | None = None  # phase times of the step under way
    start = 0.0
    last_order = None
    for stack, weight in zip(stacks, weights, strict=False):
        stack_frames = [frames[i] for i in stack]
        phase = phase_of(stack_frames)
        phase_s[phase] += weight
        if phase == OPTIMIZER:
            result.optimizer_seen = True
        if phase == DATA:
            _loader_facts(result, stack_frames)
        order = _ORDER.get(phase)
        if order is not None:
            if last_order is not None and order < last_order:
                if current is not None:
                    result.steps.append(_step(start, t, current))
                current = dict.fromkeys(_ORDER, 0.0)
                start = t
            last_order = order
        if current is not None and phase in current:
            current[phase] += weight
        t += weight
    result.phase_s = phase_s
    return result


def _step(start: float, end: float, phases: dict[str, float]) -> EstimatedStep:
    return EstimatedStep(
        t_start=start,
        t_end=end,
        data_wait_s=phases[DATA],
        forward_s=phases[FORWARD],
        backward_s=phases[BACKWARD],
        optimizer_s=phases[OPTIMIZER],
    )


def _loader_facts(result: ChunkResult, frames: list[dict[str, Any]]) -> None:
    for frame in frames:
        name = frame.get("name") or ""
        if name.startswith("_SingleProcessDataLoaderIter."):
            result.loader_kind = "single-process"
        elif name.startswith("_MultiProcessingDataLoaderIter."):
            result.loader_kind = "multiprocessing"
        elif name.endswith(".__getitem__") and result.dataset_type is None:
            result.dataset_type = name.rsplit(".", 1)[0]


class StackSampler:
    """Samples the main thread of ``pid`` in chunks of ``chunk_s`` on a thread of its own and
    hands each chunk's :class:`ChunkResult` to ``on_chunk`` (from that thread).

    Ends when :meth:`stop` is called or the process ends; ``error`` then says why it could not
    sample, if it could not."""

    def __init__(
        self,
        pid: int,
        on_chunk: Callable[[ChunkResult], None],
        *,
        rate_hz: int = DEFAULT_RATE_HZ,
        chunk_s: float = CHUNK_S,
        py_spy: str | None = None,
    ) -> None:
        self.pid = pid
        self.on_chunk = on_chunk
        self.rate_hz = rate_hz
        self.chunk_s = chunk_s
        self.py_spy = py_spy or py_spy_path()
        self.error: str | None = None
        self.chunks = 0
        self._stop = threading.Event()
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._dir = tempfile.mkdtemp(prefix="torchdoctor-stacks-")
        self._thread = threading.Thread(target=self._loop, name="torchdoctor-stacks", daemon=True)

    def start(self) -> StackSampler:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """End the chunk under way early (py-spy writes what it has on SIGINT) and wait."""
        self._stop.set()
        with self._lock:
            proc = self._proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGINT)
        self._thread.join(timeout)
        shutil.rmtree(self._dir, ignore_errors=True)

    def _loop(self) -> None:
        if self.py_spy is None:
            self.error = "py-spy is not installed"
            return
        n = 0
        while not self._stop.is_set() and os.path.exists(f"/proc/{self.pid}"):
            out = os.path.join(self._dir, f"chunk{n}.json")
            n += 1
            argv = [
                self.py_spy,
                "record",
                "--pid",
                str(self.pid),
                "--rate",
                str(self.rate_hz),
                "--duration",
                str(max(1, round(self.chunk_s))),
                "--nonblocking",
                "--idle",
                "--format",
                "speedscope",
                "--output",
                out,
            ]
            with self._lock:
                if self._stop.is_set():
                    break
                self._proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                )
            _, err = self._proc.communicate()
            ended = time.time()
            code = self._proc.returncode
            with self._lock:
                self._proc = None
            try:
                with open(out, encoding="utf-8") as f:
                    data = json.load(f)
            except (OSError, ValueError):
                if os.path.exists(f"/proc/{self.pid}") and not self._stop.is_set():
                    self.error = _last_line(err) or f"py-spy exited with status {code}"
                return
            os.unlink(out)
            self.chunks += 1
            self.on_chunk(analyse(data, self.pid, ended))


def _last_line(err: bytes | None) -> str:
    lines = [line.strip() for line in (err or b"").decode(errors="replace").splitlines()]
    lines = [line for line in lines if line]
    return lines[-1] if lines else ""
