"""Housekeeping of a queue: clean, restart, priority of a waiting job, one job paused, show
--json, and what submit says the job will see."""

from __future__ import annotations

import json
import os
import sys

from tests.queue.conftest import FAKE_JOB, one_gpu


def test_submit_says_what_the_job_will_see_with_the_defaults(queue_env):
    q = queue_env(one_gpu())
    done = q.td("submit", "--", sys.executable, FAKE_JOB, check=True)
    assert "it will see no GPU (CUDA_VISIBLE_DEVICES empty), 1 core and OMP_NUM_THREADS=1" in (
        done.stdout
    ), done.stdout
    job_id = int(done.stdout.split()[1])
    assert q.wait(job_id) == 0
    seen = q.job_report(job_id)
    assert seen["CUDA_VISIBLE_DEVICES"] == "" and seen["OMP_NUM_THREADS"] == "1"


def test_priority_pause_restart_clean_and_show_json(queue_env):
    q = queue_env(one_gpu())
    q.td("queue", "pause", check=True)  # nothing starts while we arrange the line
    every = ["--cpus", str(len(os.sched_getaffinity(0)))]  # one at a time: the order shows
    first = q.submit(*every, "--", sys.executable, FAKE_JOB)
    second = q.submit(*every, "--", sys.executable, FAKE_JOB, "--exit", "5")
    held = q.submit("--", sys.executable, FAKE_JOB)
    assert q.td("queue", "priority", str(second), "7", check=True).stdout.strip() == (
        f"job {second} priority 7"
    )
    q.td("queue", "pause", str(held), check=True)
    q.td("queue", "resume", check=True)
    assert q.wait(second) == 5 and q.wait(first) == 0
    assert q.job(second).ended_at <= q.job(first).started_at  # its priority put it first
    shown = json.loads(q.td("queue", "show", "--json", str(held), check=True).stdout)
    assert shown["schema_version"] == 1
    assert shown["job"]["state"] == "queued" and shown["job"]["held"] is True
    assert "paused by its owner" in shown["job"]["reason"]
    assert "env" not in shown["job"]
    refused = q.td("queue", "priority", str(first), "1")
    assert refused.returncode != 0 and "only a waiting job" in refused.stderr
    assert refused.stderr.count("\n") == 1
    q.td("queue", "resume", str(held), check=True)
    assert q.wait(held) == 0
    again = q.td("queue", "restart", str(second), check=True).stdout
    new = int(again.split()[1])
    assert q.wait(new) == 5
    restarted = q.job(new)
    assert restarted.argv == q.job(second).argv and restarted.restarted_from == second
    assert restarted.log != q.job(second).log
    cleaned = q.td("queue", "clean", "--state", "failed", check=True).stdout
    assert cleaned.strip() == f"removed 2 ended job(s): {second}, {new}"
    left = [j["id"] for j in json.loads(q.td("queue", "--json", check=True).stdout)["jobs"]]
    assert left == [first, held]
    assert "removed 0" in q.td("queue", "clean", "--older-than", "1h", check=True).stdout
    bad = q.td("queue", "clean", "--older-than", "soon")
    assert bad.returncode != 0 and "--older-than soon" in bad.stderr
