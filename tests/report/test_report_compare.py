"""`torchdoctor report A B`: several runs in one page, opened in real headless Chromium. Both
runs' curves are drawn on one time axis from each run's start, the phases side by side, the
settings that differ in a table, compare's verdict on top; the command line as a user runs it
(exit status, --json against its schema, a short run refused in one line)."""

from __future__ import annotations

import json

import pytest
from report_recordings import Spec, write_recording
from test_report_browser import assert_clean, browser, open_report  # noqa: F401 (fixture)
from tests.helpers.schemas import assert_valid

from torchdoctor.errors import UserError
from torchdoctor.report.comparison import write_comparison_report


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pair")
    # B: the same job with 2 workers instead of 4, recorded for 40 s instead of 60.
    a = write_recording(folder / "a.sqlite", Spec(seconds=60, workers=4))
    b = write_recording(folder / "b.sqlite", Spec(seconds=40, workers=2))
    return a, b


def test_report_of_two_runs_draws_both_curves_and_the_diff_table(browser, pair, tmp_path):  # noqa: F811
    a, b = pair
    html, comparisons = write_comparison_report([a, b], tmp_path / "ab.html")
    assert len(comparisons) == 1
    open_report(browser, html)
    assert_clean(browser, html)
    facts = browser.evaluate(
        """(() => {
        const out = {};
        for (const box of document.querySelectorAll('figure.chart-box')) {
          const paths = [...box.querySelectorAll('path.series')];
          out[box.dataset.chart] = {
            labels: [...box.querySelectorAll('.legend .item')].map(i => i.textContent.trim()),
            drawn: paths.map(p => p.getTotalLength() > 0),
            dashed: paths.map(p => p.classList.contains('dashed')),
            right: paths.map(p => p.getBBox().x + p.getBBox().width),
          };
        }
        return out;
      })()"""
    )
    steps = facts["steps"]
    assert [label[:2] for label in steps["labels"]] == ["A:"] * (len(steps["labels"]) // 2) + [
        "B:"
    ] * (len(steps["labels"]) // 2)
    assert steps["drawn"] and all(steps["drawn"])
    assert steps["dashed"][0] is False and steps["dashed"][-1] is True
    # One time axis from each run's start: B (40 s) ends well left of A (60 s).
    assert steps["right"][-1] < 0.8 * steps["right"][0]
    for chart_id in ("cpu", "memory"):
        assert any(x.startswith("A:") for x in facts[chart_id]["labels"]), chart_id
        assert any(x.startswith("B:") for x in facts[chart_id]["labels"]), chart_id
        assert all(facts[chart_id]["drawn"]), chart_id
    diff = browser.evaluate(
        """[...document.querySelectorAll('table.diff[data-diff="settings"] tbody tr')]
           .map(r => [...r.cells].map(c => c.textContent))"""
    )
    assert ["dataloader.num_workers", "4", "2"] in diff
    verdict = browser.evaluate("document.querySelector('#verdict .verdict').textContent")
    assert verdict.startswith("B vs A: ") and "95 % interval" in verdict
    bars = browser.evaluate(
        """[...document.querySelectorAll('table.phase-bars tbody tr')].map(r =>
           [r.dataset.phase, r.querySelectorAll('.bar').length,
            Math.round(r.querySelector('.bar').getBoundingClientRect().width)])"""
    )
    assert {row[0] for row in bars} >= {"step", "data_wait", "compute"}
    assert all(n == 2 and width > 0 for _, n, width in bars)


def test_report_command_with_two_recordings(pair, td, tmp_path):
    a, b = pair
    out = tmp_path / "cmp.html"
    result = td("report", str(a), str(b), "-o", str(out))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"report written to {out} (")
    assert lines[1].startswith("  B vs A: ")
    again = td("report", str(a), str(b), "-o", str(out), "--json")
    assert again.returncode == 0, again.stderr
    doc = assert_valid("report", json.loads(again.stdout))
    assert [c["b"] for c in doc["comparisons"]] == [str(b)]
    # The default name is beside the last run, naming both.
    result = td("report", str(a), str(b))
    assert result.returncode == 0, result.stderr
    assert (b.parent / "b-vs-a.html").is_file()


