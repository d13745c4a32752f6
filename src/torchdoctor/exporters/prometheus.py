"""Serving the series over HTTP: one collector built at scrape time, a private registry.

No series is updated in the background: each scrape reads what was recorded since the
previous one (the recording is the single source: the endpoint of ``torchdoctor run`` and the
host-wide exporter give the same numbers for a job) and builds fresh families, so a job or a
process that is gone leaves no stale series behind. Scrapes are serialised by a lock: the
HTTP server answers each in its own thread. The findings come from the diagnosis running
beside the scrapes in a thread of its own (``BackgroundDiagnosis``, on its CPU budget): a
scrape takes the latest findings as they stand and never waits for one.

Endpoints bind 127.0.0.1 unless an address is given: metrics name what runs on the machine,
and Prometheus' own advice is never to face public networks with them.

The HTTP side is a small server of our own writing the families with
:mod:`.exposition` (0.0.4 text, or OpenMetrics where asked for); each collector also
gives prometheus_client's Metric objects (``collect``), for a registry of its own.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

from torchdoctor.diagnosis.engine import rule_ids
from torchdoctor.diagnosis.rediagnosis import BackgroundDiagnosis
from torchdoctor.errors import UserError
from torchdoctor.exporters.exposition import LabelTexts, choose_format
from torchdoctor.exporters.jobstate import JobState
from torchdoctor.exporters.metrics import Families, add_gpus, add_host, add_job
from torchdoctor.recording.schema import TABLES, to_row
from torchdoctor.recording.tail import RecordingTail

DEFAULT_ADDRESS = "127.0.0.1"
# Clear of the exporters it sits beside: node 9100, dcgm 9400, nvitop 8000, Pushgateway 9091.
DEFAULT_EXPORTER_PORT = 9842


def parse_listen(text: str, option: str) -> tuple[str, int]:
    """``[ADDR:]PORT`` (``[::1]:PORT`` for IPv6) -> (address, port); 127.0.0.1 by default."""
    addr, sep, port_text = text.rpartition(":")
    if not sep:
        addr = DEFAULT_ADDRESS
    addr = addr.strip("[]") or DEFAULT_ADDRESS
    try:
        port = int(port_text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise UserError(f"{option} {text!r}: give [ADDR:]PORT with a port from 0 to 65535")
    return addr, port


class _JobSource:
    """One recording followed by a collector: its state and its findings, kept between scrapes."""

    def __init__(self, path: Path, findings: BackgroundDiagnosis | None) -> None:
        self.path = path
        self.run_id = path.stem
        self.user: str | None = None  # whose recording it is: the owner of the file
        self._findings = findings
        self.state: JobState | None = None
        self.error: str | None = None
        self.reported = False  # its error was logged: once a job, not once a scrape

    def update(self) -> JobState | None:
        try:
            if self.state is None:
                if not self.path.exists():
                    self.error = None  # not an error: the recorder is creating it
                    return None
                self.user = _owner(self.path)
                self.state = JobState(RecordingTail(self.path))
            self.state.update()
            self.error = None
        except Exception as exc:  # noqa: BLE001 - one job's recording never fails the scrape
            # Being created (no tables yet), not a regular file (a FIFO is never opened),
            # damaged or edited: this job is left out of this scrape, retried from the start
            # at the next one; every other job and the host are served.
            self.error = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
            self.close()
            return None
        return self.state

    def findings(self) -> dict[str, bool] | None:
        """{rule id: reported now}, one 0/1 series per rule; None while no diagnosis worked
        (it runs beside the scrapes, never inside one)."""
        if self._findings is None:
            return None
        latest = self._findings.latest(self.path)
        found = latest.findings if latest is not None else None
        if found is None:
            return None
        ids = {f.id for f in found}
        return {rule: rule in ids for rule in rule_ids()}

    def close(self) -> None:
        if self.state is not None:
            self.state.tail.close()
            self.state = None


def _jobs_up(f: Families, sources: Iterable[_JobSource], *, users: bool = False) -> None:
    """``job_recording_up 0`` for each job whose recording could not be read at this scrape
    (being created, not a regular file, damaged): the job's only series, as Prometheus' own
    ``up`` is a failed target's. With ``users``, labelled like its other series would be."""
    for src in sources:
        if src.state is None:
            labels = {"run_id": src.run_id}
            if users:
                labels["user"] = src.user or ""
            f.gauge("job_recording_up", "1 when the job's recording could be read.", labels, 0)


