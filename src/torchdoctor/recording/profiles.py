"""Profiler windows: a torch.profiler trace parsed, in bounded memory, into tables of the recording.

The agent writes one gzipped Chrome trace per rank and window (``export_chrome_trace``); the
recorder calls :func:`ingest_window` on it, and the rules read the result through
:func:`read_profiles`. The trace is never loaded whole (``json.load`` takes ~5x the file's size
in memory, HTA ~30x): the ``traceEvents`` array is decoded one event at a time with
``json.JSONDecoder.raw_decode`` over a sliding text buffer, and only aggregates are kept:

* per profiled step (``ProfilerStep#N``) the time in CPU ops (self time), in Python between
  top-level ops, in synchronisations, copies and communication, the op count and, on GPU
  traces, GPU busy / idle with HTA's split of idle time (host wait, kernel wait, other) -
  table ``profile_steps``;
* the ops with the most self time, with their input shapes and dtypes (top
  :data:`TOP_OPS` per window) - ``profile_ops``; the GPU kernels likewise - ``profile_kernels``;
* what the trace was (events, device, compute capability) - ``profile_traces``.

What grows with the trace is bounded: two heaps that put events back in time order
(:data:`REORDER_EVENTS` each), the per-thread op stacks, the distinct (op, shapes) keys (capped
at :data:`MAX_OP_KEYS`) and 24 bytes per GPU launch (its correlation id, start and duration, in
``array`` columns). A 1 GB trace parses in well under 64 MiB (benchmarks/profile_parse.py).

The tables live outside the sampled schema (``schema.TABLES``): they are made when the first
window is ingested, so a recording without them (older, or never profiled) opens as before.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import gzip
import heapq
import json
import re
import sqlite3
import time
import zlib
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from torchdoctor.recording.reader import damaged

TOP_OPS = 50  # ops (and kernels) kept per window, by self time
MAX_OP_KEYS = 20_000  # distinct (op, shapes, dtypes) tracked; past that, shapes are dropped
REORDER_EVENTS = 4_096  # events held to put the file's order back into time order (per heap)
CHUNK_CHARS = 1 << 20  # text decoded per read
MAX_EVENT_CHARS = 64 << 20  # one event larger than this is a damaged file, not an event
# HTA's rules (shared/reference/profiler.md section 2): a gap shorter than this between two
# kernels whose launch came in time is "kernel wait" (launch overhead); documented as ns,
# compared against microseconds in HTA's code (the effective unit, verified there).
KERNEL_WAIT_US = 30.0
SHORT_LAUNCH_US = 50.0  # a "short kernel": launch <= 50 us and the kernel shorter than it

# Host-device synchronisations. On a GPU trace the runtime call is the sync (it is what waits);
# on a CPU trace the op that would sync on a device (its outermost, so item ->
# _local_scalar_dense counts once).
SYNC_RUNTIME = frozenset(
    {
        "cudaDeviceSynchronize",
        "cudaStreamSynchronize",
        "cudaEventSynchronize",
        "cudaMemcpy",
        "cudaMemcpy2D",
        "cuCtxSynchronize",
        "cuStreamSynchronize",
        "hipDeviceSynchronize",
        "hipStreamSynchronize",
        "hipMemcpy",
    }
)
SYNC_OPS = frozenset({"aten::item", "aten::_local_scalar_dense", "aten::is_nonzero"})
COPY_OPS = frozenset({"aten::copy_", "aten::to", "aten::_to_copy"})
_COMM_OP = re.compile(r"^(nccl|gloo|c10d|mpi|ucc)[:_]|^c10d::|ProcessGroup|^record_param_comms")
_COMM_KERNEL = re.compile(r"^nccl|ncclKernel|^ncclDevKernel|^hccl|^rccl", re.I)
_MEMORY_KERNEL = re.compile(r"^(hip)?Memcpy|^(hip)?Memset|^dma", re.I)
_STEP = re.compile(r"ProfilerStep#(\d+)")
GPU_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
_WANTED = GPU_CATS | {"cpu_op", "user_annotation", "cuda_runtime", "cuda_driver"}
_NUMBER = (int, float)
# The optimizer's step counter lives on the CPU and is read with .item() on every step
# (AdamW: 20 of 23 item() calls in a 5-step window), and a Dataset's augmentations read CPU
# scalars in the DataLoader's __next__: inside these annotations an item() is not a sync of
# the user's training step.
_DATA = ("enumerate(DataLoader)#", "enumerate(DataPipe)#")
_NOT_USER_SYNC = (
    "Optimizer.step#",
    "Optimizer.zero_grad#",
    "enumerate(DataLoader)#",
    "enumerate(DataPipe)#",
)


class DamagedTrace(ValueError):
    """The trace cannot be read; the message is the one line the user sees."""


# -- tables ---------------------------------------------------------------------------------
STEP_COLUMNS: tuple[tuple[str, str], ...] = (
    ("window_id", "INTEGER"),
    ("step", "INTEGER"),
    ("t_start", "REAL"),  # UNIX seconds (the trace's baseTimeNanoseconds + ts)
    ("dur_s", "REAL"),  # the ProfilerStep span
    ("ops_s", "REAL"),  # self time of CPU ops
    ("python_s", "REAL"),  # in the step but in no top-level op, runtime call or data loading
    ("data_s", "REAL"),  # in the DataLoader's __next__ (its ops are not counted as ops)
    ("runtime_s", "REAL"),  # CUDA runtime calls (launches, syncs) outside ops' self time
    ("op_count", "INTEGER"),
    ("tiny_op_count", "INTEGER"),  # top-level ops under 20 us
    ("sync_count", "INTEGER"),
    ("sync_s", "REAL"),
    ("copy_s", "REAL"),
    ("comm_s", "REAL"),  # CPU side: communication ops' time (inclusive)
    ("kernel_count", "INTEGER"),
    ("short_kernel_count", "INTEGER"),
    ("gpu_busy_s", "REAL"),
    ("gpu_idle_s", "REAL"),
    ("idle_host_s", "REAL"),
    ("idle_kernel_s", "REAL"),
    ("idle_other_s", "REAL"),
    ("launch_delay_max_s", "REAL"),
    ("memcpy_s", "REAL"),
    ("memcpy_h2d_s", "REAL"),
    ("memcpy_bytes", "INTEGER"),
    ("pageable_h2d_count", "INTEGER"),
    ("pageable_h2d_bytes", "INTEGER"),
    ("comm_gpu_s", "REAL"),  # communication kernels' busy time
    ("comm_exposed_s", "REAL"),  # of which no compute kernel ran at the same time
)
OP_COLUMNS: tuple[tuple[str, str], ...] = (
    ("window_id", "INTEGER"),
    ("name", "TEXT"),
    ("input_dims", "TEXT"),  # JSON, from record_shapes; null without it
    ("input_types", "TEXT"),
    ("count", "INTEGER"),
    ("self_s", "REAL"),
    ("total_s", "REAL"),
    ("max_s", "REAL"),  # the longest call (inclusive): one preempted call shows here
)
KERNEL_COLUMNS: tuple[tuple[str, str], ...] = (
    ("window_id", "INTEGER"),
    ("name", "TEXT"),
    ("kind", "TEXT"),  # compute, memory or communication (HTA's classes)
    ("count", "INTEGER"),
    ("total_s", "REAL"),
    ("max_s", "REAL"),
)
TRACE_COLUMNS: tuple[tuple[str, str], ...] = (
    ("window_id", "INTEGER"),
    ("events", "INTEGER"),
    ("gpu", "INTEGER"),  # 1 when the trace holds GPU activity
    ("device_name", "TEXT"),
    ("compute_major", "INTEGER"),
    ("steps", "INTEGER"),
    ("parse_s", "REAL"),
    ("notes", "TEXT"),  # JSON list of what the parse could not place, one line each
)
PROFILE_TABLES: dict[str, tuple[tuple[str, str], ...]] = {
    "profile_steps": STEP_COLUMNS,
    "profile_ops": OP_COLUMNS,
    "profile_kernels": KERNEL_COLUMNS,
    "profile_traces": TRACE_COLUMNS,
}


def create_sql() -> list[str]:
    stmts = []
    for name, cols in PROFILE_TABLES.items():
        body = ", ".join(f'"{c}" {t}' for c, t in cols)
        stmts.append(f"CREATE TABLE IF NOT EXISTS {name} ({body})")
        stmts.append(f"CREATE INDEX IF NOT EXISTS {name}_w ON {name} (window_id)")
    return stmts


# -- reading the trace ----------------------------------------------------------------------
_WS = re.compile(r"[\s,]*")
_HEADER_LIMIT = 8 << 20  # text before "traceEvents" kept for the metadata


def _open_text(path: Path):
    try:
        with open(path, "rb") as probe:
            magic = probe.read(2)
    except OSError as exc:
        raise DamagedTrace(f"{path}: cannot open ({exc.strerror or exc})") from None
    if magic == b"\x1f\x8b":
        # errors="replace": invalid UTF-8 in a name (HTA PR #324) must not lose the trace.
        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")


def _read(f: Any, path: Path) -> str:
    try:
        return f.read(CHUNK_CHARS)
    except (EOFError, OSError, zlib.error) as exc:
        raise DamagedTrace(f"{path}: cannot decompress ({exc or 'cut short'})") from None


def iter_events(path: str | Path, header: dict[str, Any] | None = None) -> Iterator[Any]:
    """Each element of the trace's ``traceEvents`` array, decoded one at a time.

    ``header`` (if given) receives the top-level keys written before the array that are
    small enough to decode (``deviceProperties``, ``distributedInfo``, ``baseTimeNanoseconds``).
    Raises :class:`DamagedTrace` with one line naming the file and the event where reading
    failed."""
    path = Path(path)
    decoder = json.JSONDecoder()
    with _open_text(path) as f:
        buf = ""
        eof = False
        # Find the array; keep the text before it for the metadata.
        while True:
            k = buf.find('"traceEvents"')
            if k >= 0:
                m = re.compile(r'"traceEvents"\s*:\s*\[').match(buf, k)
                if m:
                    if header is not None:
                        _parse_header(buf[:k], header, decoder)
                    pos = m.end()
                    break
            if eof:
                raise DamagedTrace(f"{path}: not a Chrome trace (no traceEvents array)")
            if len(buf) > _HEADER_LIMIT:
                buf = buf[-_HEADER_LIMIT // 2 :]
            chunk = _read(f, path)
            eof = not chunk
            buf += chunk
        index = 0
        while True:
            m = _WS.match(buf, pos)
            pos = m.end()
            if pos >= len(buf):
                if eof:
                    raise DamagedTrace(f"{path}: cut short after event {index}")
                buf = buf[pos:]
                pos = 0
                chunk = _read(f, path)
                eof = not chunk
                buf += chunk
                continue
            if buf[pos] == "]":
                return
            try:
                event, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError as exc:
                if eof or len(buf) - pos > MAX_EVENT_CHARS:
                    where = "cut short" if eof else "an event too large"
                    raise DamagedTrace(
                        f"{path}: {where} at event {index} ({exc.msg})"
                        if not eof
                        else f"{path}: damaged at event {index} ({exc.msg})"
                    ) from None
                # The event runs past the buffer (or the text is bad: more text decides).
                buf = buf[pos:]
                pos = 0
                chunk = _read(f, path)
                eof = not chunk
                buf += chunk
                continue
            index += 1
            pos = end
            yield event
            if pos > CHUNK_CHARS and not eof:
                buf = buf[pos:]
                pos = 0
                chunk = _read(f, path)
                eof = not chunk
                buf += chunk


def _parse_header(text: str, header: dict[str, Any], decoder: json.JSONDecoder) -> None:
    for key in ("deviceProperties", "distributedInfo", "baseTimeNanoseconds"):
        m = re.search(rf'"{key}"\s*:\s*', text)
        if not m:
            continue
        with contextlib.suppress(ValueError):
            header[key] = decoder.raw_decode(text, m.end())[0]


def _step_spans(path: Path) -> list[tuple[int, float, float]]:
    """(step number, start us, end us) of each ProfilerStep#N on the CPU, in time order.

    A first pass that decodes only the step events, found by their name in the text (the
    decompression is most of its cost): every other event is then placed in its step as it is
    read. A step event this pass cannot decode is found again by the full pass
    (:func:`analyse_trace` compares)."""
    decoder = json.JSONDecoder()
    spans: dict[int, tuple[float, float]] = {}
    with _open_text(path) as f:
        buf = ""
        while True:
            chunk = _read(f, path)
            eof = not chunk
            buf += chunk
            pos = 0
            cut: int | None = None
            while True:
                k = buf.find("ProfilerStep#", pos)
                if k < 0:
                    break
                start = buf.rfind("{", 0, k)
                try:
                    event, end = decoder.raw_decode(buf, max(start, 0))
                except ValueError:
                    if not eof and len(buf) - start < MAX_EVENT_CHARS:
                        cut = start  # the event runs past the buffer: read more first
                        break
                    pos = k + 1
                    continue
                _add_step(event, spans)
                pos = max(k + 1, end)
            if eof:
                break
            # Keep a tail: a step's name may straddle two reads, its "{" just before it.
            buf = buf[cut if cut is not None else max(pos, len(buf) - 4096) :]
    return sorted(((n, s, e) for n, (s, e) in spans.items()), key=lambda x: x[1])


def _add_step(event: Any, spans: dict[int, tuple[float, float]]) -> bool:
    if type(event) is not dict or event.get("cat") != "user_annotation":
        return False
    m = _STEP.fullmatch(str(event.get("name", "")))
    span = _span(event)
    if m is None or span is None:
        return False
    spans[int(m.group(1))] = span
    return True


def _span(event: dict[str, Any]) -> tuple[float, float] | None:
    ts, dur = event.get("ts"), event.get("dur")
    if isinstance(ts, (int, float)) and isinstance(dur, (int, float)) and dur >= 0:
        return float(ts), float(ts) + float(dur)
    return None


# -- the analysis ---------------------------------------------------------------------------
@dataclass(slots=True)
class _Step:
    number: int
    start: float
    end: float
    ops_us: float = 0.0
    runtime_us: float = 0.0
    covered_us: float = 0.0
    data_us: float = 0.0
    cover_end: float = 0.0
    op_count: int = 0
    tiny_ops: int = 0
    cpu_syncs: int = 0
    cpu_sync_us: float = 0.0
    rt_syncs: int = 0
    rt_sync_us: float = 0.0
    copy_us: float = 0.0
    comm_us: float = 0.0
    kernels: int = 0
    short_kernels: int = 0
    busy_us: float = 0.0
    idle_host: float = 0.0
    idle_kernel: float = 0.0
    idle_other: float = 0.0
    delay_max: float = 0.0
    memcpy_us: float = 0.0
    h2d_us: float = 0.0
    memcpy_bytes: int = 0
    pageable: int = 0
    pageable_bytes: int = 0
    comm_gpu_us: float = 0.0
    comm_exposed_us: float = 0.0


@dataclass(slots=True)
class _Frame:
    end: float
    dur: float
    name: str
    key: Any
    step: _Step | None
    kind: int  # 0 op, 1 runtime
    child: float = 0.0
    sync: bool = False  # this frame or one around it is a counted sync op
    copy: bool = False
    comm: bool = False
    data: bool = False  # inside the DataLoader's __next__: the data's time, not the model's


@dataclass
class TraceAnalysis:
    """What one trace holds, reduced to the rows :func:`ingest_window` writes."""

    steps: list[_Step]
    ops: list[tuple[str, str | None, str | None, int, float, float, float]]
    kernels: list[tuple[str, str, int, float, float]]
    events: int
    gpu: bool
    device_name: str | None
    compute_major: int | None
    base_s: float
    notes: list[str] = field(default_factory=list)


class _Launches:
    """GPU launches by correlation id, 24 bytes each: ids are appended in increasing order
    by one launching thread, so a sorted array and bisect replace a dict of objects."""

    def __init__(self) -> None:
        self.corr = array("q")
        self.ts = array("d")
        self.dur = array("d")
        self.index: dict[int, int] | None = None  # only when ids came out of order

    def add(self, corr: int, ts: float, dur: float) -> None:
        if self.index is None and self.corr and corr <= self.corr[-1]:
            self.index = {c: i for i, c in enumerate(self.corr)}
        if self.index is not None:
            self.index[corr] = len(self.corr)
        self.corr.append(corr)
        self.ts.append(ts)
        self.dur.append(dur)

    def find(self, corr: int) -> int | None:
        if self.index is not None:
            return self.index.get(corr)
        i = bisect.bisect_left(self.corr, corr)
        if i < len(self.corr) and self.corr[i] == corr:
            return i
        return None


class _Analyzer:
    def __init__(self, steps: list[tuple[int, float, float]]) -> None:
        self.steps = [_Step(n, s, e) for n, s, e in steps]
        self.starts = [s.start for s in self.steps]
        self.stacks: dict[Any, list[_Frame]] = {}
        self.annotations: dict[Any, list[tuple[float, str]]] = {}
        self.cpu_heap: list[tuple] = []
        self.gpu_heap: list[tuple] = []
        self.seq = 0
        self.cpu_clock = float("-inf")
        self.launches = _Launches()
        self.ops: dict[Any, list[float]] = {}  # key -> [count, self, total]
        self.kernels: dict[str, list[Any]] = {}  # name -> [kind, count, total, max]
        self.names: dict[str, str] = {}  # interned names: one str per distinct op
        self.classes: dict[str, tuple[bool, bool, bool]] = {}  # name -> (sync, copy, comm)
        self.seen_steps: dict[int, tuple[float, float]] = {}
        self.events = 0
        self.gpu = False
        self.late = 0
        self.no_launch = 0
        # GPU sweep state (time-ordered GPU activity, all streams of the device).
        self.g_prev = float("-inf")
        self.g_any = float("-inf")
        self.g_compute = float("-inf")
        self.g_comm = float("-inf")
        self.g_step: _Step | None = None

    def step_at(self, ts: float) -> _Step | None:
        i = bisect.bisect_right(self.starts, ts) - 1
        if i >= 0 and ts < self.steps[i].end:
            return self.steps[i]
        return None

    # -- reading -----------------------------------------------------------------------
    def feed(self, event: Any) -> None:
        # Per event, the hot path of a parse: plain lookups, no helper calls where avoidable.
        if type(event) is not dict or event.get("ph") != "X":
            return
        self.events += 1
        cat = event.get("cat")
        if cat not in _WANTED:
            return  # python_function is most of a traced-with-stack file (HTA PR #110)
        ts, dur, name = event.get("ts"), event.get("dur"), event.get("name")
        if type(ts) not in _NUMBER or type(dur) not in _NUMBER or dur < 0 or type(name) is not str:
            return
        ts = float(ts)
        end = ts + dur
        name = self.names.setdefault(name, name) if len(self.names) < 100_000 else name
        args = event.get("args")
        if type(args) is not dict:
            args = {}
        self.seq += 1
        if cat in GPU_CATS:
            self.gpu = True
            corr = args.get("correlation")
            nbytes = args.get("bytes") if cat == "gpu_memcpy" else None
            entry = (
                ts,
                self.seq,
                end,
                name,
                cat,
                corr if type(corr) is int else None,
                nbytes if type(nbytes) is int and nbytes >= 0 else 0,
            )
            heapq.heappush(self.gpu_heap, entry)
            if len(self.gpu_heap) > REORDER_EVENTS:
                self._gpu_event(*heapq.heappop(self.gpu_heap))
            return
        if cat == "cuda_runtime" or cat == "cuda_driver":
            self.gpu = True
            corr = args.get("correlation")
            if type(corr) is int:
                self.launches.add(corr, ts, end - ts)
            kind = 1
        elif cat == "cpu_op":
            kind = 0
        elif cat == "user_annotation":
            kind = 2
            if name.startswith("ProfilerStep#"):
                _add_step(event, self.seen_steps)
        else:
            return
        key = None
        if kind == 0:
            dims, types = args.get("Input Dims"), args.get("Input type")
            dims_key = None if dims is None else repr(dims)
            try:
                key = (name, dims_key, tuple(types) if type(types) is list else None)
                hash(key)
            except TypeError:  # a list among the dtypes: not what a profiler writes
                key = (name, dims_key, None)
        # Longest first at equal start: a parent before its child.
        heapq.heappush(self.cpu_heap, (ts, -end, self.seq, end, name, kind, event.get("tid"), key))
        if len(self.cpu_heap) > REORDER_EVENTS:
            self._cpu_event(*heapq.heappop(self.cpu_heap))

    def finish(self) -> None:
        while self.cpu_heap:
            self._cpu_event(*heapq.heappop(self.cpu_heap))
        for stack in self.stacks.values():
            while stack:
                self._close(stack.pop(), stack)
        while self.gpu_heap:
            self._gpu_event(*heapq.heappop(self.gpu_heap))
        self._sweep_to(float("inf"))

    # -- CPU side ----------------------------------------------------------------------
    def _cpu_event(
        self,
        ts: float,
        _neg: float,
        _seq: int,
        end: float,
        name: str,
        kind: int,
        tid: Any,
        key: Any,
    ) -> None:
        if ts < self.cpu_clock:
            self.late += 1  # further out of order than the heap holds: placed, not nested
        else:
            self.cpu_clock = ts
        if kind == 2:
            notes = self.annotations.setdefault(tid, [])
            while notes and notes[-1][0] <= ts:
                notes.pop()
            notes.append((end, name))
            step = self.step_at(ts)
            if step is not None and name.startswith(_DATA):
                step.data_us += min(end, step.end) - ts
                self._cover(step, ts, end)
            return
        stack = self.stacks.setdefault(tid, [])
        while stack and stack[-1].end <= ts:
            self._close(stack.pop(), stack)
        parent = stack[-1] if stack else None
        step = self.step_at(ts)
        dur = end - ts
        frame = _Frame(end, dur, name, key, step, kind)
        if parent is not None:
            parent.child += dur
            frame.sync, frame.copy, frame.comm = parent.sync, parent.copy, parent.comm
            frame.data = parent.data
        else:
            frame.data = self._inside(tid, ts, _DATA)
            if step is not None:
                # Top level on its thread: it covers time that is not Python between ops.
                self._cover(step, ts, end)
                if kind == 0 and dur < 20.0 and not frame.data:
                    step.tiny_ops += 1
        if step is not None:
            if kind == 1 and name in SYNC_RUNTIME:
                step.rt_syncs += 1
                step.rt_sync_us += dur
            elif kind == 0:
                is_sync, is_copy, is_comm = self._classes(name)
                if not frame.sync and is_sync and not self._inside(tid, ts, _NOT_USER_SYNC):
                    frame.sync = True
                    step.cpu_syncs += 1
                    step.cpu_sync_us += dur
                if not frame.copy and is_copy:
                    frame.copy = True
                    step.copy_us += dur
                if not frame.comm and is_comm:
                    frame.comm = True
                    step.comm_us += dur
        stack.append(frame)

    def _classes(self, name: str) -> tuple[bool, bool, bool]:
        found = self.classes.get(name)
        if found is None:
            found = (name in SYNC_OPS, name in COPY_OPS, bool(_COMM_OP.search(name)))
            if len(self.classes) < MAX_OP_KEYS:
                self.classes[name] = found
        return found

    def _inside(self, tid: Any, ts: float, prefixes: tuple[str, ...]) -> bool:
        return any(
            end > ts and name.startswith(prefixes) for end, name in self.annotations.get(tid, ())
        )

    @staticmethod
    def _cover(step: _Step, ts: float, end: float) -> None:
        # Plain comparisons: this runs once per top-level op (max/min calls cost more).
        hi = end if end < step.end else step.end
        lo = ts if ts > step.cover_end else step.cover_end
        if step.start > lo:
            lo = step.start
        if hi > lo:
            step.covered_us += hi - lo
        if hi > step.cover_end:
            step.cover_end = hi

    def _close(self, frame: _Frame, stack: list[_Frame]) -> None:
        step = frame.step
        if step is None:
            return
        self_us = frame.dur - frame.child
        if self_us < 0.0:
            self_us = 0.0
        if frame.kind == 1:
            step.runtime_us += self_us
            return
        if frame.data:
            return
        step.ops_us += self_us
        step.op_count += 1
        stats = self.ops.get(frame.key)
        if stats is None:
            key = frame.key if len(self.ops) < MAX_OP_KEYS else (frame.name, None, None)
            stats = self.ops.setdefault(key, [0, 0.0, 0.0, 0.0])
        stats[0] += 1
        stats[1] += self_us
        stats[2] += frame.dur
        if frame.dur > stats[3]:
            stats[3] = frame.dur

    # -- GPU side ----------------------------------------------------------------------
    def _gpu_event(
        self, ts: float, _seq: int, end: float, name: str, cat: str, corr: int | None, nbytes: int
    ) -> None:
        launch = self.launches.find(corr) if corr is not None else None
        if launch is None:
            self.no_launch += 1
            step = self.step_at(ts) or self.g_step
            launch_ts = launch_end = None
        else:
            launch_ts = self.launches.ts[launch]
            launch_end = launch_ts + self.launches.dur[launch]
            step = self.step_at(launch_ts)
        if ts < self.g_prev:
            self.late += 1
            ts = min(self.g_prev, end)
        self._sweep_to(ts)
        if step is not None:
            gap = ts - self.g_any
            if self.g_any > float("-inf") and gap > 0:
                # HTA's idle split, on the device's merged timeline.
                if launch_ts is not None and launch_ts > self.g_any:
                    step.idle_host += gap
                elif gap < KERNEL_WAIT_US:
                    step.idle_kernel += gap
                else:
                    step.idle_other += gap
            dur = end - ts
            if cat == "kernel":
                known = self.kernels.get(name)
                if known is not None:
                    kind = known[0]
                else:
                    kind = "communication" if _COMM_KERNEL.search(name) else "compute"
                step.kernels += 1
                if launch_end is not None and launch_ts is not None:
                    launch_dur = launch_end - launch_ts
                    if launch_dur <= SHORT_LAUNCH_US and dur < launch_dur:
                        step.short_kernels += 1
                    step.delay_max = max(step.delay_max, ts - launch_end)
            else:
                kind = "memory"
                step.memcpy_us += dur
                step.memcpy_bytes += nbytes
                if "HtoD" in name:
                    step.h2d_us += dur
                    if "Pageable" in name:
                        step.pageable += 1
                        step.pageable_bytes += nbytes
            stats = self.kernels.get(name)
            if stats is None and len(self.kernels) < MAX_OP_KEYS:
                stats = self.kernels[name] = [kind, 0, 0.0, 0.0]
            if stats is not None:
                stats[1] += 1
                stats[2] += dur
                if dur > stats[3]:
                    stats[3] = dur
            if kind == "communication":
                self.g_comm = max(self.g_comm, end)
            elif kind == "compute":
                self.g_compute = max(self.g_compute, end)
            self.g_step = step
        if end > self.g_any:
            self.g_any = end

    def _sweep_to(self, t: float) -> None:
        """Account [g_prev, t) to the step the GPU works on: every interval that started
        before g_prev is known, so busy / communication / overlap there are exact."""
        lo = self.g_prev
        step = self.g_step
        if step is not None and t > lo:
            busy = min(self.g_any, t) - lo
            if busy > 0:
                step.busy_us += busy
            comm = min(self.g_comm, t) - lo
            if comm > 0:
                overlap = max(0.0, min(self.g_compute, self.g_comm, t) - lo)
                step.comm_gpu_us += comm
                step.comm_exposed_us += comm - overlap
        if t > lo:
            self.g_prev = t if t != float("inf") else lo


def _run(path: Path, steps: list[tuple[int, float, float]], header: dict[str, Any]) -> _Analyzer:
    analyzer = _Analyzer(steps)
    try:
        for event in iter_events(path, header):
            analyzer.feed(event)
    except RecursionError:
        raise DamagedTrace(f"{path}: an event nested too deeply to be a trace event") from None
    analyzer.finish()
    return analyzer


def analyse_trace(path: str | Path) -> TraceAnalysis:
    """Parse one trace; raises :class:`DamagedTrace` (one line) when it cannot be read."""
    path = Path(path)
    steps = _step_spans(path)
    header: dict[str, Any] = {}
    analyzer = _run(path, steps, header)
    seen = sorted(((n, s, e) for n, (s, e) in analyzer.seen_steps.items()), key=lambda x: x[1])
    if seen != steps:
        # The text scan missed a step event (an unusual layout): again, with every step.
        steps = seen
        analyzer = _run(path, steps, header)
    notes = []
    if not steps:
        notes.append("no ProfilerStep#N span: the window's steps cannot be told apart")
    if analyzer.late:
        notes.append(f"{analyzer.late} events too far out of time order were placed unnested")
    if analyzer.gpu and analyzer.no_launch:
        notes.append(f"{analyzer.no_launch} GPU activities without their launch (correlation)")
    props = header.get("deviceProperties")
    first = props[0] if isinstance(props, list) and props and isinstance(props[0], dict) else {}
    major = first.get("computeMajor")
    base_ns = header.get("baseTimeNanoseconds")
    ops = sorted(analyzer.ops.items(), key=lambda kv: -kv[1][1])[:TOP_OPS]
    kernels = sorted(analyzer.kernels.items(), key=lambda kv: -kv[1][2])[:TOP_OPS]
    return TraceAnalysis(
        steps=analyzer.steps,
        ops=[
            (
                name,
                dims,
                json.dumps(list(types)) if types is not None else None,
                int(s[0]),
                s[1] / 1e6,
                s[2] / 1e6,
                s[3] / 1e6,
            )
            for (name, dims, types), s in ops
        ],
        kernels=[(name[:500], k[0], k[1], k[2] / 1e6, k[3] / 1e6) for name, k in kernels],
        events=analyzer.events,
        gpu=analyzer.gpu,
        device_name=first.get("name") if isinstance(first.get("name"), str) else None,
        compute_major=major if type(major) is int else None,
        base_s=base_ns / 1e9 if isinstance(base_ns, (int, float)) else 0.0,
        notes=notes,
    )


def _step_row(window_id: int, s: _Step, base_s: float, gpu: bool) -> tuple:
    dur = s.end - s.start
    us = 1e-6
    syncs, sync_us = (s.rt_syncs, s.rt_sync_us) if gpu else (s.cpu_syncs, s.cpu_sync_us)
    idle = s.idle_host + s.idle_kernel + s.idle_other
    g = (lambda v: v * us) if gpu else (lambda v: None)
    return (
        window_id,
        s.number,
        base_s + s.start * us,
        dur * us,
        s.ops_us * us,
        max(0.0, dur - s.covered_us) * us,
        s.data_us * us,
        s.runtime_us * us,
        s.op_count,
        s.tiny_ops,
        syncs,
        sync_us * us,
        s.copy_us * us,
        s.comm_us * us,
        s.kernels if gpu else None,
        s.short_kernels if gpu else None,
        g(s.busy_us),
        g(idle),
        g(s.idle_host),
        g(s.idle_kernel),
        g(s.idle_other),
        g(s.delay_max),
        g(s.memcpy_us),
        g(s.h2d_us),
        s.memcpy_bytes if gpu else None,
        s.pageable if gpu else None,
        s.pageable_bytes if gpu else None,
        g(s.comm_gpu_us),
        g(s.comm_exposed_us),
    )


# -- writing --------------------------------------------------------------------------------
class _Writer(Protocol):
    def write_in_transaction(self, work: Any) -> bool: ...


def ingest_window(writer: _Writer, window_id: int, trace_path: str) -> None:
    """Parse the trace of profile window ``window_id`` into the recording ``writer`` writes.

    Never raises for a bad trace: the window is marked ``failed`` in ``profile_windows`` with
    the one line that says why, and no rows of it are written. Parsing holds no lock of the
    writer; the rows go in one transaction, replacing those of an earlier parse of the window.
    """
    started = time.perf_counter()
    try:
        analysis: TraceAnalysis | None = analyse_trace(trace_path)
        reason = None
    except DamagedTrace as exc:
        analysis, reason = None, str(exc)
    except MemoryError:
        analysis, reason = None, f"{trace_path}: out of memory while parsing"
    except Exception as exc:  # noqa: BLE001
        # A trace this parser does not understand must cost the window, never the recorder
        # (the recorder calls this on its own thread while the job runs): one line, as for a
        # damaged file.
        analysis, reason = None, f"{trace_path}: cannot be analysed ({type(exc).__name__}: {exc})"
    parse_s = time.perf_counter() - started

    def work(db: sqlite3.Connection) -> None:
        for stmt in create_sql():
            db.execute(stmt)
        for table in PROFILE_TABLES:
            db.execute(f"DELETE FROM {table} WHERE window_id = ?", (window_id,))
        has_windows = db.execute(
            "SELECT 1 FROM sqlite_master WHERE type='table' AND name='profile_windows'"
        ).fetchone()
        if analysis is None:
            if has_windows:
                db.execute(
                    "UPDATE profile_windows SET state = 'failed', reason = ? WHERE id = ?",
                    (reason, window_id),
                )
            return
        rows = [_step_row(window_id, s, analysis.base_s, analysis.gpu) for s in analysis.steps]
        _insert(db, "profile_steps", rows)
        _insert(db, "profile_ops", [(window_id, *op) for op in analysis.ops])
        _insert(db, "profile_kernels", [(window_id, *k) for k in analysis.kernels])
        trace_row = (
            window_id,
            analysis.events,
            int(analysis.gpu),
            analysis.device_name,
            analysis.compute_major,
            len(analysis.steps),
            parse_s,
            json.dumps(analysis.notes),
        )
        _insert(db, "profile_traces", [trace_row])

    writer.write_in_transaction(work)


def _insert(db: sqlite3.Connection, table: str, rows: list[tuple]) -> None:
    if rows:
        cols = PROFILE_TABLES[table]
        names = ", ".join(f'"{c}"' for c, _ in cols)
        marks = ", ".join("?" for _ in cols)
        db.executemany(f"INSERT INTO {table} ({names}) VALUES ({marks})", rows)


# -- reading back ---------------------------------------------------------------------------
WINDOW_COLUMNS = (
    "id",
    "rank",
    "pid",
    "first_step",
    "last_step",
    "warmup_step",
    "started_at",
    "ended_at",
    "trace_path",
    "trace_bytes",
    "state",
    "reason",
)
_TEXT = {"trace_path", "state", "reason", "op", "file", "function", "name", "kind", "notes"}
_TEXT |= {"input_dims", "input_types", "device_name"}


@dataclass
class WindowProfile:
    """One profiled window of one rank, with what its trace was parsed into."""

    window: dict[str, Any]  # the profile_windows row (id, rank, first_step ... state, reason)
    steps: list[dict[str, Any]]  # profile_steps rows, in step order
    ops: list[dict[str, Any]]  # profile_ops rows, most self time first
    kernels: list[dict[str, Any]]
    sync_sites: list[dict[str, Any]]  # profile_sync_sites rows, the costliest first
    trace: dict[str, Any] | None  # profile_traces row; None when the trace was not parsed

    @property
    def id(self) -> int:
        return int(self.window["id"])

    @property
    def gpu(self) -> bool:
        return bool(self.trace and self.trace.get("gpu"))

    @property
    def label(self) -> str:
        rank = self.window.get("rank")
        first, last = self.window.get("first_step"), self.window.get("last_step")
        if first is None and self.steps:
            first, last = self.steps[0]["step"], self.steps[-1]["step"]
        where = f"steps {first}-{last}" if first is not None else f"window {self.id}"
        return f"rank {rank}, {where}" if rank is not None else where

    @property
    def judged(self) -> list[dict[str, Any]]:
        """The steps the figures rest on: all but the last when there are 3 or more (the
        profiler drops kernels launched in the last step, and the window's close stalls it;
        HTA judges steps 1..N-1 the same way)."""
        return self.steps[:-1] if len(self.steps) >= 3 else list(self.steps)

    def median_step(self) -> dict[str, Any] | None:
        """The judged step of median length, whole: its parts add up to it (medians of each
        part taken apart do not)."""
        steps = sorted(
            (s for s in self.judged if s.get("dur_s") is not None), key=lambda s: s["dur_s"]
        )
        return steps[(len(steps) - 1) // 2] if steps else None

    def typical(self, column: str) -> float | None:
        """The median over the judged steps of ``column``; None when no step has it. The
        median, not the mean: one step of a window preempted on a busy machine (a 24 ms
        aten::expand among 4 us ones, seen on a shared 2-core VM) must not speak for all."""
        values = sorted(s[column] for s in self.judged if s.get(column) is not None)
        if not values:
            return None
        mid = len(values) // 2
        return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def read_profiles(recording: Any) -> list[WindowProfile]:
    """The recording's profile windows (``Recording.profile_windows``) with their parsed
    figures; [] for a recording without any (older ones have none of these tables).
    ``recording`` is an open :class:`~torchdoctor.recording.reader.Recording`."""
    tables = {
        r["name"]
        for r in recording.query("SELECT name FROM sqlite_master WHERE type = 'table'")
        if str(r["name"]).startswith("profile_")
    }
    if not tables:
        return []

    def rows(table: str, order: str, columns: tuple[str, ...] | None = None) -> list[dict]:
        if table not in tables:
            return []
        if columns is None:
            columns = tuple(c for c, _ in PROFILE_TABLES[table])
        stored = {
            r["name"] for r in recording.query(f"SELECT name FROM pragma_table_info('{table}')")
        }
        select = ", ".join(f'"{c}"' if c in stored else f'NULL AS "{c}"' for c in columns)
        found = recording.query(f"SELECT {select} FROM {table} ORDER BY {order}")
        for row in found:
            for key, value in row.items():
                want = str if key in _TEXT else (int, float)
                if value is not None and not isinstance(value, want):
                    raise damaged(recording.path, f"{table}.{key} holds {str(value)[:40]!r}")
        return found

    windows = [dataclasses.asdict(w) for w in recording.profile_windows()]
    if not windows:
        # Parsed traces whose window rows are absent: each is still a window.
        windows = [
            {c: None for c in WINDOW_COLUMNS} | {"id": t["window_id"], "state": "done"}
            for t in rows("profile_traces", "window_id")
        ]
    by_window: dict[str, dict[int, list[dict[str, Any]]]] = {}
    for table, order in (
        ("profile_steps", "window_id, step"),
        ("profile_ops", "window_id, self_s DESC"),
        ("profile_kernels", "window_id, total_s DESC"),
        ("profile_traces", "window_id"),
    ):
        grouped: dict[int, list[dict[str, Any]]] = {}
        for row in rows(table, order):
            grouped.setdefault(row["window_id"], []).append(row)
        by_window[table] = grouped
    out = []
    for w in windows:
        wid = w["id"]
        traces = by_window["profile_traces"].get(wid) or [None]
        out.append(
            WindowProfile(
                window=w,
                steps=by_window["profile_steps"].get(wid, []),
                ops=by_window["profile_ops"].get(wid, []),
                kernels=by_window["profile_kernels"].get(wid, []),
                sync_sites=[dataclasses.asdict(x) for x in recording.profile_sync_sites(wid)],
                trace=traces[0],
            )
        )
    return out


# What a profiled step is made of, each part apart from the others (their sum is the step):
# CPU ops' self time, CUDA runtime calls, the DataLoader's __next__, Python between them.
STEP_PARTS = (
    ("ops", "ops_s"),
    ("runtime", "runtime_s"),
    ("data", "data_s"),
    ("Python", "python_s"),
)
# Parts of the above counted again by what they do (inclusive of nested ops).
STEP_KINDS = (("syncs", "sync_s"), ("copies", "copy_s"), ("communication", "comm_s"))
# The GPU's time in the step: busy, and HTA's three kinds of idle.
GPU_PARTS = (
    ("busy", "gpu_busy_s"),
    ("host wait", "idle_host_s"),
    ("kernel wait", "idle_kernel_s"),
    ("other idle", "idle_other_s"),
)


def window_summary(w: WindowProfile) -> dict[str, Any]:
    """One window in plain figures (``show --json``'s ``profiles`` items): where it is, its
    state, and its step of median length (``step``) split into its parts."""
    step = w.median_step() or {}
    step_s = step.get("dur_s")
    out: dict[str, Any] = {
        "id": w.id,
        "rank": w.window.get("rank"),
        "first_step": w.window.get("first_step"),
        "last_step": w.window.get("last_step"),
        "state": w.window.get("state"),
        "reason": w.window.get("reason"),
        "trace_path": w.window.get("trace_path"),
        "steps_parsed": len(w.steps),
        "steps_judged": len(w.judged),
        "gpu": w.gpu,
        "median_step_s": step_s,
        "syncs_per_step": w.typical("sync_count"),
        "ops_per_step": w.typical("op_count"),
        "step": step.get("step"),
        "parts_s": {name: step.get(col) for name, col in STEP_PARTS + STEP_KINDS},
        "gpu_s": {name: step.get(col) for name, col in GPU_PARTS} if w.gpu else None,
        "top_ops": [
            {k: op[k] for k in ("name", "input_dims", "input_types", "count", "self_s", "max_s")}
            for op in w.ops[:5]
        ],
    }
    return out
