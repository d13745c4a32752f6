"""The engine (ordering, isolation of a failing rule), thresholds from TOML and pyproject,
and `torchdoctor diagnose` as a user runs it (text, --json, bad input)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_td
from tests.diagnosis.builders import GiB, Gpu, Job, Proc, const, loader, make_steps
from tests.helpers.schemas import assert_valid
from torchdoctor.diagnosis import engine
from torchdoctor.diagnosis.rules import RULE_MODULES
from torchdoctor.recording.reader import open_recording


def troubled_job() -> Job:
    """Data-bound (critical), I/O wait (warning), CPU training next to a free GPU (warning)."""
    return Job(
        cpus=4,
        procs=[Proc(1000, cpu=const(60.0), read=const(80 * 2**20))],
        gpus=[Gpu(util=const(0.0), used=const(0.3 * GiB), job_pid=None)],
        host=lambda t: {"iowait": 12.0},
        steps=make_steps(n=300, wall=0.12, wait=0.08),
        dataloaders=[loader(num_workers=0)],
        settings={1000: {"torch.num_threads": 4, "params.devices": ["cpu"]}},
    )


def test_findings_are_sorted_by_severity(run_rules):
    findings = run_rules(troubled_job())
    severities = [f.severity for f in findings]
    assert severities[0] == "critical"
    assert severities == sorted(severities, key=["critical", "warning", "info"].index)
    assert {"dataloader-bound", "io-wait", "gpu-idle-cpu-training"} <= {f.id for f in findings}


def test_every_rule_module_has_an_id_and_a_check():
    ids = [m.ID for m in engine.rules()]
    assert len(ids) == len(RULE_MODULES) == len(set(ids))
    # These read the others' findings (or what they could not judge), so they run last.
    assert set(ids[-2:]) == {"gpu-underused", "short-recording"}


def test_a_failing_rule_does_not_hide_the_others(tmp_path, monkeypatch, capsys):
    path = troubled_job().write(tmp_path / "job.sqlite")
    from torchdoctor.diagnosis.rules import io_wait

    def broken(ctx):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(io_wait, "check", broken)
    with open_recording(path) as rec:
        findings = engine.diagnose(rec)
    assert "dataloader-bound" in {f.id for f in findings}
    assert "io-wait" not in {f.id for f in findings}
    assert "rule io-wait failed" in capsys.readouterr().err


def test_diagnose_json_is_the_documented_form(tmp_path):
    path = troubled_job().write(tmp_path / "job.sqlite")
    result = run_td("diagnose", "--json", str(path))
    assert result.returncode == 0
    data = json.loads(result.stdout)
    assert list(data) == ["schema_version", "findings", "recordings"]
    assert_valid("diagnose", data)
    [entry] = data["recordings"]
    assert entry["path"] == str(path) and entry["steps"]["step_count"] > 0
    first = data["findings"][0]
    for key in (
        "id",
        "severity",
        "title",
        "evidence",
        "recommendation",
        "expected_effect",
        "confidence",
        "settings",
    ):
        assert key in first
    assert first["id"] == "dataloader-bound"
    assert first["settings"]["num_workers"] >= 1
    ev = first["evidence"][0]
    assert set(ev) == {"label", "value", "unit", "t_start", "t_end"}


def test_diagnose_text_names_finding_and_fix(tmp_path):
    path = troubled_job().write(tmp_path / "job.sqlite")
    result = run_td("diagnose", str(path), env=_wide_env())
    assert result.returncode == 0  # findings are a report, not a failure
    assert "CRITICAL dataloader-bound" in result.stdout
    assert "Fix: DataLoader(num_workers=" in result.stdout
    assert "Settings: num_workers=" in result.stdout


def test_healthy_recording_prints_a_clean_bill(tmp_path):
    job = Job(procs=[Proc(1000, cpu=const(100.0))], steps=make_steps(n=200))
    result = run_td("diagnose", str(job.write(tmp_path / "ok.sqlite")))
    assert result.returncode == 0
    assert "no problems found" in result.stdout
    assert (
        json.loads(run_td("diagnose", "--json", str(tmp_path / "ok.sqlite")).stdout)["findings"]
        == []
    )


def test_thresholds_file_overrides_the_table(tmp_path):
    path = troubled_job().write(tmp_path / "job.sqlite")
    toml = tmp_path / "limits.toml"
    toml.write_text("[thresholds]\niowait_alert_pct = 15.0\n")
    ids = _ids(run_td("diagnose", "--json", "--thresholds", str(toml), str(path)))
    assert "io-wait" not in ids  # 12 % < 15 %
    assert "io-wait" in _ids(run_td("diagnose", "--json", str(path), cwd=tmp_path))


def test_pyproject_thresholds_apply(tmp_path):
    path = troubled_job().write(tmp_path / "job.sqlite")
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "pyproject.toml").write_text(
        "[tool.torchdoctor.thresholds]\ndata_wait_alert_pct = 80\n"
    )
    ids = _ids(run_td("diagnose", "--json", str(path), cwd=project / "src"))
    assert "dataloader-bound" not in ids  # 67 % < 80 %
    assert "io-wait" in ids


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda p: None, "no such file"),
        (lambda p: p.write_text("step,loss\n1,0.5\n"), "not a torchdoctor recording"),
    ],
)
def test_bad_input_is_one_line_and_non_zero(tmp_path, setup, message):
    target = tmp_path / "run.sqlite"
    setup(target)
    result = run_td("diagnose", str(target))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1
    assert message in result.stderr


def test_bad_thresholds_file(tmp_path):
    path = troubled_job().write(tmp_path / "job.sqlite")
    toml = tmp_path / "limits.toml"
    toml.write_text("iowait_alert = 3\n")
    result = run_td("diagnose", "--thresholds", str(toml), str(path))
    assert result.returncode == 2
    assert "unknown threshold 'iowait_alert'" in result.stderr


def _ids(result) -> set[str]:
    assert result.returncode == 0, result.stderr
    return {f["id"] for f in json.loads(result.stdout)["findings"]}


def _wide_env() -> dict[str, str]:
    import os

    return {**os.environ, "COLUMNS": "120"}
