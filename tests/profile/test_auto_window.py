"""The automatic profiler window (run/auto_profile.py): real CPU training loops under
`torchdoctor run`, on a machine whose fake GPU (tests/fake_nvml.py) NVML reports busy 10 % of
the time. The job holds memory on it (jobs/on_fake_gpu.py), so it is the job's GPU."""

from __future__ import annotations

import json
import os
import re
import sys
from collections import deque
from pathlib import Path

import pytest

from tests import fake_nvml
from tests.conftest import run_td
from torchdoctor import config
from torchdoctor.errors import UserError
from torchdoctor.recording import open_recording
from torchdoctor.recording.paths import profile_folder
from torchdoctor.run.auto_profile import WINDOW_STEPS, Recent, judge
from torchdoctor.thresholds import Thresholds

JOBS = Path(__file__).resolve().parent / "jobs"
ON_GPU = JOBS / "on_fake_gpu.py"
COMPUTE = JOBS / "compute_loop.py"
DATA_BOUND = Path(__file__).resolve().parents[2] / "examples" / "scenarios" / "data_bound.py"
UUID = "GPU-3b1f6c52-0d7e-4b8e-9a51-8f6a3a1c0000"
ASKED = re.compile(
    r"torchdoctor: step slow with the GPU waiting and no host-side cause: profiling steps "
    r"(\d+)-(\d+) \(opt out: --no-auto-profile\)"
)
# Seconds recorded before the window may be asked: 6 instead of 30, so that a test job runs
# 10-14 s. cpu_load_best_pct = 0: the test box's CPUs are shared with whatever else runs on it
# (a benchmark, other tests), and another program holding them must not decide these tests;
# that condition is test_judge_*'s.
THRESHOLDS = "[thresholds]\nauto_profile_min_s = 6\ncpu_load_best_pct = 0\n"


@pytest.fixture
def machine(tmp_path) -> dict[str, str]:
    """The environment of a job on a machine with one fake A100 kernels keep 10 % busy."""
    state = str(tmp_path / "gpus.json")
    fake_nvml.write_machine(
        state, [{"uuid": UUID, "memory_total": 40 * fake_nvml.GIB, "utilization_gpu": 10}]
    )
    env = {k: v for k, v in fake_nvml.machine_env(state).items() if k != config.ENV_AUTO_PROFILE}
    return {**env, "PYTHONUNBUFFERED": "1"}


