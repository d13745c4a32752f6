"""`torchdoctor submit --no-auto-profile`: the opt-out travels with the queued job's environment
to the recorder that runs it (run/auto_profile.py), as --profile-steps' variable does."""

from __future__ import annotations

import sys

from tests.queue.conftest import FAKE_JOB, one_gpu
from torchdoctor import config
from torchdoctor.recording import open_recording


def auto_profile_of(q, job_id: int) -> dict:
    assert q.wait(job_id) == 0
    with open_recording(q.job(job_id).recording) as rec:
        return rec.meta["auto_profile"]


def test_submit_no_auto_profile_reaches_the_recorder(queue_env):
    q = queue_env(one_gpu())
    plain = q.submit("--gpus", "1", "--", sys.executable, FAKE_JOB, "--gib", "1")
    off = q.submit("--gpus", "1", "--no-auto-profile", "--", sys.executable, FAKE_JOB, "--gib", "1")
    # On the GPU the queue gave it, a job's recorder watches for a slow step; not this one's.
    assert auto_profile_of(q, plain) == {"state": "watching"}
    assert auto_profile_of(q, off) == {
        "state": "off",
        "reason": f"switched off (--no-auto-profile or ${config.ENV_AUTO_PROFILE}=0)",
    }
