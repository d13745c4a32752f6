"""Streaming jobs (an IterableDataset) recorded by ``torchdoctor run``: every step, on both of
the agent's paths; and a process whose instrumentation switched itself off is named, with the
reason, by ``show`` and ``diagnose``, not only by the HTML report."""

from __future__ import annotations

import json
import re

import pytest

from tests.conftest import run_td
from tests.instrument.runjob import JOBS, PY, child_env
from torchdoctor.instrument.agent import compiled
from torchdoctor.instrument.agent.contract import ENV_OVERRIDES, ENV_PURE_PYTHON
from torchdoctor.recording import open_recording

ITERABLE = str(JOBS / "iterable_job.py")
# Not a multiple of 8 x 2: each of two workers ends on a short batch (50 = 6 x 8 + 2).
SAMPLES = 100


def _run(tmp_path, workers: int, env: dict[str, str]):
    out = tmp_path / f"w{workers}.sqlite"
    proc = run_td(
        "run", "--quiet", "--out", str(out), "--", PY, ITERABLE, str(workers), str(SAMPLES),
        env=child_env(env),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc, out


@pytest.mark.parametrize("pure", [False, True], ids=["compiled", "pure-python"])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_streaming_job_is_recorded_step_by_step(tmp_path, workers, pure):
    if not pure and compiled.fast is None:
        pytest.skip(f"no compiled path in this install ({compiled.FAST_PATH})")
    proc, out = _run(tmp_path, workers, {ENV_PURE_PYTHON: "1"} if pure else {})
    steps, samples = map(int, re.fullmatch(r"steps (\d+) samples (\d+)\n", proc.stdout).groups())
    assert samples == SAMPLES and steps == (13 if workers == 0 else 14)
    with open_recording(out) as rec:
        assert rec.rows("events", where={"kind": "instrumentation-disabled"}) == []
        rows = sorted(rec.rows("steps"), key=lambda r: r["step"])
        assert [r["step"] for r in rows] == list(range(steps))
        assert sum(r["samples"] for r in rows) == SAMPLES
        (loader,) = rec.rows("dataloaders")
        assert loader["num_workers"] == workers and loader["dataset_len"] is None
        assert loader["sampler_type"] == "_InfiniteConstantSampler"
        paths = {
            json.loads(r["value"]) for r in rec.rows("settings", where={"key": "agent.fast_path"})
        }
        assert paths == {"compiled" if not pure else f"python ({ENV_PURE_PYTHON} is set)"}


def test_show_and_diagnose_say_why_the_instrumentation_switched_itself_off(tmp_path):
    # torch.set_num_threads(0) raises inside the agent's install: it switches itself off.
    _, out = _run(tmp_path, 0, {ENV_OVERRIDES: json.dumps({"num_threads": 0})})
    show, diagnose = run_td("show", str(out)), run_td("diagnose", str(out))
    shown = json.loads(run_td("show", str(out), "--json").stdout)
    for proc in (show, diagnose):
        assert proc.returncode == 0, proc.stderr
        text = " ".join((proc.stdout + proc.stderr).split())  # as wrapped to the terminal
        assert "instrumentation of pid" in text and "switched itself off" in text
        assert "set_num_threads expects a positive integer" in text, text
        assert text.count("switched itself off") == 1
    (line,) = shown["instrumentation_off"]
    assert "switched itself off" in line and "its steps and settings after that are missing" in line
