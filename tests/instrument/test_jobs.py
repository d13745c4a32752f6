"""Real CPU training loops run as child processes under the collector: what lands in the
recording must be what the job did."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.instrument.runjob import JOBS, PY, TRAIN, child_env, run_job, run_plain
from torchdoctor.instrument.agent import STOPPED_EXIT_STATUS
from torchdoctor.recording.steps import step_stats, warmup_steps


def _trainer_pid(run) -> int:
    pids = {r["pid"] for r in run.rows["steps"]}
    assert len(pids) == 1, pids
    return pids.pop()


def test_data_wait_fraction_matches_what_the_loop_measured(tmp_path):
    measure = tmp_path / "measured.json"
    run = run_job(
        [
            PY,
            TRAIN,
            "--samples",
            "96",
            "--delay",
            "0.003",
            "--compute-ms",
            "25",
            "--measure",
            str(measure),
        ],
        tmp_path / "r.sqlite",
    )
    assert run.returncode == 0, run.stderr
    measured = json.loads(measure.read_text())
    steps = sorted(run.rows["steps"], key=lambda r: r["step"])
    assert len(steps) == len(measured) == 12
    assert [s["batch_size"] for s in steps] == [8] * 12
    skip = warmup_steps(len(measured))
    wait = sum(m[0] for m in measured[skip:])
    wall = sum(m[1] for m in measured[skip:])
    stats = step_stats(run.rows["steps"], run.rows["dataloaders"], run.rows["settings"])
    # The job waits for data a good part of each step, but not all of it, so the agreement
    # below means something. Not a tight band: on a loaded machine every 3 ms sleep of the
    # dataset oversleeps by the scheduling delay, while the compute is timed by the clock.
    assert 0.15 < wait / wall < 0.85
    assert stats.data_wait_fraction == pytest.approx(wait / wall, abs=0.03)
    assert stats.median_step_s == pytest.approx(sorted(m[1] for m in measured[skip:])[5], rel=0.2)
    assert stats.samples_per_s == pytest.approx(8 * stats.steps_per_s, rel=0.01)
    # every step's data wait is its own: at least the 8 x 3 ms the dataset sleeps
    assert all(s["data_wait_s"] >= 0.024 for s in steps)
    (loader,) = run.rows["dataloaders"]
    assert loader["batch_size"] == 8 and loader["num_workers"] == 0
    assert loader["dataset_len"] == 96 and loader["sampler_type"] == "SequentialSampler"
    assert loader["first_batch_s"] >= 0.024
    settings = run.settings_of(_trainer_pid(run))
    assert json.loads(settings["optimizer.class"]) == "torch.optim.sgd.SGD"
    assert json.loads(settings["params.count"]) == 16 * 32 + 32 + 32 + 1
    assert json.loads(settings["params.devices"]) == ["cpu"]
    assert json.loads(settings["env.OMP_NUM_THREADS"]) == "1"
    assert json.loads(settings["torch.num_threads"]) == 1
    assert len(run.events("epoch-start")) == 1


def test_fork_workers_report_their_own_settings(tmp_path):
    run = run_job(
        [PY, TRAIN, "--workers", "2", "--context", "fork", "--fork-child"], tmp_path / "r.sqlite"
    )
    assert run.returncode == 0, run.stderr
    trainer = _trainer_pid(run)
    steps = run.rows["steps"]
    # no step twice: neither workers nor the forked child resent the trainer's buffer
    assert sorted(s["step"] for s in steps) == list(range(8))
    (loader,) = run.rows["dataloaders"]
    assert loader["num_workers"] == 2 and loader["multiprocessing_context"] == "fork"
    assert loader["prefetch_factor"] == 2 and loader["first_batch_s"] > 0
    workers = {
        r["pid"]
        for r in run.rows["settings"]
        if r["key"] == "process.role" and json.loads(r["value"]) == "dataloader-worker"
    }
    assert len(workers) == 2 and trainer not in workers
    for pid in workers:
        s = run.settings_of(pid)
        assert json.loads(s["torch.num_threads"]) == 1  # torch's worker default, measured
        assert json.loads(s["dataloader.parent_pid"]) == trainer
    assert sorted(json.loads(run.settings_of(p)["dataloader.worker_id"]) for p in workers) == [0, 1]


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_spawned_workers_are_instrumented_too(tmp_path, context):
    run = run_job([PY, TRAIN, "--workers", "1", "--context", context], tmp_path / "r.sqlite")
    assert run.returncode == 0, run.stderr
    trainer = _trainer_pid(run)
    (loader,) = run.rows["dataloaders"]
    assert loader["multiprocessing_context"] == context
    worker_pids = {e["pid"] for e in run.events("dataloader-worker-start")}
    assert len(worker_pids) == 1 and trainer not in worker_pids
    s = run.settings_of(worker_pids.pop())
    assert json.loads(s["dataloader.start_method"]) == context
    assert json.loads(s["torch.num_threads"]) == 1
    assert len(run.rows["steps"]) == 8


def test_torchrun_records_every_rank(tmp_path):
    run = run_job(
        [
            PY,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            TRAIN,
            "--ddp",
            "--threads",
            "1",
        ],
        tmp_path / "r.sqlite",
        timeout=180,
    )
    assert run.returncode == 0, run.stderr
    by_rank = {}
    for s in run.rows["steps"]:
        by_rank.setdefault(s["rank"], set()).add(s["pid"])
    assert set(by_rank) == {0, 1}
    assert all(len(pids) == 1 for pids in by_rank.values())
    for rank, pids in by_rank.items():
        s = run.settings_of(next(iter(pids)))
        assert json.loads(s["distributed.backend"]) == "gloo"
        assert json.loads(s["distributed.rank"]) == rank
        assert json.loads(s["distributed.world_size"]) == 2
        assert json.loads(s["optimizer.class"]) == "torch.optim.sgd.SGD"
    assert len([s for s in run.rows["steps"] if s["rank"] == 1]) == 8
    stats = step_stats(run.rows["steps"], run.rows["dataloaders"], run.rows["settings"])
    assert [r.rank for r in stats.per_rank] == [0, 1]


@pytest.fixture(scope="module")
def plain_short_run():
    return run_plain([PY, TRAIN, "--samples", "32"])


@pytest.mark.parametrize(
    "overrides",
    [
        {"num_threads": 0},  # torch.set_num_threads(0) raises inside our install
        {"num_workers": -1},  # DataLoader rejects it: the user's own loader must be built
    ],
)
def test_failing_instrumentation_switches_off_and_leaves_output_alone(
    tmp_path, overrides, plain_short_run
):
    argv = [PY, TRAIN, "--samples", "32"]
    plain = plain_short_run
    run = run_job(argv, tmp_path / "r.sqlite", env={"TORCHDOCTOR_OVERRIDES": json.dumps(overrides)})
    assert plain.returncode == run.returncode == 0
    assert run.stdout == plain.stdout and "finished" in run.stdout
    assert run.stderr == plain.stderr
    (event,) = run.events("instrumentation-disabled")
    detail = json.loads(event["detail"])
    assert detail["error"]
    assert run.rows["steps"] == []


def test_no_instrument_env_records_nothing_even_with_the_bootstrap_present(tmp_path):
    # e.g. a process started with TORCHDOCTOR_NO_INSTRUMENT=1 inside an instrumented job
    code = (
        "import torch; p = torch.nn.Parameter(torch.ones(1)); o = torch.optim.SGD([p], lr=1)\n"
        "for _ in range(3): p.sum().backward(); o.step()\nprint('ok')"
    )
    run = run_job(
        [PY, "-c", code],
        tmp_path / "r.sqlite",
        env={"TORCHDOCTOR_NO_INSTRUMENT": "1"},
        force_bootstrap=True,
    )
    assert run.returncode == 0 and run.stdout == "ok\n", run.stderr
    assert all(rows == [] for rows in run.rows.values())


def test_cli_run_records_steps_and_no_instrument_does_not(tmp_path):
    argv = [PY, TRAIN, "--samples", "24"]
    env = child_env()
    for flag, expected in (([], 3), (["--no-instrument"], 0)):
        out = tmp_path / f"r{len(flag)}.sqlite"
        proc = subprocess.run(
            [PY, "-m", "torchdoctor", "run", "--quiet", *flag, "--out", str(out), "--", *argv],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.count("loss") == 3
        from torchdoctor import open_recording

        with open_recording(out) as rec:
            assert len(rec.rows("steps")) == expected


def test_script_that_rewrites_sys_path(tmp_path):
    run = run_job([PY, str(JOBS / "syspath_job.py")], tmp_path / "r.sqlite")
    assert run.returncode == 0, run.stderr
    assert len(run.rows["steps"]) == 6


def test_python_dash_m_package(tmp_path):
    run = run_job([PY, "-m", "trainpkg"], tmp_path / "r.sqlite", cwd=JOBS)
    assert run.returncode == 0, run.stderr
    assert run.stdout == "package done\n"
    assert len(run.rows["steps"]) == 8
    (loader,) = run.rows["dataloaders"]
    assert loader["batch_size"] == 5 and loader["dataset_len"] == 40


def test_existing_sitecustomize_still_runs(tmp_path):
    user = tmp_path / "user_site"
    user.mkdir()
    (user / "sitecustomize.py").write_text("import os\nos.environ['USER_SITE_RAN'] = 'yes'\n")
    code = "import os, torch; print(os.environ.get('USER_SITE_RAN'))"
    run = run_job([PY, "-c", code], tmp_path / "r.sqlite", env={"PYTHONPATH": str(user)})
    assert run.stdout == "yes\n", run.stderr
    assert len(run.events("process-start")) == 1


def test_non_python_command_runs_untouched_and_its_python_children_are_instrumented(tmp_path):
    # The shell itself gets nothing but an environment it ignores: its output is its own. The
    # Python it starts is the one that imports torch, and the agent must reach it through the
    # shell (a broken or missing bootstrap records no process at all).
    script = (
        f"echo plain shell; {PY} -c 'import os, torch; print(\"child\", os.getpid())'; echo done"
    )
    run = run_job(["sh", "-c", script], tmp_path / "r.sqlite")
    assert run.returncode == 0 and run.stderr == "", run.stderr
    first, child, last = run.stdout.splitlines()
    assert (first, last) == ("plain shell", "done") and child.startswith("child ")
    (start,) = run.events("process-start")
    assert start["pid"] == int(child.split()[1])


def test_overrides_and_stop_after_steps_for_tune(tmp_path):
    overrides = {
        "num_workers": 2,
        "prefetch_factor": 4,
        "persistent_workers": True,
        "pin_memory": False,
        "num_threads": 1,
    }
    run = run_job(
        [PY, TRAIN, "--samples", "400", "--threads", "2"],
        tmp_path / "r.sqlite",
        env={"TORCHDOCTOR_OVERRIDES": json.dumps(overrides), "TORCHDOCTOR_STOP_AFTER_STEPS": "5"},
    )
    assert run.returncode == STOPPED_EXIT_STATUS, run.stderr
    # the 5th optimizer.step() ended the process: the script never printed that step's loss
    assert run.stdout.count("loss") == 4 and "finished" not in run.stdout
    assert sorted(s["step"] for s in run.rows["steps"]) == list(range(5))
    (stopped,) = run.events("stopped-after-steps")
    assert json.loads(stopped["detail"])["steps"] == 5
    (loader,) = run.rows["dataloaders"]
    assert loader["num_workers"] == 2 and loader["prefetch_factor"] == 4
    assert loader["persistent_workers"] == 1
    # the script's own torch.set_num_threads(2) was held at the override
    assert json.loads(run.settings_of(_trainer_pid(run))["torch.num_threads"]) == 1
    # no worker outlives the stopped trainer
    worker_pids = {e["pid"] for e in run.events("dataloader-worker-start")}
    assert len(worker_pids) == 2
    for pid in worker_pids:
        assert not os.path.exists(f"/proc/{pid}") or _is_zombie_or_gone(pid)


def _is_zombie_or_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
