"""The bundled demo (examples/train.py, shortened): diagnose gives it DataLoader-worker advice
that a user can apply as printed, and applied, the job runs with the advised settings. Where
other programs took the CPUs a worker would need (measured from /proc while the demo ran), the
honest advice is that more workers have no CPU to run on, and nothing is offered to apply.

The demo runs with one torch thread (`--threads 1`). Its augmentation is thousands of tiny
convolutions per batch, and with two intra-op threads each one ends at a barrier that waits for
the other thread to be scheduled: beside two busy loops on 2 CPUs, 40 steps took over 590 s
(116 s with threads 2 against 15 s with one, at load 2). One thread leaves the demo what it is,
a job whose loop waits on its data, and its time no longer grows with the machine's load.

Whether the advice makes the demo faster is a speed verdict, and needs CPUs the job has to
itself: benchmarks/advice_works.py measures it (`--only demo`), the demo as written and with
the advice applied run interleaved side by side, so that the machine's load falls on both.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.conftest import REPO, run_td
from tests.helpers.cpu_load import MachineLoad
from torchdoctor.recording.reader import open_recording

pytestmark = pytest.mark.timeout(900)
DEMO = REPO / "examples" / "train.py"
STEPS = "24"


def record(tmp_path, name: str, *flags: str, env: dict[str, str] | None = None):
    out = tmp_path / f"{name}.sqlite"
    run = run_td(
        "run", "--quiet", "--interval", "0.25", "--out", str(out), "--",
        sys.executable, str(DEMO), "--steps", STEPS, "--threads", "1", *flags,
        timeout=400, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    return out


def evidence(finding: dict, label: str):
    return next(e["value"] for e in finding["evidence"] if e["label"] == label)


def test_the_demo_gets_worker_advice_it_can_apply_as_printed(tmp_path):
    others = MachineLoad()
    before = record(tmp_path, "as-written")
    others_cpus = others.cpus()
    diag = run_td("diagnose", "--json", str(before))
    assert diag.returncode == 0, diag.stderr
    findings = json.loads(diag.stdout)["findings"]
    f = next((x for x in findings if x["id"] == "dataloader-bound"), None)
    assert f is not None, [x["id"] for x in findings]
    settings = f["settings"]
    assert f["evidence"] and f["expected_effect"]
    available = evidence(f, "CPUs available to the job")
    if not settings:
        # No worker advised: only when other programs really took the CPUs a worker would run
        # on, and the text says so with the figure it judged by.
        usable = evidence(f, "usable CPUs")
        assert others_cpus >= 0.5 and available <= usable - 0.5, (others_cpus, f["evidence"])
        assert "More workers would have no CPU to run on" in f["recommendation"]
        assert f"{available:.1f} of the" in f["recommendation"]
        return
    # Loading in the main process waits most of each step: workers.
    assert settings.get("num_workers", 0) >= 1, f["recommendation"]
    assert f"DataLoader(num_workers={settings['num_workers']}" in f["recommendation"]
    threads = settings.get("torch.num_threads")
    if threads is not None:  # named in the text, and the same in the environment setting
        assert f"torch.set_num_threads({threads})" in f["recommendation"]
        assert settings["env.OMP_NUM_THREADS"] == str(threads)

    # Applied as printed (the demo's flags for the same settings), the job runs with them.
    flags = ["--num-workers", str(settings["num_workers"])]
    if settings.get("prefetch_factor"):
        flags += ["--prefetch-factor", str(settings["prefetch_factor"])]
    if threads is not None:
        flags += ["--threads", str(threads)]  # the later --threads wins in argparse
    env = dict(os.environ)
    if "env.OMP_NUM_THREADS" in settings:
        env["OMP_NUM_THREADS"] = settings["env.OMP_NUM_THREADS"]
    after = record(tmp_path, "advice-applied", *flags, env=env)
    with open_recording(after) as rec:
        loaders = rec.rows("dataloaders")
        rows = rec.rows("settings")
    trainer = {r["pid"] for r in rows if r["key"] == "process.role" and r["value"] == '"trainer"'}
    # the trainer's own settings (each worker runs one torch thread whatever the advice)
    recorded = {r["key"]: json.loads(r["value"]) for r in rows if r["pid"] in trainer}
    assert trainer and recorded, rows
    assert [d["num_workers"] for d in loaders] == [settings["num_workers"]], loaders
    if settings.get("prefetch_factor"):
        assert loaders[0]["prefetch_factor"] == settings["prefetch_factor"]
    if threads is not None:
        assert recorded.get("torch.num_threads") == threads, recorded
