"""`torchdoctor compare` on real recordings of a real torch loop whose dataset sleeps for every
sample (data-bound): more DataLoader workers is faster and names num_workers and the data wait;
the same command twice is no significant change; a slowed run fails --fail-if-slower; unlike
workloads and short runs are refused in one line; --json validates against its schema.

The recordings are made once for the module, one after the other (runs side by side would slow
each other down and make the equal pair unequal)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TORCHDOCTOR
from tests.helpers.dependencies import require
from tests.helpers.schemas import assert_valid

JOB = Path(__file__).parent / "jobs" / "slow_loader.py"
STEPS = "40"  # 36 steady steps of ~41 ms: 6 blocks of 6


class Runs:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.env = {**os.environ, "TORCHDOCTOR_RUNS_DIR": str(folder)}

    def record(self, name: str, *args: str, env: dict[str, str] | None = None) -> str:
        out = self.folder / f"{name}.sqlite"
        done = subprocess.run(
            [*TORCHDOCTOR, "run", "--quiet", "--interval", "0.2", "-o", str(out), "--"]
            + [sys.executable, str(JOB), *args],
            capture_output=True,
            text=True,
            timeout=180,
            env={**self.env, **(env or {})},
        )
        assert done.returncode == 0, done.stderr
        return str(out)

    def compare(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*TORCHDOCTOR, "compare", *args],
            capture_output=True,
            text=True,
            timeout=120,
            env=self.env,
            cwd=self.folder,
        )


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    require("torch")
    r = Runs(tmp_path_factory.mktemp("compare-runs"))
    # In this order: `last` is "again" and `last~1` is "base" (newest first by time written).
    r.record("short", "0", "16")
    r.record("batch2", "0", "30", "2")
    r.record("slowed", "0", STEPS, env={"SLOW_LOADER_DELAY_S": "0.08"})
    r.record("workers_again", "2", STEPS)
    r.record("workers", "2", STEPS)
    r.record("base", "0", STEPS)
    r.record("again", "0", STEPS)
    return r


def p(runs: Runs, name: str) -> str:
    return str(runs.folder / f"{name}.sqlite")


def test_more_workers_is_faster_and_names_num_workers_and_the_data_wait(runs):
    done = runs.compare(p(runs, "base"), p(runs, "workers"))
    assert done.returncode == 0, done.stderr
    first = done.stdout.splitlines()[0]
    assert first.startswith("faster: B's step takes 0.")
    why = [line for line in done.stdout.splitlines() if "data wait fell" in line]
    assert why and "dataloader.num_workers 0 -> 2" in why[0], done.stdout
    assert "36 steady steps of A's 40" in done.stdout


def test_the_same_command_twice_is_no_significant_change(runs):
    # `last~1` and `last` name the two newest recordings, as `show last` does
    for pair in (("last~1", "last"), ("last", "last~1")):
        done = runs.compare(*pair, "--fail-if-slower", "5", "--fail-if-more-memory", "50")
        assert done.returncode == 0, done.stdout + done.stderr
        assert "Settings that differ" not in done.stdout
        # A neighbour's load that came or went between the two runs makes one truly slower:
        # then the verdict is right to say so, with the reason (the machine was busier).
        assert done.stdout.startswith("no significant change") or (
            "the machine was busier" in done.stdout
        ), done.stdout


def test_fail_if_slower_on_a_slowed_run(runs):
    done = runs.compare(p(runs, "base"), p(runs, "slowed"), "--fail-if-slower", "5")
    assert done.returncode == 4, done.stdout + done.stderr
    assert done.stdout.startswith("slower: ")
    assert done.stderr.count("\n") == 1 and "beyond --fail-if-slower 5" in done.stderr
    # the run that got faster passes the same gate, and a memory gate catches the workers' RSS
    done = runs.compare(p(runs, "slowed"), p(runs, "base"), "--fail-if-slower", "5")
    assert done.returncode == 0, done.stderr
    done = runs.compare(p(runs, "base"), p(runs, "workers"), "--fail-if-more-memory", "20")
    assert done.returncode == 4 and "--fail-if-more-memory 20" in done.stderr


def test_unlike_workloads_are_refused_in_one_line_unless_forced(runs):
    done = runs.compare(p(runs, "base"), p(runs, "batch2"))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        "torchdoctor: error: not the same workload: batch size 1 vs 2 (--force compares "
        "them anyway)"
    ]
    forced = runs.compare(p(runs, "base"), p(runs, "batch2"), "--force")
    assert forced.returncode == 0, forced.stderr
    assert "not the same workload (--force): batch size 1 vs 2" in forced.stdout


def test_too_few_steady_steps_and_bad_names_are_one_line(runs):
    done = runs.compare(p(runs, "base"), p(runs, "short"))
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1
    assert "has 15 steady steps of 16 recorded" in done.stderr
    done = runs.compare("last~9", "last")
    assert done.returncode == 2 and "'last~9' names the recording 9 before the newest" in (
        done.stderr
    )


def test_json_validates_against_its_schema(runs):
    require("jsonschema")
    done = runs.compare(p(runs, "base"), p(runs, "workers"), "--json")
    assert done.returncode == 0, done.stderr
    doc = assert_valid("compare", done.stdout)
    assert doc["verdict"] == "faster" and doc["ratio"]["high"] < 0.97
    phases = {ph["phase"]: ph for ph in doc["phases"]}
    assert phases["data_wait"]["moved"] and phases["data_wait"]["delta"]["high"] < 0
    assert {"key": "dataloader.num_workers", "a": 0, "b": 2} in doc["settings"]
    assert doc["regressions"] == [] and json.loads(done.stdout)["b"] == p(runs, "workers")


def test_a_cut_recording_is_compared_on_what_it_holds_and_says_so(runs, tmp_path):
    whole = Path(p(runs, "again")).read_bytes()
    cut = tmp_path / "cut.sqlite"
    cut.write_bytes(whole[: len(whole) * 3 // 4])  # a copy that stopped part way
    done = runs.compare(p(runs, "base"), str(cut))
    assert done.returncode == 0, done.stderr
    assert "note: B: recording damaged" in done.stdout
    # what the cut lost is not reported as changed
    assert "Settings that differ" not in done.stdout


def test_more_than_two_runs_are_each_compared_with_the_first(runs):
    require("jsonschema")
    three = (p(runs, "base"), p(runs, "workers"), p(runs, "slowed"))
    done = runs.compare(*three, "--fail-if-slower", "5")
    assert done.returncode == 4, done.stdout + done.stderr
    said = done.stdout + done.stderr  # every assertion shows what was printed
    sections = done.stdout.split("== C vs A ")
    assert sections[0].startswith("== B vs A ") and len(sections) == 2, said
    assert "faster: B's step takes 0." in sections[0], said
    assert "slower: C's step takes 1." in sections[1], said
    assert f"C: {three[2]}" in sections[1], said
    # The gate names the run that passed it, and only that one.
    assert done.stderr.splitlines() == [
        line for line in done.stderr.splitlines() if line.startswith("torchdoctor: C is slower")
    ], said
    doc = assert_valid("compare", runs.compare(*three, "--json").stdout)
    assert doc["a"] == three[0] and doc["runs"] == list(three[1:])
    assert [c["verdict"] for c in doc["comparisons"]] == ["faster", "slower"]
    assert [c["b"] for c in doc["comparisons"]] == list(three[1:])
    # Any run that is not the same workload refuses the whole comparison, in one line.
    done = runs.compare(*three, p(runs, "batch2"))
    assert done.returncode == 2 and done.stdout == "" and len(done.stderr.splitlines()) == 1


def test_a_computing_run_slowed_by_cpu_hogs_names_the_machine(runs, tmp_path):
    # A neighbour busy on every CPU the job may use while a compute-bound job runs: the
    # settings are equal, the job is slower, and compare names the saturated CPUs as the
    # first reason; the gate fails it (the step is slower, whatever made it so).
    job = [sys.executable, str(Path(__file__).parent / "jobs" / "busy_step.py"), "150"]

    def record(name: str) -> str:
        out = tmp_path / f"{name}.sqlite"
        cmd = [*TORCHDOCTOR, "run", "--quiet", "--interval", "0.2", "-o", str(out), "--", *job]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=runs.env)
        assert done.returncode == 0, done.stderr
        return str(out)

    quiet = record("quiet")
    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
        for _ in range(len(os.sched_getaffinity(0)))
    ]
    try:
        hogged = record("hogged")
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    done = runs.compare(quiet, hogged, "--fail-if-slower", "5")
    assert done.returncode == 4, done.stdout + done.stderr
    assert done.stdout.startswith("slower: ")
    why = done.stdout.split("Why\n", 1)[1].splitlines()
    # The job's own measure: its main thread waited for a CPU (schedstat), not only "the
    # machine was busy", which a job that sleeps would show too.
    assert any(line.startswith("  during B the job waited for a CPU") for line in why[:2]), (
        done.stdout
    )
    assert "Settings that differ" not in done.stdout


def test_several_runs_a_side_are_compared_as_two_sides(runs):
    require("jsonschema")
    before = (p(runs, "base"), p(runs, "again"))
    after = (p(runs, "workers"), p(runs, "workers_again"))
    done = runs.compare(*before, "vs", *after)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("faster: B (2 runs)'s step takes 0."), done.stdout
    assert "2 runs against 2, each one observation" in done.stdout
    for line in (f"A1: {before[0]}", f"A2: {before[1]}", f"B1: {after[0]}", f"B2: {after[1]}"):
        assert line in done.stdout.splitlines()
    assert "data wait fell by" in done.stdout and "num_workers 0 -> 2" in done.stdout
    doc = assert_valid("compare", runs.compare(*before, "vs", *after, "--json").stdout)
    assert doc["method"] == "runs, several a side" and doc["band"] == 0.01
    assert doc["a_runs"] == list(before) and doc["b_runs"] == list(after)
    assert doc["ratio"]["low"] <= doc["ratio"]["estimate"] <= doc["ratio"]["high"] < 0.99
    # The gate reads the same interval: the slower side fails it.
    gate = runs.compare(*after, "vs", *before, "--fail-if-slower", "5")
    assert gate.returncode == 4 and gate.stderr.startswith("torchdoctor: B is slower than A")


@pytest.mark.parametrize(
    "args, says",
    [
        (("base", "vs", "workers", "workers_again"), "1 run(s) before 'vs' and 2 after"),
        (("base", "again", "vs", "workers"), "2 run(s) before 'vs' and 1 after"),
        (("base", "again", "vs", "workers", "vs", "slowed"), "one 'vs' between the two sides"),
        (("base", "again", "vs", "workers", "batch2"), "B2: batch size 1 vs 2"),
    ],
)
def test_sides_that_cannot_be_compared_are_refused_in_one_line(runs, args, says):
    done = runs.compare(*(a if a == "vs" else p(runs, a) for a in args))
    assert done.returncode == 2 and done.stdout == "", done.stdout
    assert len(done.stderr.splitlines()) == 1 and says in done.stderr, done.stderr