def record(tmp_path: Path, env: dict[str, str], *job: str, options=()):
    """`torchdoctor run` of ``job`` (not quiet: the line the window is asked with is ours)."""
    out = tmp_path / "run.sqlite"
    thresholds = tmp_path / "thresholds.toml"
    thresholds.write_text(THRESHOLDS)
    proc = run_td(
        "run", "--interval", "0.5", "--thresholds", str(thresholds), "--out", str(out),
        *options, "--", sys.executable, *job,
        env=env, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc, out


def diagnosis(out: Path, tmp_path: Path) -> dict[str, dict]:
    proc = run_td("diagnose", str(out), "--json", "--thresholds", str(tmp_path / "thresholds.toml"))
    assert proc.returncode == 0, proc.stderr
    return {f["id"]: f for f in json.loads(proc.stdout)["findings"]}


def item_line() -> int:
    lines = COMPUTE.read_text().splitlines()
    return next(n for n, text in enumerate(lines, start=1) if "ITEM-LINE" in text)


def test_a_slow_step_with_the_gpu_waiting_is_profiled_once(tmp_path, machine):
    # 10 s, then until the window's trace is written and 4 s more: time to ask again, were
    # the trigger to ask twice.
    job = (str(ON_GPU), UUID, str(COMPUTE), "10", "--after-window", "4")
    proc, out = record(tmp_path, machine, *job)
    asked = ASKED.findall(proc.stderr)
    assert len(asked) == 1, proc.stderr
    first, last = map(int, asked[0])
    assert last - first + 1 == WINDOW_STEPS
    with open_recording(out) as rec:
        (window,) = rec.profile_windows()
        profiled = [r["step"] for r in rec.steps() if r["profiled"]]
        stats = rec.step_stats()
        auto = rec.meta["auto_profile"]
    assert (window.state, window.first_step, window.last_step) == ("done", first, last)
    assert Path(window.trace_path).parent == profile_folder(out)
    # The warm-up, the 5 steps and the step the export stalls leave every step figure.
    assert profiled == list(range(first - 1, last + 2))
    warmup = max(1, min(5, stats.step_count // 10))  # stats.warmup_rule
    assert stats.measured_steps == stats.step_count - warmup - (WINDOW_STEPS + 2)
    assert auto["state"] == "asked" and (auto["first_step"], auto["last_step"]) == (first, last)
    assert auto["gpu"] == 0 and auto["gpu_busy_pct"] == 10.0
    assert auto["data_wait_pct"] < 10 and auto["steps"] >= 20 and auto["recorded_s"] >= 6

    # diagnose reads the window as one asked by hand: the sync names the line, and
    # gpu-underused points to it instead of saying how to profile.
    found = diagnosis(out, tmp_path)
    sites = found["sync-points"]["settings"]["sync_sites"]
    assert sites == [f"{COMPUTE}:{item_line()}"]
    advice = found["gpu-underused"]["recommendation"]
    assert f"profiled window (steps {first}-{last}) says where: sync-points" in advice
    assert "torch.profiler" not in advice


def test_no_auto_profile_takes_no_window(tmp_path, machine):
    proc, out = record(
        tmp_path, machine, str(ON_GPU), UUID, str(COMPUTE), "10", options=("--no-auto-profile",)
    )
    assert not ASKED.search(proc.stderr)
    with open_recording(out) as rec:
        assert rec.profile_windows() == []
        assert not any(r["profiled"] for r in rec.steps())
        assert rec.meta["auto_profile"] == {
            "state": "off",
            "reason": f"switched off (--no-auto-profile or ${config.ENV_AUTO_PROFILE}=0)",
        }
    assert not profile_folder(out).exists()
    advice = diagnosis(out, tmp_path)["gpu-underused"]["recommendation"]
    assert "torch.profiler: `torchdoctor run --profile-steps 20-24 -- CMD`" in advice
    assert "the automatic window was off" in advice


def test_a_data_bound_loop_takes_no_window(tmp_path, machine):
    # The examples' data-bound job: its steps wait on the DataLoader, which the host rules name.
    proc, out = record(tmp_path, machine, str(ON_GPU), UUID, str(DATA_BOUND), "--seconds", "10")
    assert not ASKED.search(proc.stderr)
    with open_recording(out) as rec:
        assert rec.profile_windows() == []
        assert rec.meta["auto_profile"] == {"state": "watching"}
    found = diagnosis(out, tmp_path)
    assert "cause: dataloader-bound" in found["gpu-underused"]["recommendation"]


def test_a_cpu_only_job_takes_no_window(tmp_path, machine):
    # The same compute loop, holding nothing on the (idle) GPU: no device of its waits.
    proc, out = record(tmp_path, machine, str(COMPUTE), "10")
    assert not ASKED.search(proc.stderr)
    with open_recording(out) as rec:
        assert rec.profile_windows() == []
        assert rec.meta["auto_profile"] == {"state": "watching"}
        assert rec.step_stats().step_count >= 20
    assert not profile_folder(out).exists()


# -- the conditions, on readings no test box can produce on demand ----------------------------


def recent(*, busy: float = 100.0, swap: float = 0.0, job_cores: float = 2.0, wait: float = 0.0):
    """20 s of readings every 0.5 s: the job's GPU 0 busy 10 %, 40 steps of 0.5 s."""
    r = Recent.over(10.0)
    ts = [i * 0.5 for i in range(40)]
    r.add_host([(t, busy, swap, 0.0) for t in ts])
    r.add_processes([(t, job_cores * 100) for t in ts])
    r.add_gpus([(t, 0, 10.0) for t in ts])
    r.add_gpu_processes([(0, True, 2**30)])
    r.add_steps([(7, s, ts[s], 0.5, wait, None, None) for s in range(40)])
    r.prune()
    return r


def test_judge_asks_when_every_condition_holds():
    seen = judge(recent(), Thresholds(), usable_cpus=2.0, recorded_s=40.0)
    assert seen is not None and (seen.gpu, seen.gpu_busy_pct, seen.data_wait_pct) == (0, 10.0, 0.0)
    assert seen.steps == 38  # past the first two
    assert isinstance(recent().steps, deque) and len(recent().steps) == 21  # the last 10 s


def test_judge_waits_for_the_start_up_to_pass():
    assert judge(recent(), Thresholds(), usable_cpus=2.0, recorded_s=29.0) is None
    assert judge(recent(), Thresholds(auto_profile_min_steps=39), 2.0, 40.0) is None


def test_judge_leaves_host_causes_to_the_host_rules():
    th = Thresholds()
    assert judge(recent(wait=0.1), th, 2.0, 40.0) is None  # 20 % data wait: dataloader-bound
    assert judge(recent(swap=2e6), th, 2.0, 40.0) is None  # swapping 2 MB/s: swap-thrash
    # The machine 100 % busy while the job uses a quarter of its CPUs: cpu-contention.
    assert judge(recent(job_cores=0.5), th, 2.0, 40.0) is None
    # ... but the job itself filling them is no contention.
    assert judge(recent(job_cores=1.9), th, 2.0, 40.0) is not None


def test_judge_needs_a_gpu_of_the_job_that_waits():
    cpu_only = recent()
    cpu_only.job_gpus.clear()  # nothing of the job's on the GPU, steps without CUDA
    assert judge(cpu_only, Thresholds(), 2.0, 40.0) is None
    busy = recent()
    busy.gpu[0] = deque((t, 95.0) for t, _ in busy.gpu[0])
    assert judge(busy, Thresholds(), 2.0, 40.0) is None


# -- the setting ------------------------------------------------------------------------------


def test_the_setting_from_the_variable_and_the_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert config.auto_profile({}) == (True, None)
    assert config.auto_profile({config.ENV_AUTO_PROFILE: "0"}) == (
        False,
        "$TORCHDOCTOR_AUTO_PROFILE",
    )
    with pytest.raises(UserError, match="use 0 \\(off\\) or 1 \\(on\\)"):
        config.auto_profile({config.ENV_AUTO_PROFILE: "maybe"})
    (tmp_path / "pyproject.toml").write_text("[tool.torchdoctor]\nauto_profile = false\n")
    on, where = config.auto_profile({})
    assert not on and where.endswith("pyproject.toml [tool.torchdoctor]: auto_profile")
    (tmp_path / "pyproject.toml").write_text('[tool.torchdoctor]\nauto_profile = "no"\n')
    with pytest.raises(UserError, match="auto_profile must be true or false"):
        config.auto_profile({})


def test_a_bad_setting_is_refused_before_the_job_starts(tmp_path):
    out = tmp_path / "run.sqlite"
    env = {**os.environ, config.ENV_AUTO_PROFILE: "sometimes"}
    proc = run_td("run", "--out", str(out), "--", sys.executable, "-c", "pass", env=env)
    assert proc.returncode == 2
    assert "$TORCHDOCTOR_AUTO_PROFILE = 'sometimes'" in proc.stderr
    assert not out.exists()


def test_launch_passes_no_auto_profile_to_the_recorder(tmp_path):
    # No fake GPU here: on a machine with GPUs launch binds ranks to their NUMA nodes, which a
    # CPU build of torch refuses. The opt-out is what the recording says, GPU or not.
    out = tmp_path / "runs"
    env = {k: v for k, v in os.environ.items() if k != config.ENV_AUTO_PROFILE}
    proc = run_td(
        "launch", "--nproc-per-node", "1", "--out-dir", str(out), "--no-auto-profile",
        "--", str(COMPUTE), "1",
        env=env, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (recording,) = out.glob("*.sqlite")
    with open_recording(recording) as rec:
        assert rec.meta["auto_profile"] == {
            "state": "off",
            "reason": f"switched off (--no-auto-profile or ${config.ENV_AUTO_PROFILE}=0)",
        }
