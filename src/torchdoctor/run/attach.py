"""Seeing inside a job that is already running: its steps and data wait, for `torchdoctor attach`.

The job was started without torchdoctor and keeps running as it is. Its main thread's Python
stack is sampled from outside, read-only (:mod:`torchdoctor.sampling.pystacks`, py-spy
``--nonblocking``: the job is never stopped, nothing runs inside it), and the steps those
samples show go into the recording as its steps, with the DataLoader the stacks reveal, so that
``show``, ``diagnose``, ``report`` and ``top`` read an attached job as they read a run.

Where looking inside is not allowed or not possible (another user's process, ptrace forbidden
by Yama or by a missing CAP_SYS_PTRACE, ``PYTHON_DISABLE_REMOTE_DEBUG`` in the job's
environment, a process that is not Python, py-spy not installed), one line says why and what to
do, and the attach records the process tree only. The recording's ``steps_source`` says which:
``sampled-stacks`` or ``none`` (with ``steps_source_reason``).

Injecting the agent into the live interpreter is not done: on Python < 3.14 it takes a debugger
calling into the stopped interpreter, and gdb 13 (Debian 12) fails to restore the registers of
a CPU with AMX state ("Couldn't write extended state status"), which left a test job dead with
``OSError: [Errno 514]`` out of an interrupted ``time.sleep``: the job must come first.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torchdoctor.errors import UserError
from torchdoctor.recording.records import DataLoaderRecord, SettingRecord, StepRecord
from torchdoctor.run.process import exit_status, spawn
from torchdoctor.sampling.procfs import parse_environ, read_path
from torchdoctor.sampling.pystacks import (
    CHUNK_S,
    DEFAULT_RATE_HZ,
    ChunkResult,
    EstimatedStep,
    analyse,
    merging_note,
    py_spy_path,
)
from torchdoctor.sampling.roles import is_python

SAMPLED = "sampled-stacks"
NONE = "none"
_YAMA = "/proc/sys/kernel/yama/ptrace_scope"
_CAP_SYS_PTRACE = 19


def refusal(pid: int) -> str | None:
    """Why the inside of ``pid`` cannot be looked at, with what to do (None: it can)."""
    me = os.geteuid()
    owner = _owner(pid)
    if owner is not None and owner != me:
        return (
            f"PID {pid} belongs to {_user_name(owner)}, not to {_user_name(me)}: run "
            f"`torchdoctor attach {pid}` as {_user_name(owner)} to see its steps"
        )
    if not _is_python(pid):
        exe = _exe_name(pid) or "a program"
        return (
            f"PID {pid} runs {exe}, not Python: attach to the Python process that trains "
            "(`torchdoctor top` or `ps` shows it) to see its steps"
        )
    try:
        environ = parse_environ(read_path(f"/proc/{pid}/environ", 1 << 20), None)
    except OSError:
        environ = {}
    if environ.get("PYTHON_DISABLE_REMOTE_DEBUG"):
        return (
            f"PID {pid} has PYTHON_DISABLE_REMOTE_DEBUG set: it asked not to be inspected; "
            "start it without that variable, or under `torchdoctor run`, to see its steps"
        )
    denied = _ptrace_denied(pid)
    if denied is not None:
        return denied
    if py_spy_path() is None:
        return (
            f"py-spy, which comes with torchdoctor, is not beside {sys.executable} nor on PATH: "
            "reinstall with `pip install --force-reinstall 'torchdoctor[attach]'` to see the "
            "steps of attached jobs"
        )
    return None


def _ptrace_denied(pid: int) -> str | None:
    """Opening /proc/PID/mem asks the kernel the question py-spy's reads ask (ptrace access
    mode ATTACH, Yama included) without stopping or touching the job."""
    try:
        fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
    except PermissionError:
        pass
    except OSError:
        return None  # gone, or a kernel without /proc/PID/mem: sampling says the rest
    else:
        os.close(fd)
        return None
    scope = _yama_scope()
    cap = _has_cap_sys_ptrace()
    if scope is not None and scope >= 3:
        return (
            f"ptrace is forbidden on this host (kernel.yama.ptrace_scope = {scope}, fixed until "
            f"reboot): start the job under `torchdoctor run` to see its steps"
        )
    if scope == 2 and not cap:
        return (
            "ptrace is for administrators only here (kernel.yama.ptrace_scope = 2): run "
            f"`sudo torchdoctor attach {pid}` to see its steps"
        )
    if scope == 1 and not cap:
        return (
            "ptrace is limited to a process's own descendants here (kernel.yama.ptrace_scope = "
            f"1): run `sudo sysctl kernel.yama.ptrace_scope=0`, or `sudo torchdoctor attach {pid}`"
            ", or start the job under `torchdoctor run`, to see its steps"
        )
    if not cap:
        return (
            f"the kernel refuses to let us read PID {pid} (no CAP_SYS_PTRACE, and the process "
            "is not dumpable or runs in another namespace): in a container add "
            "`--cap-add SYS_PTRACE`, or start the job under `torchdoctor run`, to see its steps"
        )
    return (
        f"the kernel refuses to let us read PID {pid} (a security module forbids ptrace): "
        "start the job under `torchdoctor run` to see its steps"
    )


def _yama_scope() -> int | None:
    try:
        return int(read_path(_YAMA).strip())
    except (OSError, ValueError):
        return None  # no Yama LSM: classic ptrace permissions


def _has_cap_sys_ptrace() -> bool:
    for line in read_path("/proc/self/status", 1 << 16).decode(errors="replace").splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> _CAP_SYS_PTRACE & 1)
    return False


def _owner(pid: int) -> int | None:
    try:
        status = read_path(f"/proc/{pid}/status", 1 << 16).decode(errors="replace")
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[2])  # effective uid: whose rights the process runs with
    return None


def _user_name(uid: int) -> str:
    import pwd

    try:
        return f"user {pwd.getpwuid(uid).pw_name}"
    except KeyError:
        return f"uid {uid}"


def _exe_name(pid: int) -> str | None:
    try:
        return os.path.basename(os.readlink(f"/proc/{pid}/exe")).removesuffix(" (deleted)")
    except OSError:
        return None


def _is_python(pid: int) -> bool:
    exe = _exe_name(pid)
    if exe is not None and is_python(exe):
        return True
    try:
        maps = read_path(f"/proc/{pid}/maps", 1 << 22)
    except OSError:
        return False
    return b"/libpython" in maps  # an embedding program (or a renamed interpreter)


@dataclass(slots=True)
class InsideView:
    """What looking inside an attached job found: how steps were seen, how many."""

    source: str
    reason: str | None
    sampler: StackSampler | None = None
    steps: int = 0
    writer: Any = None
    say: Callable[[str], None] | None = None

    def stop(self) -> None:
        """Stop sampling; what the last chunk held is written before this returns. A sampler
        that failed is said once and kept in the metadata."""
        if self.sampler is None:
            return
        self.sampler.stop()
        error = self.sampler.error
        if error is not None:
            self.reason = f"sampling the stack failed: {error}"
            if self.say is not None:
                self.say(f"torchdoctor: {self.reason} ({self.steps} steps seen before).")
            if self.writer is not None:
                self.writer.set_meta({"steps_source_reason": self.reason})


def look_inside(
    pid: int, writer: Any, say: Callable[[str], None], *, rate_hz: int | None = None
) -> InsideView:
    """Start seeing ``pid``'s steps into ``writer`` (a RecordingWriter), or say in one line
    why not; the recording's metadata gets ``steps_source`` either way. Never raises: the
    process tree is recorded whatever happens here."""
    try:
        reason = refusal(pid)
    except Exception as exc:  # noqa: BLE001 - looking inside is optional, the recording is not
        reason = f"checking the process failed ({type(exc).__name__}: {exc})"
    if reason is not None:
        say(f"torchdoctor: not looking inside: {reason}; recording the process tree only.")
        writer.set_meta({"steps_source": NONE, "steps_source_reason": reason})
        return InsideView(NONE, reason)
    view = InsideView(SAMPLED, None, writer=writer, say=say)
    state = _StepWriter(pid, writer, view, rate_hz or DEFAULT_RATE_HZ)
    sampler = StackSampler(pid, state.on_chunk, rate_hz=state.rate_hz)
    writer.set_meta(
        {
            "steps_source": SAMPLED,
            "steps_source_detail": (
                f"main thread's Python stack sampled at {sampler.rate_hz} Hz by py-spy, "
                "non-blocking; steps estimated from the phases of each step"
            ),
        }
    )
    say(
        f"torchdoctor: seeing steps by sampling PID {pid}'s Python stack from outside "
        f"({sampler.rate_hz} Hz, read-only: the job is never stopped)."
    )
    view.sampler = sampler.start()
    return view


class _StepWriter:
    """Turns the sampler's chunks into the recording's steps, DataLoader and boundary setting."""

    def __init__(self, pid: int, writer: Any, view: InsideView, rate_hz: int) -> None:
        self.pid = pid
        self.writer = writer
        self.view = view
        self.rate_hz = rate_hz
        self.merging: str | None = None  # what the recording says of it (merging_note)
        self.loader_written = False
        self.boundary: str | None = None
        # The steps seen, judged together for merging; the last few thousand are enough.
        self.seen: collections.deque[EstimatedStep] = collections.deque(maxlen=4096)

    def on_chunk(self, chunk: ChunkResult) -> None:
        rows = []
        for est in chunk.steps:
            wall = est.t_end - est.t_start
            rows.append(
                StepRecord(
                    pid=self.pid,
                    rank=None,
                    step=self.view.steps + len(rows),
                    t_start=est.t_start,
                    t_end=est.t_end,
                    wall_s=wall,
                    data_wait_s=min(est.data_wait_s, wall),
                )
            )
        self.view.steps += len(rows)
        if rows:
            self.writer.add_steps(rows)
        self.seen.extend(chunk.steps)
        self._say_if_merging()
        boundary = "optimizer" if chunk.optimizer_seen else "backward"
        if rows and boundary != self.boundary and self.boundary != "optimizer":
            self.boundary = boundary
            self.writer.add_settings(
                [SettingRecord(self.pid, None, time.time(), "steps.boundary", json.dumps(boundary))]
            )
        if chunk.loader_kind is not None and not self.loader_written:
            self.loader_written = True
            self.writer.add_dataloaders([self._loader(chunk)])

    def _say_if_merging(self) -> None:
        """Keep the recording's ``steps_source_limit`` true to the steps seen so far: a step
        count that is a lower bound must not read as the job's rate."""
        note = merging_note(list(self.seen), self.rate_hz)
        if note != self.merging:
            self.merging = note
            self.writer.set_meta({"steps_source_limit": note})

    def _loader(self, chunk: ChunkResult) -> DataLoaderRecord:
        workers = 0 if chunk.loader_kind == "single-process" else len(_workers(self.pid))
        return DataLoaderRecord(
            pid=self.pid,
            rank=None,
            loader_id=0,
            t=chunk.t_start,
            batch_size=None,
            num_workers=workers,
            pin_memory=chunk.pin_memory_thread,
            persistent_workers=False,
            prefetch_factor=2 if workers else None,
            drop_last=False,
            multiprocessing_context=None,
            dataset_type=chunk.dataset_type or "unknown (seen from outside)",
            dataset_len=None,
            sampler_type=None,
        )


