"""`show` prints the mean and p90 step time beside the median: a data-bound job whose every
fourth batch waits on storage has a median that hides its slow steps (124 ms median against
303 ms mean in one real job)."""

from __future__ import annotations

import json
import sys
import textwrap

from tests.conftest import run_td
from torchdoctor.units import fmt_duration

SCRIPT = textwrap.dedent(
    """
    import time
    import torch
    from torch.utils.data import DataLoader, Dataset

    class Storage(Dataset):
        def __len__(self):
            return 256

        def __getitem__(self, i):
            if i % 32 == 0:
                time.sleep(0.05)  # every fourth batch of 8 waits on a slow read
            return torch.ones(4), torch.ones(1)

    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in DataLoader(Storage(), batch_size=8):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    """
)


def test_show_prints_the_mean_and_p90_beside_the_median(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    rec = tmp_path / "r.sqlite"
    done = run_td("run", "--quiet", "--out", str(rec), "--", sys.executable, str(script))
    assert done.returncode == 0, done.stderr
    steps = json.loads(run_td("show", "--json", str(rec)).stdout)["steps"]
    assert steps["step_count"] == 32
    # Three quick steps for one slow one: the median is a quick step, the mean is not.
    assert steps["mean_step_s"] > 5 * steps["median_step_s"]
    assert steps["p90_step_s"] >= 0.05
    text = " ".join(run_td("show", str(rec)).stdout.split())
    assert (
        f"steps: 32, median {fmt_duration(steps['median_step_s'])},"
        f" mean {fmt_duration(steps['mean_step_s'])}, p90 {fmt_duration(steps['p90_step_s'])},"
    ) in text
