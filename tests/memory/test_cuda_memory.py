"""CUDA memory at the peak, from a memory snapshot: the safe reader, the replay (by line, by
phase, reserved against allocated, fragmentation, the failed request), and what diagnose,
show and the report say of a recording whose events name a snapshot.

Snapshots come from a real traced CPU step (`estimate --memory-snapshot`, checked against the
estimate's own peak) and by hand in torch 2.13's shape (tests/memory/snapshots.py), checked
against torch's own _memory_viz.segsum; the GPU is the only thing not real."""

from __future__ import annotations

import json
import os
import pickle
import tracemalloc

import pytest
from torch.cuda import _memory_viz

from tests.conftest import run_td
from tests.diagnosis.builders import GiB
from tests.diagnosis.conftest import by_id, run_rules  # noqa: F401 - the fixture
from tests.diagnosis.test_cuda_oom import recorded_oom
from tests.diagnosis.test_gpu_rules import gpu_job
from tests.estimate.conftest import models  # noqa: F401 - the fixture
from tests.helpers.schemas import assert_valid
from tests.memory import snapshots as snap
from torchdoctor.diagnosis.cuda_memory import (
    NO_STACK,
    analyse_snapshot,
    frame_site,
)
from torchdoctor.diagnosis.snapshot_file import read_snapshot
from torchdoctor.errors import UserError
from torchdoctor.estimate.api import estimate
from torchdoctor.recording.records import JobEvent


def write(path, snapshot) -> str:
    path.write_bytes(pickle.dumps(snapshot, protocol=4))
    return str(path)


# -- the replay ------------------------------------------------------------------------


def test_peak_of_a_torch_shaped_oom_snapshot_by_line_and_phase(tmp_path):
    snapshot = snap.oom_snapshot()
    peak = analyse_snapshot(write(tmp_path / "oom.pickle", snapshot), snap.FIRST_STEP_US)
    assert peak.peak_allocated == snap.PEAK
    assert peak.by_phase == snap.PHASES  # the optimizer's state came after the peak
    top = peak.sites[0]
    assert (top.where, top.phase, top.bytes, top.blocks) == (
        snap.TOP_LINE, "activations", 3 * GiB, 3
    )  # fmt: skip
    wheres = {s.where: s.phase for s in peak.sites}
    assert wheres["train.py:8 main"] == "parameters"  # model.cuda(): Module._apply
    assert wheres["train.py:10 main"] == "parameters"  # made before the first step
    assert wheres[NO_STACK] == "gradients"
    assert peak.peak_reserved == snap.RESERVED_AT_PEAK
    assert (peak.end_reserved, peak.end_allocated) == (snap.RESERVED_AT_END, snap.ALLOCATED_AT_END)
    assert peak.fragmentation == snap.RESERVED_AT_END - snap.ALLOCATED_AT_END
    assert peak.largest_free_block == snap.LARGEST_FREE
    assert (peak.failed.bytes, peak.failed.device_free) == (snap.REQUEST, snap.DEVICE_FREE)
    # torch's own reading of the segments agrees on reserved and allocated at the end
    summary = _memory_viz.segsum(snapshot)
    assert f"total_reserved: {_memory_viz.Bytes(peak.end_reserved)}" in summary
    assert f"total_allocated: {_memory_viz.Bytes(peak.end_allocated)}" in summary


def test_without_the_first_step_an_early_buffer_is_not_called_a_parameter(tmp_path):
    peak = analyse_snapshot(write(tmp_path / "oom.pickle", snap.oom_snapshot()))
    assert {s.where: s.phase for s in peak.sites}["train.py:10 main"] == "activations"