class StackSampler:
    """Samples the main thread of ``pid`` with py-spy in chunks of ``chunk_s`` on a thread of
    its own and hands each chunk's :class:`ChunkResult` to ``on_chunk`` (from that thread).

    Ends when :meth:`stop` is called or the process ends; ``error`` then says why it could not
    sample, if it could not. py-spy is started with no signal blocked (our threads block
    Ctrl-C for :func:`torchdoctor.run.process.wait_for_signal`), so that SIGINT ends a chunk
    at once and py-spy writes what it has."""

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
        self._child: int | None = None
        self._lock = threading.Lock()
        self._dir = tempfile.mkdtemp(prefix="torchdoctor-stacks-")
        self._thread = threading.Thread(target=self._loop, name="torchdoctor-stacks", daemon=True)

    def start(self) -> StackSampler:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """End the chunk under way early (py-spy writes what it has on SIGINT) and wait."""
        with self._lock:
            self._stop.set()
            child = self._child
        if child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGINT)
        self._thread.join(timeout)
        shutil.rmtree(self._dir, ignore_errors=True)

    def _loop(self) -> None:
        if self.py_spy is None:
            self.error = "py-spy is not installed"
            return
        log = os.path.join(self._dir, "py-spy.log")
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
                try:
                    self._child = spawn(self.py_spy, argv, dict(os.environ), log=log)
                except UserError as exc:
                    self.error = str(exc)
                    return
            _, status = os.waitpid(self._child, 0)
            ended = time.time()
            with self._lock:
                self._child = None
            try:
                with open(out, encoding="utf-8") as f:
                    data = json.load(f)
            except (OSError, ValueError):
                if os.path.exists(f"/proc/{self.pid}") and not self._stop.is_set():
                    self.error = _last_line(log) or f"py-spy ended with {exit_status(status)}"
                return
            os.unlink(out)
            self.chunks += 1
            try:
                self.on_chunk(analyse(data, self.pid, ended))
            except Exception as exc:  # noqa: BLE001 - said once by InsideView.stop
                self.error = f"{type(exc).__name__}: {exc}"
                return


def _last_line(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""


def _workers(pid: int) -> list[int]:
    """Child processes of ``pid`` that run its own interpreter: its DataLoader workers (not the
    helpers a job may start, such as a compiler or a shell)."""
    exe = _exe_name(pid)
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            children = [int(c) for c in read_path(f"/proc/{pid}/task/{tid}/children").split()]
        except OSError:
            continue
        out.extend(c for c in children if _exe_name(c) == exe)
    return out
