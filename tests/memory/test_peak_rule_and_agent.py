"""The snapshot at the end of a `run --memory-history` process: the agent writes it (and says
once when it cannot), and cuda-memory-peak names what filled a GPU near full at its peak."""

from __future__ import annotations

import json
import os
import pickle
from types import SimpleNamespace

from tests.diagnosis.conftest import by_id, run_rules  # noqa: F401 - the fixture
from tests.diagnosis.test_cuda_oom import _Agent
from tests.diagnosis.test_gpu_rules import gpu_job
from tests.memory import snapshots as snap
from torchdoctor.diagnosis.cuda_memory import analyse_snapshot
from torchdoctor.instrument.agent.cuda import ENV_MEMORY_HISTORY, SNAPSHOT_EVENT, CudaMemory
from torchdoctor.recording.records import JobEvent


def end_snapshot(first_step_us: int = snap.FIRST_STEP_US) -> dict:
    """The OOM snapshot's job, had it not run out: the same history without the oom entry."""
    snapshot = snap.oom_snapshot(first_step_us)
    snapshot["device_traces"][0] = [e for e in snapshot["device_traces"][0] if e["action"] != "oom"]
    return snapshot


def job_with_end_snapshot(tmp_path, used_gib: float):
    job = gpu_job(used_gib=used_gib, peak_gib=44.0, reserved_gib=72.0 * 44 / 66)
    path = tmp_path / "job.cuda-memory-1000.pickle"
    path.write_bytes(pickle.dumps(end_snapshot(int(job.steps[0].t_start * 1e6)), protocol=4))
    detail = {"snapshot": str(path), "reason": "exit"}
    job.events = [JobEvent(1000, None, job.steps[-1].t_end + 1, SNAPSHOT_EVENT, json.dumps(detail))]
    return job


def test_a_gpu_near_full_gets_the_make_up_of_its_peak(run_rules, tmp_path):  # noqa: F811
    findings = run_rules(job_with_end_snapshot(tmp_path, used_gib=76.0))
    assert "vram-near-full" in {f.id for f in findings}
    f = by_id(findings, "cuda-memory-peak")
    assert f.title == (
        f"CUDA memory peaked at 8.25 GiB allocated: {snap.TOP_LINE} held 3.00 GiB of "
        "activations at the peak"
    )
    assert f.recommendation.startswith("Activations held the most")
    values = {e.label: e.value for e in f.evidence}
    assert values["activations at the peak"] == snap.PHASES["activations"]
    assert values["reserved at the peak (snapshot)"] == snap.RESERVED_AT_PEAK
    assert "activations 3.50 GiB (42 %)" in f.details


def test_a_gpu_with_room_gets_no_peak_finding(run_rules, tmp_path):  # noqa: F811
    # 52 of 80 GiB in use; the snapshot's peak reserved 9.25 GiB: nothing to explain
    findings = run_rules(job_with_end_snapshot(tmp_path, used_gib=52.0))
    assert "cuda-memory-peak" not in {f.id for f in findings}


def fake_torch(snapshot: dict, fail: bool = False):
    """What CudaMemory calls of torch.cuda: the lazy-init queue, the history, the snapshot."""
    calls = SimpleNamespace(history=0, queued=[])

    def record_memory_history(**kwargs):
        calls.history += 1

    def take_snapshot():
        if fail:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return snapshot

    cuda = SimpleNamespace(
        _lazy_call=calls.queued.append,
        memory=SimpleNamespace(
            _record_memory_history=record_memory_history, _snapshot=take_snapshot
        ),
    )
    return SimpleNamespace(cuda=cuda, _C=SimpleNamespace()), calls


def test_the_agent_starts_the_history_at_cuda_init_and_writes_the_end_snapshot(
    tmp_path, monkeypatch
):
    monkeypatch.setenv(ENV_MEMORY_HISTORY, str(tmp_path / "job.cuda-{what}-{pid}.pickle"))
    torch, calls = fake_torch(end_snapshot())
    agent = _Agent(step=40, batch=64, in_backward=False)
    cuda = CudaMemory(agent, torch)
    cuda.watch_init()
    (at_init,) = calls.queued
    at_init()  # torch.cuda's lazy init runs it before the first allocation
    cuda.on_seen()
    assert calls.history == 1  # once, at init
    cuda.on_exit()
    written = tmp_path / f"job.cuda-memory-{os.getpid()}.pickle"
    assert agent.events == [(SNAPSHOT_EVENT, {"snapshot": str(written), "reason": "exit"})]
    assert analyse_snapshot(written).peak_allocated == snap.PEAK
    cuda.on_exit()  # twice (atexit after uninstall): one file, one event
    assert len(agent.events) == 1


def test_after_an_oom_snapshot_the_end_writes_none(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_MEMORY_HISTORY, str(tmp_path / "job.cuda-{what}-{pid}.pickle"))
    torch, _ = fake_torch(snap.oom_snapshot())
    agent = _Agent(step=3, batch=64, in_backward=False)
    cuda = CudaMemory(agent, torch)
    cuda.on_seen()
    cuda.on_uncaught(type("OutOfMemoryError", (Exception,), {}))
    cuda.on_exit()
    assert [kind for kind, _ in agent.events] == ["cuda-oom"]
    assert agent.events[0][1]["snapshot"] == str(tmp_path / f"job.cuda-oom-{os.getpid()}.pickle")
    assert not list(tmp_path.glob("*cuda-memory*"))


def test_a_snapshot_that_fails_is_said_once_and_not_tried_again(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_MEMORY_HISTORY, str(tmp_path / "job.cuda-{what}-{pid}.pickle"))
    torch, _ = fake_torch({}, fail=True)
    agent = _Agent(step=3, batch=64, in_backward=False)
    cuda = CudaMemory(agent, torch)
    cuda.on_seen()
    cuda.on_uncaught(type("OutOfMemoryError", (Exception,), {}))
    agent.counter.step += 1
    cuda.on_uncaught(type("OutOfMemoryError", (Exception,), {}))
    cuda.on_exit()
    kinds = [kind for kind, _ in agent.events]
    assert kinds == ["memory-snapshot-failed", "cuda-oom", "cuda-oom"]
    assert "illegal memory access" in agent.events[0][1]["error"]
    assert "snapshot" not in agent.events[2][1]  # switched off after the failure
    assert not list(tmp_path.iterdir())
