"""A real Prometheus server for the tests: Debian's /usr/bin/prometheus, started on 127.0.0.1
with a temporary config and storage, scraping every second, stopped by its PID."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    def __init__(self, url: str, proc: subprocess.Popen) -> None:
        self.url = url
        self.proc = proc

    def api(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=10) as resp:
            body = json.loads(resp.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query; the result vector."""
        return self.api("/api/v1/query", query=expr)["result"]


def wait_for(what: str, check: Callable[[], Any], deadline_s: float = 90.0, every_s: float = 0.2):
    """Poll ``check`` until it returns something truthy (returned), failing after the deadline."""
    end = time.monotonic() + deadline_s
    last_error: Exception | None = None
    while time.monotonic() < end:
        try:
            result = check()
            if result:
                return result
        except (OSError, AssertionError, KeyError) as exc:
            last_error = exc
        time.sleep(every_s)  # polling interval of a wait on an event, not a synchronisation
    raise AssertionError(f"timed out waiting for {what} (last error: {last_error})")


@contextlib.contextmanager
def prometheus(tmp: Path, targets: list[str]) -> Iterator[Prometheus]:
    """A Prometheus scraping ``targets`` (host:port) every second."""
    config = tmp / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
        "scrape_configs:\n  - job_name: torchdoctor\n    static_configs:\n"
        f"      - targets: {json.dumps(targets)}\n"
    )
    port = free_port()
    log = open(tmp / "prometheus.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    server = Prometheus(f"http://127.0.0.1:{port}", proc)
    try:

        def ready() -> bool:
            assert proc.poll() is None, (tmp / "prometheus.log").read_text()
            with urllib.request.urlopen(f"{server.url}/-/ready", timeout=2) as resp:
                return resp.status == 200

        wait_for("Prometheus to be ready", ready)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
