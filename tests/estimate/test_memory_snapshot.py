"""--memory-snapshot: the traced step in the format of torch.cuda.memory._snapshot()."""

from __future__ import annotations

import pickle

from torch.cuda import _memory_viz

from torchdoctor.estimate.api import estimate


def test_cuda_snapshot_opens_in_torchs_memory_viz_tools(models, tmp_path):
    path = tmp_path / "step.pickle"
    result = estimate(
        models.gpt_tiny,
        tokens=64,
        batch_size=2,
        gpu="A100-80GB",
        device="cuda",
        memory_snapshot=path,
    )
    snapshot = pickle.loads(path.read_bytes())
    events = snapshot["device_traces"][0]
    allocs = [e for e in events if e["action"] == "alloc"]
    frees = [e for e in events if e["action"] == "free_completed"]
    assert allocs and all(e["size"] % 512 == 0 for e in allocs)
    # Replaying the history reproduces the estimate's peak allocated bytes.
    live = peak = 0
    for event in events:
        if event["action"] == "alloc":
            live += event["size"]
        elif event["action"] == "free_completed":
            live -= event["size"]
        peak = max(peak, live)
    assert peak == result.peak_allocated
    # What is still allocated at the end is in the segments, which cover the reserved memory.
    active = sum(
        b["size"]
        for s in snapshot["segments"]
        for b in s["blocks"]
        if b["state"] == "active_allocated"
    )
    assert active == sum(e["size"] for e in allocs) - sum(e["size"] for e in frees)
    names = {frame["name"] for e in allocs for frame in e["frames"]}
    assert any("[activations]" in n for n in names) and any("[optimizer state]" in n for n in names)
    assert "<html" in _memory_viz.trace_plot(snapshot).lower()
    assert "segments:" in _memory_viz.segsum(snapshot)
    assert any("memory_viz" in note for note in result.notes)


def test_cpu_snapshot_has_one_event_per_allocation_and_free(models, tmp_path):
    path = tmp_path / "cpu.pickle"
    result = estimate(models.mlp_dropout, batch_size=8, memory_snapshot=path)
    events = pickle.loads(path.read_bytes())["device_traces"][0]
    live = peak = 0
    for event in events:
        if event["action"] == "alloc":
            live += event["size"]
        elif event["action"] == "free_completed":
            live -= event["size"]
        peak = max(peak, live)
    assert peak == result.tensor_peak
