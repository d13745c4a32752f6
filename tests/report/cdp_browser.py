"""Real headless Chromium, driven over the DevTools protocol on a pipe.

``--remote-debugging-pipe`` makes Chromium read protocol messages from fd 3 and write its
answers to fd 4, NUL-separated JSON. No port to pick or race for, no websocket library, and
the browser dies with its pipes: the most robust way to drive it from a test (Playwright and
Puppeteer use the same channel).
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",  # containers often have a 64 MB /dev/shm; Chromium needs more
    "--disable-quic",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--disable-features=Translate,MediaRouter,OptimizationHints",
    "--hide-scrollbars",
    "--mute-audio",
    "--window-size=1280,900",
]

INSTALL_HINT = (
    "the report tests need Debian's Chromium: `apt-get install -y chromium` "
    "(or `make browser`, which the test target runs)"
)


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _lift(fd: int) -> int:
    high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return high


class BrowserError(RuntimeError):
    pass


class Chromium:
    """One headless Chromium with one page; records console, exceptions and requests."""

    # A hang detector, not a speed requirement: Chromium's first answer on a loaded 2-core
    # machine can take tens of seconds.
    def __init__(self, executable: str, timeout: float = 120.0) -> None:
        self.timeout = timeout
        self.profile = tempfile.mkdtemp(prefix="td-chromium-")
        self.log_path = Path(self.profile) / "stderr.log"
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()
        # Lift the child's ends above fd 9 so that moving them onto 3 and 4 cannot clobber one
        # with the other; bash (unlike dash) accepts such fd numbers in redirections.
        to_child_r = _lift(to_child_r)
        from_child_w = _lift(from_child_w)
        args = [*FLAGS, f"--user-data-dir={self.profile}", "--remote-debugging-pipe", "about:blank"]
        script = (
            f'exec "$0" "$@" 3<&{to_child_r} 4>&{from_child_w} {to_child_r}<&- {from_child_w}>&-'
        )
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                ["bash", "-c", script, executable, *args],
                pass_fds=(to_child_r, from_child_w),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )
        os.close(to_child_r)
        os.close(from_child_w)
        self._next_id = 0
        self._inbox: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.events: list[dict[str, Any]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.session: str | None = None

    # -- protocol ----------------------------------------------------------------------
    def _read(self) -> None:
        buffer = b""
        while True:
            try:
                chunk = os.read(self._from_child, 1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                self._inbox.put(None)
                return
            buffer += chunk
            while b"\0" in buffer:
                message, buffer = buffer.split(b"\0", 1)
                self._inbox.put(json.loads(message))

    def send(
        self, method: str, params: dict[str, Any] | None = None, *, browser: bool = False
    ) -> dict:
        """Send a command (to the page's session unless ``browser``) and return its result."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if not browser:
            message["sessionId"] = self.session
        os.write(self._to_child, json.dumps(message).encode() + b"\0")
        reply = self._wait(lambda m: m.get("id") == self._next_id)
        if "error" in reply:
            raise BrowserError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def wait_event(self, method: str) -> dict[str, Any]:
        for event in self.events:
            if event["method"] == method and not event.get("_seen"):
                event["_seen"] = True
                return event
        event = self._wait(lambda m: m.get("method") == method)
        event["_seen"] = True
        return event

    def _wait(self, match) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BrowserError(
                    f"Chromium did not answer within {self.timeout} s\n{self.stderr_tail()}"
                )
            try:
                message = self._inbox.get(timeout=left)
            except queue.Empty:
                continue
            if message is None:
                raise BrowserError(
                    f"Chromium closed its pipe (exit {self.proc.poll()})\n{self.stderr_tail()}"
                )
            if "method" in message:
                self.events.append(message)
            if match(message):
                return message

    # -- page ----------------------------------------------------------------------------
    def open_page(self) -> None:
        target = self.send("Target.createTarget", {"url": "about:blank"}, browser=True)
        attached = self.send(
            "Target.attachToTarget", {"targetId": target["targetId"], "flatten": True}, browser=True
        )
        self.session = attached["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.send(f"{domain}.enable")

    def load(self, url: str) -> None:
        self.send("Page.navigate", {"url": url})
        self.wait_event("Page.loadEventFired")

    def evaluate(self, expression: str) -> Any:
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression!r} raised {result['exceptionDetails']}")
        return result["result"].get("value")

    def mouse_move(self, x: float, y: float) -> None:
        self.send("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": x, "y": y})

    def screenshot(self, path: Path) -> None:
        """A PNG of the whole page, not only the window."""
        size = self.evaluate(
            "[document.documentElement.scrollWidth, document.documentElement.scrollHeight]"
        )
        clip = {"x": 0, "y": 0, "width": size[0], "height": size[1], "scale": 1}
        shot = self.send(
            "Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True, "clip": clip}
        )
        path.write_bytes(base64.b64decode(shot["data"]))

    # -- what the page did ------------------------------------------------------------------
    def problems(self) -> list[str]:
        """JavaScript exceptions, console errors and warnings, and browser log errors."""
        out = []
        for e in self.events:
            p = e.get("params", {})
            if e["method"] == "Runtime.exceptionThrown":
                out.append(
                    f"exception: {p['exceptionDetails'].get('text')} {p['exceptionDetails'].get('exception', {}).get('description', '')}"
                )
            elif e["method"] == "Runtime.consoleAPICalled" and p.get("type") in (
                "error",
                "warning",
                "assert",
            ):
                out.append(
                    f"console.{p['type']}: {[a.get('value', a.get('description')) for a in p.get('args', [])]}"
                )
            elif e["method"] == "Log.entryAdded" and p["entry"]["level"] in ("error", "warning"):
                out.append(
                    f"log {p['entry']['level']}: {p['entry'].get('text')} {p['entry'].get('url', '')}"
                )
        return out

    def requests(self) -> list[str]:
        return [
            e["params"]["request"]["url"]
            for e in self.events
            if e["method"] == "Network.requestWillBeSent"
        ]

    def stderr_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.send("Browser.close", browser=True)
        except (BrowserError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self._to_child, self._from_child):
            with contextlib.suppress(OSError):
                os.close(fd)
        shutil.rmtree(self.profile, ignore_errors=True)
