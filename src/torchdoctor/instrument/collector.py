"""The recorder's end of the instrumentation: a Unix socket the job's agents send records to.

Transport: one ``SOCK_SEQPACKET`` connection per instrumented process (a trainer, each rank,
each DataLoader worker), each message one JSON object holding a batch of records. Sequenced
packets keep message boundaries (no framing), are reliable, and let every process connect on
its own after a fork. The socket lives in a private ``0700`` folder. Figures of the choice
against a datagram socket, a pipe and per-process files: ``benchmarks/instrument_overhead.py``.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import shutil
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

from torchdoctor.instrument import agent as agent_mod
from torchdoctor.instrument.agent.contract import decode_message
from torchdoctor.instrument.wire import WriterSink

BOOTSTRAP_DIR = str(Path(__file__).resolve().parent / "bootstrap")
_MAX_MESSAGE = 1 << 20  # far above what one agent message holds (contract.message_steps)


def bootstrap_env(env: dict[str, str], address: str) -> dict[str, str]:
    """``env`` with the bootstrap first on PYTHONPATH and the collector address set."""
    out = dict(env)
    current = out.get("PYTHONPATH", "")
    parts = [p for p in current.split(os.pathsep) if p and p != BOOTSTRAP_DIR]
    out["PYTHONPATH"] = os.pathsep.join([BOOTSTRAP_DIR, *parts])
    out[agent_mod.ENV_COLLECTOR] = address
    return out


class Collector:
    """Listens for the job's agents and writes what they send into ``writer``.

    Never raises: when it cannot listen it warns once on stderr and :meth:`child_env` leaves
    the environment unchanged (the job then runs uninstrumented).
    """

    def __init__(self, writer, *, warn=None) -> None:
        self.sink = WriterSink(writer)
        self.address: str | None = None
        self.error: str | None = None
        self._warn = warn or _warn_stderr
        self._dir: str | None = None
        self._listener: socket.socket | None = None
        self._stop = threading.Event()
        self._deadline = 0.0
        self._thread: threading.Thread | None = None
        self.connections = 0
        try:
            self._listen()
        except OSError as exc:
            self._cleanup()
            self.error = f"{type(exc).__name__}: {exc}"
            self._warn(
                f"torchdoctor: warning: cannot listen for the job's instrumentation ({exc}); "
                "steps, data wait and settings will not be recorded"
            )
            return
        self._buffer = bytearray(_MAX_MESSAGE)
        self._view = memoryview(self._buffer)
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(
            target=self._loop, name="torchdoctor-collector", daemon=True
        )
        self._thread.start()

    @property
    def listening(self) -> bool:
        return self._listener is not None

    def _listen(self) -> None:
        last: OSError | None = None
        # A long TMPDIR can exceed the 107-byte limit of a socket path: fall back to /tmp.
        for base in (None, "/tmp"):
            folder = tempfile.mkdtemp(prefix="torchdoctor-", dir=base)
            path = os.path.join(folder, "agent.sock")
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                sock.bind(path)
                sock.listen(128)
            except OSError as exc:
                sock.close()
                shutil.rmtree(folder, ignore_errors=True)
                last = exc
                continue
            sock.setblocking(False)
            self._dir, self._listener, self.address = folder, sock, path
            return
        assert last is not None
        raise last

    def child_env(self, env: dict[str, str]) -> dict[str, str]:
        """The environment for the job: instrumented unless the collector could not listen or
        ``TORCHDOCTOR_NO_INSTRUMENT`` is set."""
        if self.address is None or agent_mod.env_flag(env.get(agent_mod.ENV_NO_INSTRUMENT)):
            return env
        return bootstrap_env(env, self.address)

    # -- receiving ------------------------------------------------------------------------

    def _loop(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ, "listen")
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        conns: list[socket.socket] = []
        try:
            while True:
                stopping = self._stop.is_set()
                events = sel.select(0.05 if stopping else None)
                busy = False
                for key, _ in events:
                    if key.data == "wake":
                        self._wake_r.recv(64)
                    elif key.data == "listen":
                        busy |= self._accept(sel, conns)
                    else:
                        busy |= self._receive(sel, conns, key.fileobj)
                if stopping and (not busy or time.monotonic() > self._deadline):
                    # Everything the exited job sent is already queued on the connections:
                    # the loop ends once a round finds nothing more (or time is up).
                    break
        finally:
            for conn in conns:
                conn.close()
            sel.close()

    def _accept(self, sel, conns) -> bool:
        accepted = False
        while True:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return accepted
            except OSError:
                return accepted
            conn.setblocking(False)
            sel.register(conn, selectors.EVENT_READ, "conn")
            conns.append(conn)
            self.connections += 1
            accepted = True

    def _receive(self, sel, conns, conn) -> bool:
        got = False
        while True:
            try:
                size = conn.recv_into(self._buffer)
            except (BlockingIOError, InterruptedError):
                return got
            except OSError:
                size = 0
            if not size:
                sel.unregister(conn)
                conns.remove(conn)
                conn.close()
                return True
            got = True
            try:
                message = decode_message(bytes(self._view[:size]))
            except (ValueError, TypeError):  # malformed (UnicodeDecodeError is a ValueError)
                self.sink.errors += 1
                continue
            try:
                self.sink(message)
            except Exception as exc:  # noqa: BLE001 - a writer problem must not stop receiving
                self.sink.errors += 1
                self.error = f"{type(exc).__name__}: {exc}"

    # -- closing --------------------------------------------------------------------------

    def close(self, timeout: float = 2.0) -> None:
        """Write what is still in flight (for at most ``timeout`` s), then stop listening."""
        if self._thread is not None:
            self._deadline = time.monotonic() + timeout
            self._stop.set()
            with contextlib.suppress(OSError):
                self._wake_w.send(b"x")
            self._thread.join(timeout + 1.0)
            self._thread = None
            self._wake_r.close()
            self._wake_w.close()
        self._cleanup()
        # Traces of profiler windows still being read into the recording (wire.WriterSink).
        self.sink.finish()

    def _cleanup(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> Collector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _warn_stderr(message: str) -> None:
    print(message, file=sys.stderr)
