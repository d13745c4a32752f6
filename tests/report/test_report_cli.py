"""`torchdoctor report FILE [-o report.html] [--thresholds FILE]` as a user runs it."""

from __future__ import annotations

import hashlib
import re
from html.parser import HTMLParser

import pytest
from report_recordings import Spec, write_recording


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    return write_recording(tmp_path_factory.mktemp("rec") / "job.sqlite", Spec(gpus=1))


class TagBalance(HTMLParser):
    """Every element the report opens it also closes, in order (browsers forgive; we do not)."""

    VOID = {"meta", "br", "img", "input", "link", "hr", "rect", "line", "path", "circle"}

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.errors: list[str] = []

    def handle_starttag(self, tag, attrs) -> None:
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag) -> None:
        if tag in self.VOID:
            return
        if self.stack and self.stack[-1] == tag:
            self.stack.pop()
        else:
            self.errors.append(f"</{tag}> at {self.getpos()} inside {self.stack[-3:]}")


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_default_output_is_beside_the_recording_and_self_contained(recording, td):
    before = digest(recording)
    result = td("report", str(recording))
    assert result.returncode == 0, result.stderr
    html = recording.with_suffix(".html")
    assert result.stdout.splitlines()[0].startswith(f"report written to {html} (")
    assert "finding(s)" in result.stdout
    page = html.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>")
    # Nothing to fetch: no external script, style, image or font, and a policy that forbids it.
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert "@import" not in page and "url(" not in page
    assert "default-src 'none'" in page
    balance = TagBalance()
    balance.feed(page)
    assert balance.errors == [] and balance.stack == []
    assert digest(recording) == before  # the recording is read, never changed


def test_output_file_and_thresholds_file_are_honoured(recording, td, tmp_path):
    limits = tmp_path / "limits.toml"
    limits.write_text("[thresholds]\ncpu_load_alert_pct = 50\ncpu_load_best_pct = 40\n")
    out = tmp_path / "out" / "mine.html"
    out.parent.mkdir()
    result = td("report", str(recording), "-o", str(out), "--thresholds", str(limits))
    assert result.returncode == 0, result.stderr
    page = out.read_text(encoding="utf-8")
    assert "alert &gt; 50 % sustained" in page and "best ≤ 40 %" in page
    assert "alert &gt; 80 % sustained" not in page
    # The same job at the default limits: a report again, replaced whole.
    result = td("report", str(recording), "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert "alert &gt; 80 % sustained" in out.read_text(encoding="utf-8")
    assert [p.name for p in out.parent.iterdir()] == ["mine.html"]  # no temporary left behind


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: d / "missing.sqlite", "no such file"),
        (
            lambda d: (d / "notes.txt", (d / "notes.txt").write_text("hello"))[0],
            "not a torchdoctor recording",
        ),
    ],
)
def test_a_file_that_is_not_a_recording_is_one_clear_line(td, tmp_path, make, message):
    path = make(tmp_path)
    result = td("report", str(path))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("torchdoctor: error: ") and message in lines[0]
    assert not path.with_suffix(".html").exists()


def test_bad_output_places_are_refused_before_anything_is_written(recording, td, tmp_path):
    result = td("report", str(recording), "-o", str(tmp_path / "nowhere" / "r.html"))
    assert result.returncode == 2
    assert "does not exist" in result.stderr and result.stderr.count("\n") == 1
    result = td("report", str(recording), "-o", str(recording))
    assert result.returncode == 2 and "would overwrite the recording" in result.stderr
    result = td("report", str(recording), "-o", str(tmp_path))
    assert result.returncode == 2 and "is a folder" in result.stderr


def test_a_bad_thresholds_file_is_one_clear_line(recording, td, tmp_path):
    limits = tmp_path / "limits.toml"
    limits.write_text("cpu_load_alert = 50\n")
    result = td("report", str(recording), "--thresholds", str(limits))
    assert result.returncode == 2
    assert "unknown threshold 'cpu_load_alert'" in result.stderr


def test_instrumentation_that_switched_itself_off_is_said_at_the_top(td, tmp_path):
    path = write_recording(tmp_path / "off.sqlite", Spec(instrumentation_off_at=20.0))
    result = td("report", str(path))
    assert result.returncode == 0, result.stderr
    page = path.with_suffix(".html").read_text(encoding="utf-8")
    summary = page[page.index('<section id="summary">') : page.index('<section id="findings">')]
    assert (
        "switched itself off 20.0 s into the run" in summary
        and "RuntimeError: patched twice" in summary
    )
