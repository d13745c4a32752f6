"""Where the agent's messages go: one non-blocking ``SOCK_SEQPACKET`` connection per process
to the collector (instrument/collector.py), reopened in a forked child."""

import os
import time

from .contract import MAX_PENDING_MESSAGES, encode_message


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
        self._pending.append(encode_message(message))
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
        deadline = time.perf_counter() + self.exit_timeout
        while self._pending:
            try:
                sock.send(self._pending[0])
            except BlockingIOError:
                if not block or time.perf_counter() > deadline:
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


def close_sink(sink) -> None:
    """Deliver what ``sink`` holds and let it go (sinks without ``close`` hold nothing)."""
    close = getattr(sink, "close", None)
    if close is not None:
        close()
