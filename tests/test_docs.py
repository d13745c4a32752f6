"""The manual's generated reference names every command and option the program has, and the
README's headline benchmark figures are figures run_all saved."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest

from tests.helpers.dependencies import require
from torchdoctor.cli import cli

REPO = Path(__file__).resolve().parent.parent


def _commands(group: click.Group, ctx: click.Context, path: tuple[str, ...] = ()):
    """(path, command) for every command under ``group``, through the lazy loading."""
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        assert command is not None, name
        yield (*path, name), command
        if isinstance(command, click.Group):
            yield from _commands(command, ctx, (*path, name))


@pytest.fixture(scope="module")
def text_reference(tmp_path_factory) -> Path:
    """The manual built with Sphinx's text builder, strictly, as `make docs` builds it."""
    require("sphinx")
    require("sphinx_click")
    out = tmp_path_factory.mktemp("docs-text")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [sys.executable, "-m", "sphinx", "-q", "-W", "-n", "-b", "text", "docs", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_every_command_and_option_is_in_the_cli_reference(text_reference):
    ctx = click.Context(cli)
    checked = 0
    for path, command in _commands(cli, ctx):
        page = (text_reference / "reference" / "cli" / f"{path[0]}.txt").read_text()
        assert f"torchdoctor {' '.join(path)}" in page, path
        for param in command.params:
            if isinstance(param, click.Option) and not param.hidden:
                for opt in param.opts + param.secondary_opts:
                    assert opt in page, f"{opt} of torchdoctor {' '.join(path)} is not documented"
                    checked += 1
    # the program has dozens of options; a reference that lost them all must not pass
    assert checked > 100


def test_every_command_page_has_a_captured_example_or_says_it_has_none(text_reference):
    for name in cli.list_commands(click.Context(cli)):
        page = (text_reference / "reference" / "cli" / f"{name}.txt").read_text()
        example = REPO / "docs" / "examples" / f"{name}.txt"
        if example.exists():
            first = example.read_text().splitlines()[0]
            assert first.startswith("$ torchdoctor ") and first in page, name
        else:
            assert "No captured output yet" in page, name


def test_the_readme_headline_figures_are_saved_benchmark_figures():
    saved = [
        json.loads(line)
        for line in (REPO / "benchmarks" / "results" / "latest.jsonl").read_text().splitlines()
        if line.strip()
    ]
    readme = (REPO / "README.md").read_text().splitlines()
    start = readme.index("| what (benchmark) | value | target |")
    rows = []
    for line in readme[start + 2 :]:
        if not line.startswith("|"):
            break
        what, value, target = (cell.strip() for cell in line.strip("|").split(" | "))
        benchmark = what.rsplit("(", 1)[1].rstrip(")")
        rows.append((benchmark, value, target))
    assert rows
    for benchmark, value, target in rows:
        assert any(
            f["benchmark"] == benchmark
            and f["value"].startswith(value)
            and (f["target"] or "-") == target
            for f in saved
        ), f"README's {benchmark} {value} ({target}) is not a saved figure"


def test_the_readme_is_a_front_page():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 250
    long = [i + 1 for i, line in enumerate(lines) if len(line) > 100]
    assert not long, f"README lines over 100 characters: {long}"
    for image in ("docs/images/top.png", "docs/images/report.png"):
        assert f"]({image})" in "\n".join(lines)
        assert (REPO / image).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", image
