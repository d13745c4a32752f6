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


# -- a bad value is named as whoever set it: the flag, a variable or a file ------------------


@pytest.mark.parametrize(
    ("setting", "words"),
    [
        ("env", "$TORCHDOCTOR_INTERVAL 0.001 is out of range"),
        ("config", "config.toml: interval -1 is out of range"),
        ("flag", "--interval 0.002 is out of range"),
    ],
)
def test_an_interval_out_of_range_names_who_set_it(user, setting, words):
    env = dict(user.env)
    options = []
    if setting == "env":
        env["TORCHDOCTOR_INTERVAL"] = "0.001"
    elif setting == "config":
        _user_config(user, "interval = -1\n")
    else:
        options = ["--interval", "2ms"]
    mark = user.home / "ran"
    done = user.td("run", *options, "--", *_job_that_leaves_a_mark(mark), env=env)
    error = _one_line_error(done)
    assert words in error
    assert "0.05-60 seconds" in error
    assert not mark.exists()


def test_an_unreadable_interval_is_offered_values_inside_its_range(user):
    error = _one_line_error(user.td("run", "--interval", "2x", "--", "true"))
    assert "cannot read --interval '2x'" in error
    assert "250ms" in error
    assert "5m" not in error and "1h30m" not in error  # both outside 0.05-60 s


def test_an_interval_in_milliseconds_is_read(user):
    mark = user.home / "ran"
    done = user.td("run", "--quiet", "--interval", "250ms", "--", *_job_that_leaves_a_mark(mark))
    assert done.returncode == 0, done.stderr
    assert mark.exists()


def test_a_bad_exporter_address_in_the_environment_names_the_variable(user):
    env = {**user.env, "TORCHDOCTOR_EXPORTER_LISTEN": "bad"}
    error = _one_line_error(user.td("exporter", env=env, timeout=30))
    assert "$TORCHDOCTOR_EXPORTER_LISTEN 'bad'" in error


def test_an_unusable_runs_dir_from_the_config_names_it(user):
    (user.home / "afile").write_text("")
    config = _user_config(user, f'runs_dir = "{user.home / "afile" / "runs"}"\n')
    env = {k: v for k, v in user.env.items() if k != "TORCHDOCTOR_RUNS_DIR"}
    mark = user.home / "ran"
    error = _one_line_error(user.td("run", "--", *_job_that_leaves_a_mark(mark), env=env))
    assert f"choose another place with --out or change runs_dir in {config}" in error
    assert not mark.exists()


def test_export_into_an_unusable_folder_names_out_dir(user):
    user.record("pass")
    (user.home / "afile").write_text("")
    target = user.home / "afile" / "csv"
    error = _one_line_error(user.td("export", "last", "--format", "csv", "--out-dir", str(target)))
    assert error.rstrip().endswith("choose another place with --out-dir")


def test_tune_refuses_an_unusable_out_dir_before_its_first_trial(user):
    (user.home / "afile").write_text("")
    mark = user.home / "ran"
    done = user.td(
        "tune",
        "--out-dir",
        str(user.home / "afile" / "trials"),
        "--",
        *_job_that_leaves_a_mark(mark),
    )
    error = _one_line_error(done)
    assert "choose another place with --out-dir" in error
    assert "trial" not in done.stdout + done.stderr.replace("afile/trials", "")
    assert not mark.exists()


def test_bench_scaling_refuses_a_folder_of_an_earlier_bench_before_any_trial(user):
    folder = user.home / "bench"
    folder.mkdir()
    (folder / "scaling-1.sqlite").write_text("")  # an earlier bench's recording
    mark = user.home / "ran"
    script = user.home / "train.py"
    script.write_text(f"open({str(mark)!r}, 'w').write('ran')\n")
    done = user.td("bench", "scaling", "--nproc", "1", "--out-dir", str(folder), "--", str(script))
    error = _one_line_error(done)
    assert "already holds scaling-1.sqlite" in error
    assert "choose a new folder with --out-dir" in error
    assert not mark.exists()
