"""Thresholds and settings are checked where they are read, before a job starts, and a bad one
is one line naming the key, the file (or variable) it came from and what is allowed."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli.conftest import PY, User


def _job_that_leaves_a_mark(mark: Path) -> list[str]:
    return [PY, "-c", f"open({str(mark)!r}, 'w').write('ran')"]


def _user_config(user: User, text: str) -> Path:
    path = Path(user.env["XDG_CONFIG_HOME"]) / "torchdoctor" / "config.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _one_line_error(done) -> str:
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.count("\n") == 1, done.stderr
    assert "Traceback" not in done.stderr
    return done.stderr


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("sustained_fraction = 0\n", ["'sustained_fraction' = 0", "above 0 and at most 1"]),
        ("sustained_fraction = 5\n", ["'sustained_fraction' = 5", "above 0 and at most 1"]),
        ("sustained_s = -5\n", ["'sustained_s' = -5", "seconds above 0"]),
        ("sustained_s = 0\n", ["'sustained_s' = 0", "seconds above 0"]),
        ("iowait_alert_pct = nan\n", ["'iowait_alert_pct'", "0 to 100"]),
        ("iowait_alert_pct = inf\n", ["'iowait_alert_pct'", "0 to 100"]),
        ("cpu_load_alert_pct = 1e400\n", ["'cpu_load_alert_pct'", "0 to 100"]),
        ("gpu_busy_alert_pct = -1\n", ["'gpu_busy_alert_pct' = -1", "0 to 100"]),
        ("leak_min_growth_bytes = -1\n", ["'leak_min_growth_bytes' = -1", "0 or more"]),
        ("swap_alert_bytes_per_s = inf\n", ["'swap_alert_bytes_per_s'", "0 or more"]),
        (
            "cpu_load_best_pct = 99\ncpu_load_alert_pct = 10\n",
            ["'cpu_load_best_pct' = 99 is above 'cpu_load_alert_pct' = 10"],
        ),
        ("thresholds = 5\n", ["thresholds must be a table"]),
    ],
)
def test_nonsense_thresholds_file_is_refused_before_the_job(user, text, words):
    limits = user.home / "limits.toml"
    limits.write_text(text)
    mark = user.home / "ran"
    done = user.td("run", "--thresholds", str(limits), "--", *_job_that_leaves_a_mark(mark))
    error = _one_line_error(done)
    assert str(limits) in error
    for word in words:
        assert word in error
    assert not mark.exists()


def test_an_alert_below_the_default_best_names_both_sources(user):
    # only the alert is set: the best it undercuts is the built-in 70 %
    limits = user.home / "limits.toml"
    limits.write_text("cpu_load_alert_pct = 50\n")
    error = _one_line_error(user.td("diagnose", "--thresholds", str(limits), "last"))
    assert "'cpu_load_best_pct' = 70 is above 'cpu_load_alert_pct' = 50" in error
    assert "the defaults" in error


@pytest.mark.parametrize(
    "layer",
    ["config.toml", "pyproject.toml", "TORCHDOCTOR_THRESHOLDS"],
)
def test_every_threshold_layer_is_checked_before_run_starts_the_job(user, layer):
    """An unknown key in config.toml or pyproject.toml used to fail only after the whole job
    ran (its diagnosis lost); --thresholds was already checked first."""
    env = dict(user.env)
    if layer == "config.toml":
        source = _user_config(user, "[thresholds]\nfoo = 1\n")
    elif layer == "pyproject.toml":
        source = user.home / "pyproject.toml"
        source.write_text("[tool.torchdoctor.thresholds]\nfoo = 1\n")
    else:
        source = user.home / "env-limits.toml"
        source.write_text("foo = 1\n")
        env["TORCHDOCTOR_THRESHOLDS"] = str(source)
    mark = user.home / "ran"
    done = user.td("run", "--", *_job_that_leaves_a_mark(mark), env=env)
    error = _one_line_error(done)
    assert "unknown threshold 'foo'" in error
    assert str(source) in error
    assert not mark.exists()
    assert not list(user.runs.glob("*.sqlite")) if user.runs.exists() else True
