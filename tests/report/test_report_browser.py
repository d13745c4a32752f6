"""The HTML report opened in real headless Chromium: it renders, every chart is drawn with data
and its threshold bands, findings show, the hover read-out works, no script error, no request."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

import pytest
from cdp_browser import INSTALL_HINT, Chromium, find_chromium
from report_recordings import Spec, write_recording
from tests.helpers.engines import require_engine
from tests.helpers.machine_gpus import machine_gpus

from torchdoctor.report import write_report

HERE = Path(__file__).resolve().parent
CHARTS = ["cpu", "iowait", "disk", "memory", "swap", "gpu-util", "vram", "steps"]
BOXES = ["cpu", "cpu-cores", *CHARTS[1:]]
BANDED = {"cpu", "iowait", "swap", "vram"}


@pytest.fixture(scope="module")
def browser():
    executable = find_chromium()
    require_engine("chromium", None if executable else INSTALL_HINT)
    chromium = Chromium(executable)
    try:
        chromium.open_page()
        yield chromium
    finally:
        chromium.close()


def open_report(browser: Chromium, path: Path) -> None:
    browser.events.clear()
    browser.load(path.resolve().as_uri())


def assert_clean(browser: Chromium, path: Path) -> None:
    assert browser.problems() == []
    assert browser.requests() == [path.resolve().as_uri()]  # the page itself, nothing else


def chart_facts(browser: Chromium) -> dict:
    """Per chart box: drawn points per series, band kinds, unavailable text, rendered width."""
    return browser.evaluate(
        """(() => {
        const out = {};
        for (const box of document.querySelectorAll('figure.chart-box')) {
          const svg = box.querySelector('svg.chart');
          out[box.dataset.chart] = {
            cells: box.querySelectorAll('rect.cell').length,
            points: [...box.querySelectorAll('path.series')].map(p => +p.dataset.points),
            drawn: [...box.querySelectorAll('path.series')].map(p => p.getTotalLength() > 0),
            bands: [...box.querySelectorAll('rect.band')].map(r => r.classList[1]),
            unavailable: box.querySelector('.unavailable')?.textContent ?? null,
            width: svg ? svg.getBoundingClientRect().width : 0,
            legend: box.querySelectorAll('.legend .item').length,
          };
        }
        return out;
      })()"""
    )


def test_report_of_a_gpu_job_renders_every_chart_band_and_finding(browser, tmp_path):
    rec = write_recording(tmp_path / "gpu.sqlite", Spec(gpus=2))
    html, data = write_report(rec)
    open_report(browser, html)
    assert browser.evaluate("document.title").startswith("torchdoctor report: python train.py")
    facts = chart_facts(browser)
    assert list(facts) == BOXES
    heat = facts.pop("cpu-cores")
    assert heat["cells"] >= 16 and heat["width"] > 600  # at least one run of colour per CPU
    for chart_id, f in facts.items():
        assert f["unavailable"] is None, chart_id
        assert f["points"] and all(n > 0 for n in f["points"]), chart_id
        assert all(f["drawn"]), chart_id  # the path really has a length on screen
        assert f["width"] > 600, chart_id
        assert f["legend"] == len(f["points"]), chart_id
    for chart_id in BANDED:
        assert sorted(facts[chart_id]["bands"]) == ["band-alert", "band-best"], chart_id
    findings = browser.evaluate(
        "[...document.querySelectorAll('article.finding')].map(a => "
        "[a.dataset.finding, a.querySelector('.recommendation').textContent, "
        "a.querySelectorAll('tbody tr').length])"
    )
    assert [f[0] for f in findings] == [f.id for f in data.findings]
    assert "dataloader-bound" in [f[0] for f in findings]
    assert all(len(text) > len("Recommendation") + 10 and rows > 0 for _, text, rows in findings)
    # Findings and their timelines link to each other, and every link lands on something.
    links = browser.evaluate(
        "[...document.querySelectorAll('.finding .see a, .related a')].map(a => "
        "[a.getAttribute('href'), !!document.querySelector(a.getAttribute('href'))])"
    )
    assert ["#chart-steps", True] in links and ["#finding-0", True] in links
    assert all(ok for _, ok in links)
    verdict = browser.evaluate("document.querySelector('.verdict').textContent")
    assert data.findings[0].title in verdict
    rows = browser.evaluate("document.querySelectorAll('table.tree tbody tr').length")
    assert rows == 5  # trainer and four workers
    assert_clean(browser, html)


def test_hovering_a_chart_reads_out_the_values_at_that_time(browser, tmp_path):
    html, _ = write_report(write_recording(tmp_path / "cpu.sqlite"))
    open_report(browser, html)
    box = browser.evaluate(
        """(() => { const s = document.querySelector('#chart-memory svg');
        s.scrollIntoView({block: 'center'}); const r = s.getBoundingClientRect();
        return [r.x, r.y, r.width, r.height]; })()"""
    )
    before = browser.evaluate(
        "[...document.querySelectorAll('#chart-memory .legend .val')].map(e => e.textContent)"
    )
    assert all(text.startswith("mean ") for text in before)
    x, y, w, h = box
    browser.mouse_move(x + w * 0.5, y + h * 0.5)
    after = browser.evaluate(
        "[...document.querySelectorAll('#chart-memory .legend .val')].map(e => e.textContent)"
    )
    when = browser.evaluate("document.querySelector('#chart-memory .legend .at').textContent")
    assert when.startswith("at 0:")
    assert all(text.endswith("GiB") and not text.startswith("mean") for text in after)
    assert (
        browser.evaluate(
            "document.querySelector('#chart-memory line.crosshair').getAttribute('visibility')"
        )
        == "visible"
    )
    browser.mouse_move(x + w * 0.5, y - 40)  # leave the chart: the summary comes back
    assert (
        browser.evaluate(
            "[...document.querySelectorAll('#chart-memory .legend .val')].map(e => e.textContent)"
        )
        == before
    )
    assert_clean(browser, html)


def test_without_a_gpu_the_gpu_charts_say_why(browser, tmp_path):
    html, _ = write_report(
        write_recording(
            tmp_path / "cpu.sqlite",
            Spec(nvml_reason="no NVIDIA driver: libnvidia-ml.so.1 not found"),
        )
    )
    open_report(browser, html)
    facts = chart_facts(browser)
    for chart_id in ("gpu-util", "vram"):
        assert facts[chart_id]["unavailable"] == (
            "no GPU / NVML unavailable: no NVIDIA driver: libnvidia-ml.so.1 not found"
        )
        assert facts[chart_id]["points"] == [] and facts[chart_id]["width"] == 0
    assert all(facts[c]["points"] for c in CHARTS if c not in ("gpu-util", "vram"))
    assert_clean(browser, html)


def test_report_of_a_real_recorded_training_job(browser, tmp_path, td):
    """`torchdoctor run` on a real torch loop, then `torchdoctor report`, then the browser."""
    rec = tmp_path / "tiny.sqlite"
    ran = td(
        "run",
        "--interval",
        "0.1",
        "--out",
        str(rec),
        "--",
        sys.executable,
        str(HERE / "tiny_train.py"),
    )
    assert ran.returncode == 0, ran.stderr
    made = td("report", str(rec))
    assert made.returncode == 0, made.stderr
    html = rec.with_suffix(".html")
    assert f"report written to {html}" in made.stdout
    open_report(browser, html)
    facts = chart_facts(browser)
    for chart_id in ("cpu", "memory", "steps"):
        assert facts[chart_id]["points"] and all(n > 0 for n in facts[chart_id]["points"]), chart_id
    if machine_gpus().available:  # a VRAM line per device, drawn from the samples
        assert facts["vram"]["points"] and not facts["vram"]["unavailable"]
    else:
        assert "no GPU / NVML unavailable" in facts["vram"]["unavailable"]
    assert facts["cpu-cores"]["cells"] >= len(os.sched_getaffinity(0))  # real /proc/stat figures
    roles = browser.evaluate(
        "[...document.querySelectorAll('table.tree .role')].map(e => e.textContent)"
    )
    assert roles[0] == "trainer" and "dataloader-worker" in roles
    settings = browser.evaluate(
        "[...document.querySelectorAll('table.settings td.mono')].map(e => e.textContent)"
    )
    assert "torch.num_threads" in settings and "optimizer.class" in settings
    loaders = browser.evaluate("document.querySelectorAll('#settings table')[1].rows.length")
    assert loaders >= 2  # header and the DataLoader
    browser.screenshot(tmp_path / "report.png")
    assert (tmp_path / "report.png").stat().st_size > 50_000
    assert_clean(browser, html)


def test_text_from_the_job_cannot_break_out_of_the_page(browser, tmp_path):
    """Command lines and device names are the job's text: shown as text, never run as code."""
    evil = "</script><img src=x onerror=\"document.title='owned'\"><!--"
    spec = Spec(gpus=1, command=("python", "-c", evil), gpu_name=f"GPU {evil}")
    html, _ = write_report(write_recording(tmp_path / "evil.sqlite", spec))
    open_report(browser, html)
    assert browser.evaluate("document.title").startswith("torchdoctor report: python -c")
    assert browser.evaluate("document.querySelectorAll('img').length") == 0
    shown = browser.evaluate("document.querySelector('header .command').textContent")
    assert shown == "$ " + shlex.join(spec.command)
    facts = chart_facts(browser)
    assert list(facts) == BOXES and all(facts[c]["points"] for c in CHARTS)
    assert browser.evaluate("document.querySelector('#chart-vram').dataset.interactive") == "yes"
    assert_clean(browser, html)
