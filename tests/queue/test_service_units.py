"""`torchdoctor queue install`: the systemd units pass systemd's own offline check."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")


def test_installed_units_pass_systemd_analyze_verify(tmp_path):
    if SYSTEMD_ANALYZE is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true: systemd-analyze is missing (`make system` installs systemd)")
        pytest.skip("needs systemd-analyze (Debian package systemd; `make system`)")
    done = subprocess.run(
        [sys.executable, "-m", "torchdoctor", "queue", "install", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
    )
    units = sorted(tmp_path.glob("*.service"))
    assert [u.name for u in units] == ["torchdoctor-exporter.service", "torchdoctor-queue.service"]
    assert done.stdout.count("wrote ") == 2
    queue = (tmp_path / "torchdoctor-queue.service").read_text()
    assert "StateDirectory=torchdoctor" in queue and "queue serve --system" in queue
    assert "NoNewPrivileges" not in queue  # it must become each job's submitter
    exporter = (tmp_path / "torchdoctor-exporter.service").read_text()
    assert "NoNewPrivileges=yes" in exporter and "ProtectSystem=strict" in exporter
    verified = subprocess.run(
        [SYSTEMD_ANALYZE, "verify", *map(str, units)], capture_output=True, text=True
    )
    assert verified.returncode == 0, verified.stderr
    assert "torchdoctor" not in verified.stderr, verified.stderr  # no warning about our units
