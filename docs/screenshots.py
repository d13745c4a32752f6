"""Real screenshots for the README and the manual: docs/images/top.png, report.png and compare.png.

- top.png: `torchdoctor top` in a 100x30 tmux window while the bundled example job trains; the
  pane (with its colours, `capture-pane -e`) is drawn by rich as SVG and photographed by
  headless Chromium, the same browser the report tests drive (tests/report/cdp_browser.py).
- report.png: the HTML report of a recording of the example job as written (its default 300
  steps: data-bound), as headless Chromium shows it in a 1280x900 window.
- compare.png: `torchdoctor report A B` of that recording and one with the settings the
  diagnosis prints on 2 CPUs (`--num-workers 2 --threads 1`), the same window.

Take them on a quiet machine: top shows the machine's load and every process on it, and a
busy machine's steps are not the example's.

    python docs/screenshots.py      # needs tmux and chromium (`make system` installs both)
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
IMAGES = DOCS / "images"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))

from rich.console import Console  # noqa: E402
from rich.text import Text  # noqa: E402
from tests.report.cdp_browser import Chromium, find_chromium  # noqa: E402


def _env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH", "")
    src = str(ROOT / "src")
    return {**os.environ, "PYTHONPATH": f"{src}:{path}" if path else src, "TERM": "xterm-256color"}


def _photograph(browser: Chromium, url: str, path: Path, width: int, height: int) -> None:
    browser.send(
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
    )
    browser.load(url)
    clip = {"x": 0, "y": 0, "width": width, "height": height, "scale": 1}
    shot = browser.send("Page.captureScreenshot", {"format": "png", "clip": clip})
    path.write_bytes(base64.b64decode(shot["data"]))
    print(f"wrote {path.relative_to(ROOT)}")


def top_pane(work: Path) -> str:
    """The ANSI text of `torchdoctor top` once it shows the example job with its steps."""
    session = f"td-shot-{uuid.uuid4().hex[:8]}"
    tmux = ["tmux", "-L", session]
    job = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "examples" / "train.py"),
            # Long enough to still train when the picture is taken (ended by the finally
            # below): at 100 steps it ended within the seconds top takes to fill its rates,
            # and the picture showed no job.
            "--steps",
            "5000",
            "--batch-size",
            "4",
        ],
        cwd=work,
        env=_env(),
        stdout=subprocess.DEVNULL,
    )
    top = f"{sys.executable} -m torchdoctor top --interval 1"
    subprocess.run(
        [*tmux, "new-session", "-d", "-s", session, "-x", "100", "-y", "30", top],
        check=True,
        env=_env(),
    )
    try:
        deadline = time.monotonic() + 90
        pane = ""
        while time.monotonic() < deadline:
            plain = subprocess.run(
                [*tmux, "capture-pane", "-p", "-t", session], capture_output=True, text=True
            ).stdout
            if "train.py" in plain:
                pane = subprocess.run(
                    [*tmux, "capture-pane", "-e", "-p", "-t", session],
                    capture_output=True,
                    text=True,
                ).stdout
                # a few refreshes more: the step rate and sparklines fill in
                time.sleep(4)
                pane = subprocess.run(
                    [*tmux, "capture-pane", "-e", "-p", "-t", session],
                    capture_output=True,
                    text=True,
                ).stdout
                break
            time.sleep(0.5)  # top draws on its own clock; there is no event to wait on
        if not pane:
            raise RuntimeError("top never showed the example job")
        return pane
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)
        job.terminate()
        job.wait()


def record_example(work: Path, name: str, *args: str) -> Path:
    """A recording of the bundled example run as a user runs it, `python train.py ...` from
    examples/, so that the report's header shows that command and not this machine's paths."""
    out = work / f"{name}.sqlite"
    env = _env()
    # `python` found on PATH is this interpreter: the command line reads as the user's.
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    subprocess.run(
        [sys.executable, "-m", "torchdoctor", "run", "--quiet", "--out", str(out)]
        + ["--", "python", "train.py", *args],
        cwd=ROOT / "examples",
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return out


def main() -> int:
    chromium = find_chromium()
    if chromium is None or shutil.which("tmux") is None:
        print("screenshots: needs chromium and tmux (`make system`)", file=sys.stderr)
        return 2
    IMAGES.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="td-shots-") as tmp:
        work = Path(tmp)
        pane = top_pane(work)
        console = Console(record=True, width=100, file=open(os.devnull, "w"))  # noqa: SIM115
        console.print(Text.from_ansi(pane.rstrip("\n")))
        svg = work / "top.svg"
        svg.write_text(console.export_svg(title="torchdoctor top"), encoding="utf-8")
        recording = record_example(work, "as-written")
        advised = record_example(work, "advised", "--num-workers", "2", "--threads", "1")
        report = work / "report.html"
        compared = work / "compare.html"
        for args in ([recording, "-o", report], [recording, advised, "-o", compared]):
            subprocess.run(
                [sys.executable, "-m", "torchdoctor", "report", *map(str, args)],
                env=_env(),
                check=True,
            )
        browser = Chromium(chromium)
        try:
            browser.open_page()
            _photograph(browser, svg.as_uri(), IMAGES / "top.png", 1040, 720)
            _photograph(browser, report.as_uri(), IMAGES / "report.png", 1280, 900)
            _photograph(browser, compared.as_uri(), IMAGES / "compare.png", 1280, 900)
        finally:
            browser.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
