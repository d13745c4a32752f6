"""The bundled demo (examples/train.py, shortened): diagnose gives it DataLoader-worker advice
that a user can apply as printed.

Whether that advice makes the demo faster is a speed verdict, and needs CPUs the job has to
itself: benchmarks/advice_works.py measures it (`--only demo`), the demo as written and with
the advice applied run interleaved side by side, so that the machine's load falls on both.
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import REPO, run_td

pytestmark = pytest.mark.timeout(900)
DEMO = REPO / "examples" / "train.py"
STEPS = "40"


def record(tmp_path, name: str, *flags: str, env: dict[str, str] | None = None):
    out = tmp_path / f"{name}.sqlite"
    run = run_td(
        "run", "--quiet", "--interval", "0.25", "--out", str(out), "--",
        sys.executable, str(DEMO), "--steps", STEPS, *flags,
        timeout=600, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    return out


def test_the_demo_gets_worker_advice_it_can_apply_as_printed(tmp_path):
    before = record(tmp_path, "as-written")
    diag = run_td("diagnose", "--json", str(before))
    assert diag.returncode == 0, diag.stderr
    findings = json.loads(diag.stdout)["findings"]
    f = next(x for x in findings if x["id"] == "dataloader-bound")
    settings = f["settings"]
    # Loading in the main process waits most of each step: workers, never "no CPU to run on".
    assert settings.get("num_workers", 0) >= 1, f["recommendation"]
    assert "DataLoader(num_workers=" in f["recommendation"]
    threads = settings.get("torch.num_threads")
    if threads is not None:  # named in the text, and the same in the environment setting
        assert f"torch.set_num_threads({threads})" in f["recommendation"]
        assert settings["env.OMP_NUM_THREADS"] == str(threads)
    assert f["evidence"] and f["expected_effect"]
