"""A queued job's --mem is enforced by a memory cgroup of its own: a job that outgrows it is
the one the kernel stops, and the queue says it was OOM-killed."""

from __future__ import annotations

import os
import sys

from tests.queue.conftest import HELPERS, one_gpu


def test_a_job_outgrowing_its_mem_is_oom_killed_and_the_queue_says_so(queue_env, memory_cgroup):
    # memory_cgroup: cgroups can be made here (the queue makes its own for the job).
    q = queue_env(one_gpu())
    hog = [sys.executable, str(HELPERS / "memory_hog.py"), "-", "8", "0.05"]
    job_id = q.submit("--mem", "400M", "--", *hog)
    assert q.wait(job_id) == 137
    job = q.job(job_id)
    assert job.state == "failed" and job.exit_status == 137
    # 400M is 400 MiB (as Slurm and Docker read M): the limit the kernel enforced.
    assert job.reason.startswith("OOM-killed: the kernel killed pid ")
    assert "at its 400 MiB memory limit" in job.reason
    listed = q.td("queue", check=True).stdout
    assert "OOM-killed" in listed
    # The cgroup made for the job is gone with it.
    from torchdoctor.sampling import procfs

    parent = procfs.cgroup_paths("self").memory_dirs
    assert not any(name.startswith(f"job-{job_id}-") for d in parent for name in os.listdir(d))
