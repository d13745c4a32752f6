"""A missing test dependency fails the run and says what installs it (tests/helpers/dependencies):
a run without jsonschema, sphinx or torch used to pass green with those tests skipped."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

TESTS = Path(__file__).resolve().parent


def test_a_missing_dependency_fails_the_test_naming_what_installs_it(tmp_path):
    # A jsonschema that cannot be imported, ahead of the real one on the path.
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "jsonschema.py").write_text("raise ImportError('gone for this test')\n")
    (tmp_path / "test_needs_it.py").write_text(
        "from tests.helpers.dependencies import require\n\n"
        "def test_it():\n"
        "    require('jsonschema')\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_needs_it.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow), str(REPO)])},
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 failed" in done.stdout and "skipped" not in done.stdout
    assert (
        "jsonschema is not installed (gone for this test); it comes with the `test` group of "
        "[dependency-groups] (in `dev`): run `make setup`, or "
        "`.venv/bin/pip install -e '.[all]' --group dev`"
    ) in done.stdout


def test_no_test_skips_over_a_missing_package():
    guard = "importor" + "skip"  # spelled apart, so this file does not find itself
    users = [
        str(path.relative_to(REPO))
        for path in TESTS.rglob("*.py")
        if guard in path.read_text(encoding="utf-8")
    ]
    assert users == [], f"use tests.helpers.dependencies.require instead of {guard} in {users}"
