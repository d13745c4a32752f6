"""Recordings at hand: one folder for every command (flag > env > pyproject > user config),
`torchdoctor ls` newest first from stored lines, and `last` wherever a recording is named."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from torchdoctor.errors import UserError
from torchdoctor.recording.listing import INDEX_NAME, read_index


def _three_recordings(user) -> list[Path]:
    """Three real runs, oldest first: a clean exit, a failing one, a slow one."""
    user.record("print('first')")
    user.record("import sys; sys.exit(3)")
    user.record("import time; time.sleep(0.6)")
    found = sorted(user.runs.glob("*.sqlite"))
    assert len(found) == 3
    return sorted(found, key=lambda p: json.loads(_meta(p, "started_at") or "0"))


def _meta(path: Path, key: str) -> str | None:
    import sqlite3

    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        row = db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
    finally:
        db.close()
    return row[0] if row else None


def test_ls_lists_newest_first_with_status_and_last_names_the_newest(user):
    oldest, failed, newest = _three_recordings(user)
    listing = user.json("ls", "--json")
    assert listing["schema_version"] == 1
    names = [r["name"] for r in listing["recordings"]]
    assert names == [newest.name, failed.name, oldest.name]
    statuses = {r["name"]: r["status"] for r in listing["recordings"]}
    assert statuses[failed.name] == "exit 3" and statuses[oldest.name] == "exit 0"
    slow = listing["recordings"][0]
    assert slow["duration_s"] >= 0.6 and "time.sleep(0.6)" in slow["command"][-1]
    table = user.td("ls")
    assert table.returncode == 0
    rows = [line for line in table.stdout.splitlines()[1:] if line.strip()]
    assert "time.sleep" in rows[0] and "exit 3" in rows[1]  # newest first, as printed
    for word in ("last", "@last"):
        shown = user.json("show", word, "--json")
        assert Path(shown["path"]).name == newest.name
    diagnosed = user.json("diagnose", "last", "--json")
    assert [Path(r["path"]).name for r in diagnosed["recordings"]] == [newest.name]


def test_ls_reads_stored_lines_and_works_out_only_what_changed(user):
    oldest, _, newest = _three_recordings(user)
    user.json("ls", "--json")
    index_path = user.runs / INDEX_NAME
    stored = read_index(user.runs)
    assert set(stored) == {p.name for p in user.runs.glob("*.sqlite")}
    # Mark one stored line: if ls re-read that recording, the mark would be gone.
    data = json.loads(index_path.read_text())
    data["recordings"][oldest.name]["status"] = "from the index"
    index_path.write_text(json.dumps(data))
    again = {r["name"]: r for r in user.json("ls", "--json")["recordings"]}
    assert again[oldest.name]["status"] == "from the index"
    # A recording that changed since (its size or time) is worked out again.
    os.utime(newest, ns=(newest.stat().st_atime_ns, newest.stat().st_mtime_ns + 10**9))
    data = json.loads(index_path.read_text())
    data["recordings"][newest.name]["status"] = "stale"
    index_path.write_text(json.dumps(data))
    assert {r["name"]: r for r in user.json("ls", "--json")["recordings"]}[newest.name][
        "status"
    ] == "exit 0"


def test_run_stores_its_line_when_it_ends(user):
    user.td("run", "--interval", "0.1", "--", "python3", "-c", "pass")
    (recording,) = user.runs.glob("*.sqlite")
    stored = read_index(user.runs)
    assert stored[recording.name].status == "exit 0"


def test_last_on_an_empty_folder_says_what_to_do(user):
    done = user.td("diagnose", "last")
    assert done.returncode == 2
    assert "no recording in" in done.stderr and "torchdoctor run -- CMD" in done.stderr


def test_run_says_where_it_records_when_it_starts(user):
    done = user.td("run", "--interval", "0.1", "--", "python3", "-c", "print('job output')")
    assert done.returncode == 0
    first = done.stderr.splitlines()[0]
    (recording,) = user.runs.glob("*.sqlite")
    assert first.startswith("torchdoctor: recording") and str(recording) in first
    assert done.stdout == "job output\n"


def test_the_recordings_folder_follows_flag_env_pyproject_then_user_config(user, tmp_path):
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    env = {k: v for k, v in user.env.items() if k != "TORCHDOCTOR_RUNS_DIR"}
    config = Path(env["XDG_CONFIG_HOME"]) / "torchdoctor" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text(f'runs_dir = "{tmp_path / "from-user-config"}"\ninterval = "0.2s"\n')

    def where(*extra: str, env=env, cwd=project / "src") -> Path:
        user.td("run", "--quiet", *extra, "--", "python3", "-c", "pass", env=env, cwd=cwd)
        (found,) = [p for p in tmp_path.rglob("*.sqlite") if p.stat().st_size]
        folder = found.parent
        found.unlink()
        return folder

    assert where() == tmp_path / "from-user-config"
    # pyproject.toml of the project (found from a sub-folder), relative to its folder
    (project / "pyproject.toml").write_text('[tool.torchdoctor]\nruns_dir = "recs"\n')
    assert where() == project / "recs"
    assert where(env={**env, "TORCHDOCTOR_RUNS_DIR": str(tmp_path / "env")}) == tmp_path / "env"
    out = tmp_path / "flag" / "x.sqlite"
    user.td("run", "--quiet", "--out", str(out), "--", "python3", "-c", "pass", env=env)
    assert out.stat().st_size > 0
    # interval comes from the user config: 0.2 s between samples
    (project / "pyproject.toml").unlink()
    user.td("run", "--quiet", "--", "python3", "-c", "pass", env=env, cwd=project)
    (rec,) = (tmp_path / "from-user-config").glob("*.sqlite")
    assert json.loads(_meta(rec, "interval_s")) == 0.2


def test_a_mistyped_setting_is_one_clear_line(user, tmp_path):
    (tmp_path / "pyproject.toml").write_text('[tool.torchdoctor]\nrun_dir = "x"\n')
    done = user.td("run", "--", "python3", "-c", "pass", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"torchdoctor: error: {tmp_path / 'pyproject.toml'} [tool.torchdoctor]: unknown setting "
        "'run_dir'; known ones: runs_dir, interval, exporter_listen, auto_profile, thresholds"
    ]


def test_thresholds_merge_from_user_config_and_pyproject(user, tmp_path):
    from torchdoctor import config
    from torchdoctor.thresholds import load_thresholds

    (tmp_path / "pyproject.toml").write_text(
        "[tool.torchdoctor.thresholds]\ncpu_load_alert_pct = 95\n"
    )
    user_file = config.user_config_path()
    user_file.parent.mkdir(parents=True, exist_ok=True)
    user_file.write_text("[thresholds]\ncpu_load_alert_pct = 70\niowait_alert_pct = 9\n")
    flag = tmp_path / "t.toml"
    flag.write_text("iowait_alert_pct = 12\n")
    merged = load_thresholds(search_from=tmp_path)
    assert (merged.cpu_load_alert_pct, merged.iowait_alert_pct) == (95, 9)
    with_flag = load_thresholds(flag, search_from=tmp_path)
    assert (with_flag.cpu_load_alert_pct, with_flag.iowait_alert_pct) == (95, 12)


def test_sbatch_from_last_sizes_from_the_newest_and_reads_the_time(user):
    user.record("import time; time.sleep(0.3)")
    done = user.td("sbatch", "--from", "@last", "--time", "1h30m", "--", "python", "train.py")
    assert done.returncode == 0, done.stderr
    assert "#SBATCH --time=01:30:00" in done.stdout


def test_exporter_address_and_interval_follow_the_same_precedence(tmp_path, monkeypatch):
    from torchdoctor import config

    def settings() -> tuple:
        # each value with who set it, as a message about a bad one names it
        return config.exporter_listen(None), config.interval(1.0, "0.5")

    monkeypatch.chdir(tmp_path)
    user_file = config.user_config_path()
    user_file.parent.mkdir(parents=True, exist_ok=True)
    user_file.write_text('exporter_listen = "9001"\ninterval = 3\n')
    assert settings() == (
        ("9001", f"{user_file}: exporter_listen"),
        (3.0, f"{user_file}: interval"),
    )
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(
        '[tool.torchdoctor]\nexporter_listen = "127.0.0.1:9002"\ninterval = "5x"\n'
    )
    # a value that is not a duration is one clear error naming the setting and its file
    with pytest.raises(
        UserError, match=r"cannot read .*pyproject.toml \[tool.torchdoctor\]: interval '5x'"
    ):
        config.interval(1.0, "0.5")
    pyproject.write_text(
        '[tool.torchdoctor]\nexporter_listen = "127.0.0.1:9002"\ninterval = "500ms"\n'
    )
    assert [value for value, _ in settings()] == ["127.0.0.1:9002", 0.5]
    monkeypatch.setenv("TORCHDOCTOR_EXPORTER_LISTEN", "9003")
    monkeypatch.setenv("TORCHDOCTOR_INTERVAL", "2s")
    assert settings() == (
        ("9003", "$TORCHDOCTOR_EXPORTER_LISTEN"),
        (2.0, "$TORCHDOCTOR_INTERVAL"),
    )
    assert config.exporter_listen("9004") == ("9004", "--listen")
