"""`show --json` reports what the instrumentation saw inside an unmodified training script."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import run_td
from torchdoctor import open_recording
from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.thresholds import Thresholds

SCRIPT = textwrap.dedent(
    """
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(96, 4), torch.randn(96, 1))
    loader = DataLoader(data, batch_size=8, num_workers=0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in loader:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    print("trained")
    """
)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    """One real `torchdoctor run` of SCRIPT, shared by the tests of this module."""
    tmp_path = tmp_path_factory.mktemp("show-steps")
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    rec = tmp_path / "r.sqlite"
    res = run_td(
        "run", "--quiet", "--out", str(rec), "--", sys.executable, str(script), timeout=180
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout == "trained\n"
    return rec


def test_show_json_reports_steps_settings_and_loader(recorded: Path) -> None:
    rec = recorded
    shown = run_td("show", "--json", str(rec))
    assert shown.returncode == 0, shown.stderr
    steps = json.loads(shown.stdout)["steps"]
    assert steps["step_count"] == 12  # 96 samples / batch 8
    assert steps["batch_size"] == 8
    assert 0.0 <= steps["data_wait_fraction"] < 1.0
    assert steps["median_step_s"] > 0 and steps["p90_step_s"] >= steps["median_step_s"]
    [loader] = steps["dataloaders"]
    assert loader["num_workers"] == 0 and loader["batch_size"] == 8
    text = run_td("show", str(rec)).stdout
    assert "steps: 12, median" in text


def test_show_and_diagnose_agree_on_the_step_figures(recorded: Path) -> None:
    shown = run_td("show", "--json", str(recorded))
    diagnosed = run_td("diagnose", "--json", str(recorded))
    assert shown.returncode == 0 and diagnosed.returncode == 0, diagnosed.stderr
    steps = json.loads(shown.stdout)["steps"]
    [entry] = json.loads(diagnosed.stdout)["recordings"]
    assert entry["steps"] == steps
    assert steps["steps_per_s"] > 0 and steps["samples_per_s"] == pytest.approx(
        8 * steps["steps_per_s"]
    )
    # ... and the rules read that same summary.
    with open_recording(recorded) as rec:
        summary = DiagnosisContext(rec, Thresholds()).step_summary
    assert summary is not None and summary.to_dict() == steps
