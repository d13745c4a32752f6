"""`show --json` reports what the instrumentation saw inside an unmodified training script."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

from tests.conftest import run_td

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


def test_show_json_reports_steps_settings_and_loader(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    rec = tmp_path / "r.sqlite"
    res = run_td(
        "run", "--quiet", "--out", str(rec), "--", sys.executable, str(script), timeout=180
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout == "trained\n"
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
