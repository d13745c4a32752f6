"""What was live at the peak of CUDA memory, from a memory snapshot: by source line, by phase,
reserved against allocated, fragmentation, and the request that failed.

The snapshot's history (``device_traces``) is replayed in order, as Mosaic's
``_get_memory_usage_peak`` does: an ``alloc`` adds its block, a ``free_completed`` removes it
(``free_requested`` is only the request: the block stays allocated until the stream is done),
``segment_alloc`` / ``segment_map`` and ``segment_free`` / ``segment_unmap`` move the
reservation. Only live blocks are kept, and live bytes are summed per (line, phase) as they
come, so the make-up at the peak is a copy of those sums taken when the peak ends: memory grows
with the distinct lines, never with the history's length.

Memory allocated before the history began (the agent starts it when CUDA initialises; torch
keeps a ring of the last entries, so a long job's history holds only its last steps) is known
two ways: blocks still active in the segments that no entry allocated, and frees of blocks no
entry allocated. Both were live from the start of the history until then, so they count at the
peak: an active block with the line and phase of the stack it keeps, the rest as "before the
history".
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchdoctor.diagnosis.snapshot_file import FORGOTTEN, damaged, read_snapshot
from torchdoctor.errors import UserError
from torchdoctor.instrument.agent.cuda import SNAPSHOT_EVENT, phase_of
from torchdoctor.recording.reader import Recording
from torchdoctor.recording.steps import decode_json
from torchdoctor.units import fmt_bytes

PARAMETERS = "parameters"
ACTIVATIONS = "activations"
GRADIENTS = "gradients"
OPTIMIZER_STATE = "optimizer state"
BEFORE_HISTORY = "before the history"
TEMPORARIES = "temporaries"  # only where estimate's snapshot says so
# `torchdoctor estimate --memory-snapshot` names each allocation's category in its frame
# ("aten.mm [activations]"); the batch's inputs are, like activations, memory that grows with
# the batch.
_ESTIMATE_CATEGORIES = {
    PARAMETERS: PARAMETERS,
    GRADIENTS: GRADIENTS,
    OPTIMIZER_STATE: OPTIMIZER_STATE,
    ACTIVATIONS: ACTIVATIONS,
    "inputs": ACTIVATIONS,
    TEMPORARIES: TEMPORARIES,
}
NO_STACK = "(no Python stack: autograd's backward threads)"
FORGOTTEN_STACK = "(a stack shared with an entry long before)"
TOP_SITES = 10  # lines kept, largest first
# torch's time_us is UNIX microseconds: a smaller one (another clock) is not compared to a step.
UNIX_US_FROM = 10**15  # 2001
# Frames that are not the user's line: libraries, the standard library, torchdoctor's agent,
# frozen modules and native (C++/CUDA) frames of stacks="all".
_LIBRARY = ("/site-packages/", "/dist-packages/", "/torch/", "/torchdoctor/instrument/agent/")
_NATIVE = (".cpp", ".cc", ".cu", ".h", ".hpp", ".c", ".so")
_ALLOCATED_STATES = ("active_allocated", "active_awaiting_free", "active_pending_free")


@dataclass(slots=True)
class SiteBytes:
    """Bytes one source line held at the peak, in one phase."""

    where: str  # "model.py:42 forward": the first frame that is the job's own code
    phase: str
    bytes: int
    blocks: int


@dataclass(slots=True)
class FailedRequest:
    """The allocation that ran out (the history's ``oom`` entry)."""

    bytes: int
    device_free: int | None  # what the device itself had free, by the driver's count


@dataclass(slots=True)
class MemoryPeak:
    path: str
    device: int
    entries: int  # history entries replayed for this device
    peak_allocated: int
    peak_reserved: int | None  # None: the snapshot has no segments (estimate's CPU file)
    by_phase: dict[str, int]
    sites: list[SiteBytes]  # the largest lines at the peak, at most TOP_SITES
    end_allocated: int | None
    end_reserved: int | None
    largest_free_block: int | None  # the largest inactive block of the segments at the end
    failed: FailedRequest | None
    # Reserved but not allocated at the end (the moment of the OOM for an OOM's file).
    fragmentation: int | None = None
    sites_total: int = 0  # distinct (line, phase) pairs live at the peak

    def top_phase(self) -> tuple[str, int]:
        return max(self.by_phase.items(), key=lambda kv: kv[1]) if self.by_phase else ("", 0)


def frame_site(frames: list) -> tuple[str, str]:
    """(where, phase) of one allocation's frames (innermost first, as torch records them).

    The phase, in this order: a category ``estimate`` wrote into the frame; an allocation
    inside ``torch/optim/`` -> optimizer state, inside autograd (``torch/autograd/``,
    ``Tensor.backward``) -> gradients (the agent's own ``phase_of``); no Python frame at all
    -> gradients too, since backward runs its CUDA work on autograd's device threads, which
    have no Python stack (the training thread's forward and optimizer step always have one);
    a frame that makes or moves parameters (``Module._apply`` for ``.to()``/``.cuda()``, a
    module's ``__init__`` on the device, ``torch.nn.init``) -> parameters; else activations:
    what forward made and kept. Allocations before the first step count as parameters by time instead
    (:class:`Replay`'s ``first_step_us``)."""
    files: list[str] = []
    where = ""
    phase = ""
    for frame in frames:
        if type(frame) is not dict:
            raise ValueError("a frame is not a dictionary")
        filename = str(frame.get("filename", "")).replace("\\", "/")
        name = str(frame.get("name", ""))
        files.append(filename)
        if not phase and name.endswith("]") and "[" in name:
            phase = _ESTIMATE_CATEGORIES.get(name[name.rindex("[") + 1 : -1], "")
        if not phase and _makes_parameters(filename, name):
            phase = PARAMETERS
        if not where and _is_user(filename):
            where = _where(filename, frame.get("line"), name)
    if not phase:
        if not frames:
            phase = GRADIENTS
        else:
            phase = {"optimizer": OPTIMIZER_STATE, "backward": GRADIENTS}.get(
                phase_of(files), ACTIVATIONS
            )
    if not where:
        first = frames[0] if frames else None
        where = (
            _where(str(first["filename"]), first.get("line"), first.get("name"))
            if first
            else NO_STACK
        )
    return where, phase


def _makes_parameters(filename: str, name: str) -> bool:
    """A frame that makes or moves a model's parameters: ``Module._apply`` (``.to()``,
    ``.cuda()``), a module's ``__init__``/``reset_parameters`` (a model built on the device),
    ``torch.nn.init``."""
    if "/torch/nn/" not in filename:
        return False
    if filename.endswith("/torch/nn/init.py"):
        return True
    return name in ("_apply", "__init__", "reset_parameters") and "/torch/nn/modules/" in filename


def _is_user(filename: str) -> bool:
    if not filename or filename.startswith("<frozen") or filename == "??":
        return False
    if any(part in filename for part in _LIBRARY) or filename.endswith(_NATIVE):
        return False
    return "/lib/python3" not in filename  # the standard library


def _where(filename: str, line: Any, name: Any) -> str:
    base = os.path.basename(filename.replace("\\", "/")) or filename
    place = f"{base}:{line}" if isinstance(line, int) and line > 0 else base
    return f"{place} {name}" if name else place


class Replay:
    """One device's history, replayed entry by entry (see the module's docstring)."""

    def __init__(self, first_step_us: float | None) -> None:
        self.first_step_us = first_step_us
        self.keys: dict[tuple[str, str], int] = {}
        self.key_list: list[tuple[str, str]] = []
        self.sums: list[int] = []  # live bytes per key
        self.counts: list[int] = []  # live blocks per key
        self.live: dict[int, tuple[int, int]] = {}  # address -> (size, key)
        self.allocated = 0  # bytes of live blocks the history allocated
        self.unknown_freed = 0  # bytes freed that the history never allocated
        self.segments = 0  # reservation change since the history began
        self.entries = 0
        self.best: int | None = None
        self.pending = False
        self.at_peak: tuple[list[int], list[int], int, int, int] | None = None
        self.failed: FailedRequest | None = None

    def key(self, where: str, phase: str) -> int:
        k = self.keys.get((where, phase))
        if k is None:
            k = self.keys[(where, phase)] = len(self.key_list)
            self.key_list.append((where, phase))
            self.sums.append(0)
            self.counts.append(0)
        return k

    def feed(self, entry: dict) -> None:
        self.entries += 1
        action = entry["action"]
        size = entry.get("size", 0)
        if type(size) is not int or size < 0:
            raise ValueError(f"an entry's size is {size!r}")
        if action == "alloc":
            site = entry.get("frames", (NO_STACK, GRADIENTS))
            if site is FORGOTTEN:  # a stack shared with an entry long before (never in torch's)
                site = (FORGOTTEN_STACK, ACTIVATIONS)
            if type(site) is not tuple:
                raise ValueError(f"an entry's frames are {type(site).__name__}, not a list")
            where, phase = site
            t = entry.get("time_us")
            if (
                self.first_step_us is not None
                and isinstance(t, (int, float))
                and UNIX_US_FROM <= t < self.first_step_us
                and phase != OPTIMIZER_STATE
            ):
                phase = PARAMETERS
            k = self.key(where, phase)
            old = self.live.pop(_addr(entry), None)
            if old is not None:  # an address allocated twice: the first was freed unseen
                self._drop(*old)
            self.live[_addr(entry)] = (size, k)
            self.sums[k] += size
            self.counts[k] += 1
            self.allocated += size
            value = self.allocated - self.unknown_freed
            if self.best is None or value > self.best:
                self.best = value
                self.pending = True
        elif action == "free_completed":
            self._keep_peak()
            old = self.live.pop(_addr(entry), None)
            if old is None:
                self.unknown_freed += size
            else:
                self._drop(*old)
        elif action in ("segment_alloc", "segment_map"):
            self.segments += size
        elif action in ("segment_free", "segment_unmap"):
            self.segments -= size
        elif action == "oom":
            free = entry.get("device_free")
            self.failed = FailedRequest(size, free if type(free) is int else None)
            self._keep_peak()  # the moment it ran out is a peak of its own
        elif type(action) is not str:
            raise ValueError(f"an entry's action is {action!r}")

    def _drop(self, size: int, k: int) -> None:
        self.sums[k] -= size
        self.counts[k] -= 1
        self.allocated -= size

    def _keep_peak(self) -> None:
        """Memory is about to fall: if the last rise set a new peak, copy what it was made of."""
        if self.pending:
            self.pending = False
            self.at_peak = (
                list(self.sums),
                list(self.counts),
                self.allocated,
                self.unknown_freed,
                self.segments,
            )

    def result(self, path: str, device: int, segments: list[dict]) -> MemoryPeak:
        self._keep_peak()
        have_segments = bool(segments)
        end_reserved = end_allocated = largest = None
        # Active at the end and never allocated in the history: live all along. Such a block
        # keeps the stack it was allocated with (torch keeps it with the block, not in the
        # ring), so it has its line where it has one; without, it is "before the history".
        static: dict[tuple[str, str], list[int]] = {}
        unplaced = 0
        if have_segments:
            end_reserved = end_allocated = largest = 0
            for segment in segments:
                end_reserved += _int(segment.get("total_size"))
                for block in segment.get("blocks") or ():
                    if type(block) is not dict:
                        raise ValueError("a segment's block is not a dictionary")
                    size = _int(block.get("size"))
                    if block.get("state") in _ALLOCATED_STATES:
                        end_allocated += size
                        if block.get("address") not in self.live:
                            site = _block_site(block)
                            if site is None:
                                unplaced += size
                            else:
                                held = static.setdefault(site, [0, 0])
                                held[0] += size
                                held[1] += 1
                    else:
                        largest = max(largest, size)
        # No allocation in the history: the end is all there is.
        empty = ([], [], 0, self.unknown_freed, self.segments)
        sums, counts, known, freed_then, segments_then = self.at_peak or empty
        before = unplaced + (self.unknown_freed - freed_then)
        peak = known + before + sum(size for size, _ in static.values())
        for k, key in enumerate(self.key_list[: len(sums)]):
            if sums[k] > 0:
                held = static.setdefault(key, [0, 0])
                held[0] += sums[k]
                held[1] += counts[k]
        sites = [
            SiteBytes(where, phase, n, blocks) for (where, phase), (n, blocks) in static.items()
        ]
        by_phase: dict[str, int] = {}
        for site in sites:
            by_phase[site.phase] = by_phase.get(site.phase, 0) + site.bytes
        if before:
            by_phase[BEFORE_HISTORY] = before
        sites.sort(key=lambda s: s.bytes, reverse=True)
        peak_reserved = None
        if end_reserved is not None:
            peak_reserved = max(peak, end_reserved - (self.segments - segments_then))
        return MemoryPeak(
            path=path,
            device=device,
            entries=self.entries,
            peak_allocated=peak,
            peak_reserved=peak_reserved,
            by_phase=dict(sorted(by_phase.items(), key=lambda kv: -kv[1])),
            sites=sites[:TOP_SITES],
            sites_total=len(sites),
            end_allocated=end_allocated,
            end_reserved=end_reserved,
            largest_free_block=largest,
            failed=self.failed,
            fragmentation=(
                max(0, end_reserved - end_allocated)
                if end_reserved is not None and end_allocated is not None
                else None
            ),
        )


def phase_split(peak: MemoryPeak) -> str:
    """'activations 40.0 GiB (61 %), gradients 8.00 GiB (12 %), ...', largest first."""
    total = peak.peak_allocated or 1
    return ", ".join(
        f"{phase} {fmt_bytes(size)} ({100 * size / total:.0f} %)"
        for phase, size in peak.by_phase.items()
    )


def _block_site(block: dict) -> tuple[str, str] | None:
    """(where, phase) of a segment's block from the stack it keeps; None without one."""
    frames = block.get("frames")
    if type(frames) is tuple:  # the summary, where an entry read first shared the list
        return frames
    if type(frames) is list and frames:
        return frame_site(frames)
    return None


def _addr(entry: dict) -> int:
    addr = entry.get("addr")
    if type(addr) is not int:
        raise ValueError(f"an entry's address is {addr!r}")
    return addr


def _int(value: Any) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"a segment's size is {value!r}")
    return value