def test_a_history_that_lost_its_start_places_live_blocks_by_the_stack_they_keep(tmp_path):
    # A long job: torch's ring kept only the last step. The weights (built on the device) and
    # Adam's state were allocated long before, but their blocks keep their stacks.
    base = 0x7F0000000000
    init = snap.frame(f"{snap.SITE}/nn/modules/linear.py", 106, "__init__")
    model = snap.frame("/home/u/proj/model.py", 12, "__init__")

    def block(addr, size, frames, state="active_allocated"):
        return {"address": addr, "size": size, "requested_size": size, "state": state,
                "frames": frames}  # fmt: skip

    blocks = [
        block(base, 2 * GiB, [init, snap.CALL, model, snap.TRAIN_8]),
        block(base + 2 * GiB, 4 * GiB, [snap.ADAM, snap.TRAIN_20]),
        block(base + 6 * GiB, GiB, []),  # no stack kept: before the history
        block(base + 7 * GiB, GiB, [], "inactive"),
    ]
    history = [
        {"action": "alloc", "addr": base + 7 * GiB, "size": GiB, "stream": 0,
         "frames": [snap.LINEAR, snap.CALL, snap.MODEL_42, snap.TRAIN_17]},
        {"action": "free_completed", "addr": base + 7 * GiB, "size": GiB, "stream": 0,
         "frames": []},
    ]  # fmt: skip
    segment = {"device": 0, "address": base, "total_size": 8 * GiB, "stream": 0,
               "segment_type": "large", "blocks": blocks}  # fmt: skip
    path = write(tmp_path / "long.pickle", {"segments": [segment], "device_traces": [history]})
    peak = analyse_snapshot(path)
    assert peak.peak_allocated == 8 * GiB
    assert peak.by_phase == {
        "optimizer state": 4 * GiB, "parameters": 2 * GiB, "activations": GiB,
        "before the history": GiB,
    }  # fmt: skip
    assert [(s.where, s.phase) for s in peak.sites] == [
        ("train.py:20 train_step", "optimizer state"),
        ("model.py:12 __init__", "parameters"),
        ("model.py:42 forward", "activations"),
    ]


def test_the_users_line_is_the_first_frame_outside_torch_python_and_the_agent():
    assert frame_site([snap.ADAM, snap.AGENT, snap.TRAIN_20, snap.RUNPY]) == (
        "train.py:20 train_step", "optimizer state"
    )  # fmt: skip
    native = snap.frame("??", 0, "c10::cuda::CUDACachingAllocator::malloc")
    assert frame_site([native, snap.LINEAR, snap.CALL, snap.MODEL_57]) == (
        "model.py:57 forward", "activations"
    )  # fmt: skip
    autograd = snap.frame(f"{snap.SITE}/autograd/__init__.py", 347, "backward")
    assert frame_site([autograd, snap.TRAIN_17])[1] == "gradients"
    assert frame_site([]) == (NO_STACK, "gradients")
    # only library frames: the innermost names where it was
    assert frame_site([snap.LINEAR, snap.CALL])[0] == "linear.py:125 forward"


def test_estimates_traced_step_gives_the_estimates_peak_and_its_parts(models, tmp_path):  # noqa: F811
    gpu = tmp_path / "gpu.pickle"
    result = estimate(
        models.gpt_tiny, tokens=64, batch_size=2, gpu="A100-80GB", device="cuda",
        memory_snapshot=gpu,
    )  # fmt: skip
    peak = analyse_snapshot(gpu)
    assert peak.peak_allocated == result.peak_allocated
    assert {"parameters", "gradients", "optimizer state", "activations"} <= set(peak.by_phase)
    assert sum(peak.by_phase.values()) == peak.peak_allocated
    assert peak.peak_allocated <= peak.peak_reserved
    assert peak.end_reserved == sum(
        s["total_size"] for s in pickle.loads(gpu.read_bytes())["segments"]
    )
    cpu = tmp_path / "cpu.pickle"
    result = estimate(models.mlp_dropout, batch_size=8, memory_snapshot=cpu)
    peak = analyse_snapshot(cpu)
    assert peak.peak_allocated == result.tensor_peak
    assert peak.peak_reserved is None and peak.fragmentation is None  # no segments on a CPU
    assert any("(Linear)" in s.where for s in peak.sites)  # the module that made it


# -- the file: safe, bounded, one line when bad ------------------------------------------


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_pickle_naming_a_global_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "ran"
    evil = {"segments": [], "device_traces": [[_Evil(str(marker))]]}
    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps(evil, protocol=4))
    with pytest.raises(UserError) as caught:
        analyse_snapshot(path)
    message = caught.value.message
    assert "names a Python global" in message and "system" in message and "\n" not in message
    assert not marker.exists()
    path.write_bytes(pickle.dumps(evil, protocol=0))  # GLOBAL + REDUCE in the old text form
    with pytest.raises(UserError, match="global"):
        analyse_snapshot(path)
    assert not marker.exists()


