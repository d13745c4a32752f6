"""The machine-wide queue with real users: shared cores and GPU memory, fair order, limits,
who may see and touch what, a killed scheduler, and the requests an attacker would send."""

from __future__ import annotations

import itertools
import json
import os
import socket
import threading

from tests.queue.conftest import GIB, UUID0, one_gpu
from tests.queue.shared import shared  # noqa: F401 - the fixture

CORES = len(os.sched_getaffinity(0))


def _disjoint(a, b) -> bool:
    return a.ended_at <= b.started_at or b.ended_at <= a.started_at


def test_two_users_asking_for_every_core_at_once_run_one_after_the_other(shared):
    m = shared()
    alice, bob = m.add_user(), m.add_user()
    m.start_scheduler()
    ids: dict[str, int] = {}

    def submit(user):
        ids[user.name] = m.submit(user, "--cpus", str(CORES), *m.job_args("--burn", "1.0"))

    threads = [threading.Thread(target=submit, args=(u,)) for u in (alice, bob)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    a, b = (m.ended(ids[u.name]) for u in (alice, bob))
    assert (a.state, b.state) == ("done", "done"), m.scheduler_log()
    assert _disjoint(a, b), (a.started_at, a.ended_at, b.started_at, b.ended_at)
    seen = {}
    for user, job in ((alice, a), (bob, b)):
        first, last = m.report(job.id)
        seen[user.name] = (first["start"], last["end"])
        assert first["uid"] == first["euid"] == user.uid  # from /proc/self/status
        assert first["gid"] == user.gid
        assert first["cpus"] == (f"0-{CORES - 1}" if CORES > 1 else "0")
        assert job.uid == user.uid and job.user == user.name
    (s1, e1), (s2, e2) = seen.values()
    assert e1 <= s2 or e2 <= s1  # the jobs' own clocks: never on the same cores at once