def test_report_refuses_a_run_too_short_to_compare_in_one_line(pair, td, tmp_path):
    a, _ = pair
    short = write_recording(tmp_path / "short.sqlite", Spec(seconds=5))
    result = td("report", str(a), str(short), "-o", str(tmp_path / "x.html"))
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert "steady steps" in result.stderr
    assert not (tmp_path / "x.html").exists()


@pytest.fixture(scope="module")
def sides(tmp_path_factory):
    """Two runs a side; B's steps take 1.25x A's. Each run its own seed, so the runs of a side
    differ among themselves as runs of one command do."""
    folder = tmp_path_factory.mktemp("sides")
    a = [write_recording(folder / f"a{i}.sqlite", Spec(seed=i)) for i in (1, 2)]
    b = [write_recording(folder / f"b{i}.sqlite", Spec(step_s=0.25, seed=10 + i)) for i in (1, 2)]
    return a, b


def test_report_of_several_runs_a_side_has_one_verdict_and_draws_every_run(
    browser,  # noqa: F811
    sides,
    tmp_path,
):
    a, b = sides
    html, comparisons = write_comparison_report([*a, *b], tmp_path / "sides.html", versus=2)
    (c,) = comparisons
    assert c.verdict == "slower" and c.a_runs == [str(p) for p in a]
    assert 1.2 < c.ratio.estimate < 1.3
    open_report(browser, html)
    assert_clean(browser, html)
    verdicts = browser.evaluate(
        "[...document.querySelectorAll('#verdict .verdict')].map(v => v.textContent)"
    )
    assert len(verdicts) == 1
    assert verdicts[0].startswith("B vs A: slower: B (2 runs)'s step takes")
    assert "Welch" in verdicts[0]
    legend = browser.evaluate(
        """(() => {
        const box = document.querySelector('figure.chart-box[data-chart="steps"]');
        return [...box.querySelectorAll('path.series')].map(p =>
          p.classList.contains('dashed'));
      })()"""
    )
    labels = browser.evaluate(
        """[...document.querySelectorAll('figure.chart-box[data-chart="steps"] .legend .item')]
           .map(i => i.textContent.trim().split(':')[0])"""
    )
    # Every run drawn, A's solid and B's dashed.
    assert sorted(set(labels)) == ["A1", "A2", "B1", "B2"]
    assert legend == [label.startswith("B") for label in labels]
    memory = browser.evaluate(
        """[...[...document.querySelectorAll('#differences table')].at(-1).tBodies[0].rows]
           .map(r => r.cells[0].textContent)"""
    )
    assert memory == ["A1", "A2", "B1", "B2"]  # each run's peaks
    bars = browser.evaluate(
        """[...document.querySelectorAll('table.phase-bars tbody tr')].map(r =>
           [r.dataset.phase, [...r.querySelectorAll('.bar-row')].map(b => b.dataset.run)])"""
    )
    assert ["step", ["A", "B"]] in bars  # one bar a side


def test_report_command_with_several_runs_a_side(sides, td, tmp_path):
    a, b = sides
    out = tmp_path / "sides.html"
    result = td("report", *map(str, a), "vs", *map(str, b), "-o", str(out))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"report written to {out} (")
    assert lines[1].startswith("  B vs A: slower: B (2 runs)'s step takes")
    again = td("report", *map(str, a), "vs", *map(str, b), "-o", str(out), "--json")
    assert again.returncode == 0, again.stderr
    (c,) = assert_valid("report", json.loads(again.stdout))["comparisons"]
    assert c["a_runs"] == [str(p) for p in a] and c["b_runs"] == [str(p) for p in b]
    assert c["method"] == "runs, several a side"
    # Refusals, one line each, nothing written.
    for args in ([str(a[0]), "vs", *map(str, b)], ["vs", *map(str, a)]):
        bad = tmp_path / "bad.html"
        result = td("report", *args, "-o", str(bad))
        assert result.returncode == 2, result.stdout
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert "vs" in result.stderr
        assert not bad.exists()


def test_several_runs_a_side_needs_two_each_in_the_library_too(sides, tmp_path):
    a, b = sides
    out = tmp_path / "one-a.html"
    with pytest.raises(UserError, match="1 run.s. on side A and 2 on side B"):
        write_comparison_report([a[0], *b], out, versus=1)
    assert not out.exists()