@pytest.mark.parametrize(
    "content, said",
    [
        ("half", "damaged or edited"),
        (b"not a pickle at all", "damaged or edited"),
        (b"", "damaged or edited"),
        (pickle.dumps([1, 2, 3]), "not a memory snapshot"),
        (pickle.dumps({"segments": [], "device_traces": [[{"action": "alloc"}]]}), "address"),
        (pickle.dumps({"segments": "x", "device_traces": []}), "segments"),
    ],
)
def test_a_damaged_file_is_one_line(tmp_path, content, said):
    path = tmp_path / "bad.pickle"
    if content == "half":
        whole = pickle.dumps(snap.oom_snapshot(), protocol=4)
        content = whole[: len(whole) // 2]
    path.write_bytes(content)
    with pytest.raises(UserError) as caught:
        analyse_snapshot(path)
    assert said in caught.value.message and "\n" not in caught.value.message


def test_a_file_over_the_limit_or_not_a_file_is_refused_unread(tmp_path):
    path = write(tmp_path / "big.pickle", snap.oom_snapshot())
    with pytest.raises(UserError, match="more than the 64 B torchdoctor reads"):
        read_snapshot(path, lambda h, e: None, lambda f: f, limit=64)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(UserError, match="FIFO"):
        analyse_snapshot(fifo)
    with pytest.raises(UserError, match="no such memory snapshot"):
        analyse_snapshot(tmp_path / "missing.pickle")


def test_a_long_history_is_read_in_bounded_memory(tmp_path):
    # 40,000 entries: reading it whole (pickle.loads) holds every entry; the reader keeps the
    # live blocks and the sums per line. Memory, not time, is what is asserted.
    snapshot = snap.long_history(40_000)
    data = pickle.dumps(snapshot, protocol=4)
    path = tmp_path / "long.pickle"
    path.write_bytes(data)
    del snapshot
    tracemalloc.start()
    try:
        whole = pickle.loads(data)
        _, loaded = tracemalloc.get_traced_memory()
        del whole
        tracemalloc.reset_peak()
        peak = analyse_snapshot(path)
        _, streamed = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak.peak_allocated == 1001 * 2**20 and peak.entries == 40_000
    assert streamed < loaded / 4, (streamed, loaded)


# -- what a recording's reader sees -----------------------------------------------------


def oom_recording(tmp_path, snapshot: bytes | None, name: str = "job.cuda-oom-1000.pickle"):
    """A recording of an A100 job whose step 3 ran out of memory in its optimizer step, its
    cuda-oom event naming ``snapshot`` (written beside it; None: a file that is not there)."""
    job = gpu_job(used_gib=79.0, autocast=None)
    job.settings[1000].update({"params.bytes": 2 * GiB, "optimizer.class": "torch.optim.Adam"})
    detail = recorded_oom(step=3, allocated=snap.PEAK, reserved=snap.RESERVED_AT_END,
                          requested=snap.REQUEST, free_blocks=[snap.LARGEST_FREE],
                          in_backward=False, in_optimizer=True)  # fmt: skip
    path = tmp_path / name
    detail["snapshot"] = str(path)
    if snapshot is not None:
        path.write_bytes(snapshot)
    job.events = [JobEvent(1000, None, job.steps[-1].t_end + 0.1, "cuda-oom", json.dumps(detail))]
    return job.write(tmp_path / "job.sqlite")


def oom_snapshot_of(job_first_step: float) -> bytes:
    return pickle.dumps(snap.oom_snapshot(int(job_first_step * 1e6)), protocol=4)


FIRST_STEP = gpu_job().steps[0].t_start  # where the builder's steps start
WIDE = {**os.environ, "COLUMNS": "200"}  # a panel's row on one line


def test_diagnose_names_the_line_and_the_phase_split_of_an_oom(tmp_path):
    recording = oom_recording(tmp_path, oom_snapshot_of(FIRST_STEP))
    done = run_td("diagnose", str(recording), env=WIDE)
    out = " ".join(done.stdout.split())
    assert done.returncode == 0, done.stderr
    assert f"{snap.TOP_LINE} held 3.00 GiB of activations at the peak" in out
    assert "at the peak: model.py:42 forward (activations, 3 blocks) 3.00 GiB" in out
    for phase, size in [("activations", "3.50"), ("parameters", "2.25"), ("gradients", "1.00"),
                        ("before the history", "1.50")]:  # fmt: skip
        assert f"{phase} at the peak {size} GiB" in out
    assert "request that failed (snapshot) 4.00 GiB" in out
    document = assert_valid("diagnose", run_td("diagnose", "--json", str(recording)).stdout)
    (oom,) = [f for f in document["findings"] if f["id"] == "cuda-oom"]
    assert "activations 3.50 GiB" in oom["details"]
    labels = {e["label"]: e["value"] for e in oom["evidence"]}
    assert labels["allocated at the peak (snapshot)"] == snap.PEAK


def test_a_snapshot_not_there_any_more_leaves_the_finding_as_it_was(tmp_path, run_rules):  # noqa: F811
    recording = oom_recording(tmp_path, None)
    done = run_td("diagnose", "--json", str(recording))
    (oom,) = [f for f in json.loads(done.stdout)["findings"] if f["id"] == "cuda-oom"]
    assert not any("snapshot" in e["label"] for e in oom["evidence"])