def _add_job_isolated(f: Families, src: _JobSource, job: JobState, **options: Any) -> None:
    """:func:`add_job`, taking back what it added when the job's figures fail to build (a
    value of the wrong type in an edited recording): the job shows as not readable."""
    mark = f.mark()
    try:
        add_job(f, job, src.findings(), **options)
    except Exception as exc:  # noqa: BLE001 - one job's figures never fail the scrape
        f.rollback(mark)
        src.error = f"{type(exc).__name__}: {exc}"
        src.close()


class _Collector:
    """What both collectors share: one scrape at a time, label texts kept between scrapes;
    a subclass builds the scrape's families (``_build``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._labels = LabelTexts()

    def _build(self) -> Families:
        raise NotImplementedError

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            return iter(list(self._build()))

    def expose(self, **options: Any) -> bytes:
        """One scrape's text (options: :func:`.exposition.encode`'s)."""
        with self._lock:
            return self._build().encode(self._labels, **options)


class JobCollector(_Collector):
    """The series of one job (``torchdoctor run --prometheus``), from its recording.

    The host and GPU series are the recording's latest host and GPU samples: the recorder
    already reads them for the job, so the endpoint adds no reading of its own.
    """

    def __init__(self, recording: str | Path, *, findings: bool = True) -> None:
        self._diagnosis = BackgroundDiagnosis() if findings else None
        self._source = _JobSource(Path(recording), self._diagnosis)
        if self._diagnosis is not None:
            self._diagnosis.follow([self._source.path])  # first findings before first scrape
        super().__init__()

    def _build(self) -> Families:
        f = Families()
        job = self._source.update()
        if job is not None:
            _add_job_isolated(f, self._source, job)
        if self._source.state is None or job is None:
            _jobs_up(f, [self._source])
            return f
        if job.host is not None:
            add_host(f, job.host)
        gpus_meta = job.meta.get("gpus") or {}
        add_gpus(f, bool(gpus_meta.get("available")), job.gpus.values(), gpus_meta)
        return f

    def close(self) -> None:
        if self._diagnosis is not None:
            self._diagnosis.close()
        with _held(self._lock) as held:
            if held:
                self._source.close()


class HostCollector(_Collector):
    """The machine, read at each scrape, plus every job announced in the registry.

    ``host`` and ``gpus`` are a HostReader and a GpuReader (or None to leave them out);
    ``jobs`` returns the recordings of the jobs running now (the registry ``top`` uses).
    """

    def __init__(
        self,
        host,
        gpus,
        jobs: Callable[[], list[Path]],
        *,
        findings: bool = True,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        self._host = host
        self._gpus = gpus
        self._jobs = jobs
        self._warn = warn  # told once per job whose recording cannot be read
        self._findings = BackgroundDiagnosis() if findings else None
        self._sources: dict[Path, _JobSource] = {}
        super().__init__()

    def _build(self) -> Families:
        f = Families()
        t0 = time.thread_time()
        if self._host is not None:
            add_host(f, _flat("host_samples", self._host.read()))
        if self._gpus is not None:
            samples, _ = self._gpus.read(set())
            status = self._gpus.status
            add_gpus(
                f,
                status.available,
                [_flat("gpu_samples", g) for g in samples],
                {
                    "driver_version": status.driver_version,
                    "gpus": [{"index": g.index, "name": g.name} for g in status.gpus],
                },
            )
        paths = self._jobs()
        for path in paths:
            if path not in self._sources:
                self._sources[path] = _JobSource(path, self._findings)
        for path in [p for p in self._sources if p not in set(paths)]:
            self._sources.pop(path).close()
        for src in self._sources.values():
            job = src.update()
            if job is not None:
                _add_job_isolated(f, src, job, user=src.user or "")
            if src.error is not None and not src.reported and self._warn is not None:
                src.reported = True
                self._warn(f"job recording {str(src.path)!r} left out: {src.error}")
        if self._findings is not None:
            # After the jobs are read: a new job's first diagnosis, in its thread, would
            # otherwise run beside its first read and double that scrape's time (20 jobs with
            # a minute of history: 446 ms of CPU and 877 ms of wall, against 207 ms). Only
            # the recordings read: the diagnosis must not open one that is not a regular file.
            self._findings.follow([p for p, src in self._sources.items() if src.state is not None])
        _jobs_up(f, self._sources.values(), users=True)
        f.gauge("exporter_jobs", "Recorded jobs found running on the machine.", {}, len(paths))
        f.gauge("exporter_collect_cpu_seconds", "CPU time this scrape took to build.", {},
                time.thread_time() - t0)  # fmt: skip
        return f

    def close(self) -> None:
        if self._findings is not None:
            self._findings.close()
        with _held(self._lock) as held:
            if held:
                for src in self._sources.values():
                    src.close()
                self._sources.clear()


# How long close() waits for a scrape in progress: past that the process is ending anyway, and
# a scrape stuck in a read must not keep Ctrl-C from stopping the exporter.
CLOSE_WAIT_S = 5.0


@contextlib.contextmanager
def _held(lock: threading.Lock) -> Iterator[bool]:
    """``lock`` for closing, if it came within CLOSE_WAIT_S: whether it did. Without it the
    caller leaves the sources open (a stuck scrape uses them; they go with the process)."""
    got = lock.acquire(timeout=CLOSE_WAIT_S)
    try:
        yield got
    finally:
        if got:
            lock.release()


def _owner(path: Path) -> str | None:
    import pwd

    try:
        uid = path.stat().st_uid
    except OSError:
        return None
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _flat(table: str, record: Any) -> dict[str, Any]:
    """A sample as the flattened row the recording would store (what the builders read)."""
    spec = TABLES[table]
    return dict(zip(spec.column_names, to_row(spec, record), strict=True))


def registry_for(collector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


class Exposing(Protocol):
    def expose(self, **options: Any) -> bytes: ...


class _Handler(BaseHTTPRequestHandler):
    """GET on any path: the metrics (gzipped where the scraper accepts it); nothing logged,
    the terminal is the job's."""

    server: _Server

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        if url.path == "/favicon.ico":  # a browser's second request
            self._answer(200, b"", None)
            return
        openmetrics, content_type = choose_format(self.headers.get("Accept"))
        names = parse_qs(url.query).get("name[]")
        try:
            body = self.server.collector.expose(
                openmetrics=openmetrics, names=set(names) if names else None
            )
        except Exception:
            # The scraper sees a failed scrape; the traceback goes where the server's go.
            self._answer(500, b"# HTTP 500: the metrics could not be built\n", None)
            raise
        self._answer(200, body, content_type)

    def do_OPTIONS(self) -> None:
        self._answer(200, b"", None, allow=True)

    def _not_allowed(self) -> None:
        self._answer(405, f"# HTTP 405: {self.command}; use OPTIONS or GET\n".encode(), None,
                     allow=True)  # fmt: skip

    do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _not_allowed

    def _answer(
        self, status: int, body: bytes, content_type: str | None, allow: bool = False
    ) -> None:
        accepted = (self.headers.get("Accept-Encoding") or "").split(",")
        gzipped = bool(body) and any(e.split(";")[0].strip().lower() == "gzip" for e in accepted)
        if gzipped:
            body = gzip.compress(body)
        self.send_response(status)
        if content_type:
            self.send_header("Content-Type", content_type)
        if gzipped:
            self.send_header("Content-Encoding", "gzip")
        if allow:
            self.send_header("Allow", "OPTIONS,GET")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a scrape in progress never holds the process at exit

    def __init__(self, address: tuple[str, int], family: int, collector: Exposing) -> None:
        self.address_family = family
        self.collector = collector
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        # HTTPServer's own looks the host name up (getfqdn), which can wait on DNS.
        super(ThreadingHTTPServer, self).server_bind()
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)


def serve(collector: Exposing, address: str, port: int) -> _Server:
    """Start serving ``collector`` on ``address:port`` in a daemon thread; the server.

    Raises OSError (``errno.EADDRINUSE`` when the port is taken); :func:`bind_error` words it.
    """
    # The address's own family: "::1" or "::" is served over IPv6.
    infos = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, sockaddr = infos[0]
    server = _Server(sockaddr[:2], family, collector)
    threading.Thread(target=server.serve_forever, name="torchdoctor-metrics", daemon=True).start()
    return server


def bind_error(exc: OSError, address: str, port: int) -> str:
    """One line saying why ``address:port`` cannot be served."""
    if exc.errno == errno.EADDRINUSE:
        why = "the address is already in use"
    elif exc.errno == errno.EADDRNOTAVAIL:
        why = "no interface of this machine has that address"
    elif exc.errno == errno.EACCES:
        why = "permission denied (ports below 1024 need privileges)"
    else:
        why = exc.strerror or str(exc)
    return f"cannot serve Prometheus metrics on {address}:{port}: {why}"


def stop(server) -> None:
    server.shutdown()
    server.server_close()