def analyse_snapshot(
    path: str | os.PathLike[str], first_step_us: float | None = None
) -> MemoryPeak:
    """The peak of the snapshot at ``path``: of the device that ran out when one did, else of
    the device whose peak was highest. ``first_step_us`` (UNIX microseconds, as the history's
    ``time_us``): allocations made before it count as parameters. Bad files: one UserError."""
    replays: dict[int, Replay] = {}

    def on_entry(history: list, entry: dict) -> None:
        replay = replays.get(id(history))
        if replay is None:
            replay = replays[id(history)] = Replay(first_step_us)
            keep.append(history)  # its id stays its own until the end
        replay.feed(entry)

    keep: list[list] = []
    try:
        top = read_snapshot(path, on_entry, frame_site)
        histories = top["device_traces"]
        segments = top.get("segments") or []
        if type(segments) is not list or any(type(s) is not dict for s in segments):
            raise ValueError("its segments are not a list of dictionaries")
        results = []
        for device, history in enumerate(histories):
            replay = replays.get(id(history)) or Replay(first_step_us)
            mine = [s for s in segments if s.get("device", 0) == device]
            if replay.entries or mine:
                results.append(replay.result(str(path), device, mine))
    except (ValueError, KeyError, TypeError) as exc:
        raise damaged(path, str(exc)) from None
    if not results:
        raise damaged(path, "it holds no allocation history and no segments")
    failed = [r for r in results if r.failed is not None]
    return max(failed or results, key=lambda r: r.peak_allocated)


@dataclass(slots=True)
class RecordedSnapshot:
    """A snapshot a recording's events name: the agent's at an OOM or at the process' end."""

    pid: int
    t: float
    kind: str  # "oom" or "exit"
    path: str
    peak: MemoryPeak | None  # None: not read (``error`` says why)
    error: str | None = None


def recorded_snapshots(rec: Recording) -> list[RecordedSnapshot]:
    """The snapshots named by ``rec``'s ``cuda-oom`` and ``cuda-memory-snapshot`` events that
    exist (where they were written, else beside the recording: a recording copied with its
    files), each analysed; one that cannot be read carries its one line instead."""
    first_steps = {
        row["pid"]: row["t"]
        for row in rec.query("SELECT pid, MIN(t_start) AS t FROM steps GROUP BY pid")
        if isinstance(row["t"], (int, float))
    }
    out = []
    for event in rec.rows("events"):
        kind = {"cuda-oom": "oom", SNAPSHOT_EVENT: "exit"}.get(event["kind"])
        detail = decode_json(event["detail"]) if kind else None
        named = detail.get("snapshot") if isinstance(detail, dict) else None
        if not isinstance(named, str) or not named:
            continue
        path = _existing(named, Path(rec.path))
        if path is None:
            continue
        first = first_steps.get(event["pid"])
        try:
            peak = analysed(path, first * 1e6 if first is not None else None)
        except UserError as exc:
            out.append(RecordedSnapshot(event["pid"], event["t"], kind, path, None, exc.message))
            continue
        out.append(RecordedSnapshot(event["pid"], event["t"], kind, path, peak))
    return out


def _existing(named: str, recording: Path) -> str | None:
    beside = recording.parent / os.path.basename(named)
    for candidate in (named, str(beside)):
        try:
            if os.path.isfile(candidate):
                return candidate
        except (OSError, ValueError):  # a name too long, a NUL in an edited detail
            continue
    return None


def analysed(path: str, first_step_us: float | None) -> MemoryPeak:
    """:func:`analyse_snapshot`, once per file as it is: ``diagnose`` and the report both
    read it, and a large history takes seconds."""
    try:
        st = os.stat(path)
        key = (st.st_size, st.st_mtime_ns)
    except OSError:
        key = (None, None)
    return _analysed(os.path.abspath(path), key, first_step_us)


@functools.lru_cache(maxsize=8)
def _analysed(path: str, key: tuple, first_step_us: float | None) -> MemoryPeak:
    return analyse_snapshot(path, first_step_us)
