"""The profile-window parser (recording.profiles): GPU-shaped traces with known idle splits,
syncs, copies and communication; damaged traces; bounded memory on a large trace."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers.chrome_traces import Scenario, gpu_events, write_gpu_trace
from torchdoctor.recording.profiles import (
    DamagedTrace,
    analyse_trace,
    ingest_window,
    iter_events,
    read_profiles,
)
from torchdoctor.recording.reader import open_recording
from torchdoctor.recording.records import ProfileWindow
from torchdoctor.recording.writer import RecordingWriter


def hta_idle_split(events: list[dict]) -> tuple[float, float, float, float]:
    """HTA's idle-time breakdown (breakdown_analysis.py:746-816) for a one-stream trace, done
    the plain way on the whole event list: (busy, host wait, kernel wait, other) in us."""
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})
    }
    gpu = sorted(
        (e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
        key=lambda e: e["ts"],
    )
    busy = host = kernel = other = 0.0
    prev_end = None
    for e in gpu:
        start, end = e["ts"], e["ts"] + e["dur"]
        if prev_end is None:
            busy += end - start
        else:
            gap = start - prev_end
            if gap > 0:
                launch = launches[e["args"]["correlation"]]
                if launch["ts"] > prev_end:
                    host += gap
                elif gap < 30:
                    kernel += gap
                else:
                    other += gap
            busy += max(0.0, end - max(start, prev_end))
        prev_end = end if prev_end is None else max(prev_end, end)
    return busy, host, kernel, other


SCENARIOS = {
    "gpu-bound": Scenario(kernel_us=(200.0,)),
    "launch-bound": Scenario(
        kernel_us=(2.0,), op_us=5, launch_us=3, cpu_gap_us=0.5, launch_latency_us=1,
        device_gap_us=8,
    ),
    "host-gaps": Scenario(kernel_us=(20.0,), cpu_gap_us=60),
    "deep-queue": Scenario(kernel_us=(3.0, 200.0), op_us=8, launch_us=5, cpu_gap_us=1),
}  # fmt: skip


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_idle_split_matches_hta_rules(tmp_path: Path, name: str) -> None:
    path = write_gpu_trace(tmp_path / "t.json.gz", SCENARIOS[name])
    steps = analyse_trace(path).steps
    busy, host, kernel, other = hta_idle_split(gpu_events(path))
    got = [sum(getattr(s, f) for s in steps) for f in ("busy_us", "idle_host", "idle_kernel")]
    assert got == pytest.approx([busy, host, kernel], rel=1e-6, abs=1e-3)
    assert sum(s.idle_other for s in steps) == pytest.approx(other, abs=1e-3)


def test_known_figures_per_step(tmp_path: Path) -> None:
    # 60 us of Python between 12 us ops that launch 20 us kernels: each kernel after the
    # first of a step waits 72 - 20 = 52 us for the host.
    analysis = analyse_trace(write_gpu_trace(tmp_path / "h.json.gz", SCENARIOS["host-gaps"]))
    step = analysis.steps[1]
    assert analysis.gpu and analysis.compute_major == 8
    assert [s.number for s in analysis.steps] == [10, 11, 12, 13]
    assert step.kernels == 50 and step.busy_us == pytest.approx(1000)
    assert step.idle_host == pytest.approx(50 * 52, abs=1)
    assert step.idle_kernel == 0 and step.short_kernels == 0
    launch = analyse_trace(write_gpu_trace(tmp_path / "l.json.gz", SCENARIOS["launch-bound"]))
    step = launch.steps[1]
    assert step.short_kernels == 50 and step.idle_kernel == pytest.approx(50 * 8, abs=1)


def test_syncs_copies_and_communication(tmp_path: Path) -> None:
    sc = Scenario(kernel_us=(40.0,), sync_per_step=2, pageable_h2d_bytes=6_000_000)
    step = analyse_trace(write_gpu_trace(tmp_path / "s.json.gz", sc)).steps[1]
    assert step.rt_syncs == 2  # cudaStreamSynchronize; the item() ops are not counted twice
    assert step.pageable == 1 and step.pageable_bytes == 6_000_000
    assert step.h2d_us == pytest.approx(2000)  # 6 MB at 3 GB/s
    exposed = Scenario(kernel_us=(40.0,), nccl_us=3000)
    step = analyse_trace(write_gpu_trace(tmp_path / "n.json.gz", exposed)).steps[1]
    assert step.comm_gpu_us == pytest.approx(3000) and step.comm_exposed_us == pytest.approx(3000)
    hidden = Scenario(kernel_us=(100.0,), nccl_us=1000, nccl_overlapped=True)
    step = analyse_trace(write_gpu_trace(tmp_path / "o.json.gz", hidden)).steps[1]
    assert step.comm_gpu_us == pytest.approx(1000)
    assert step.comm_exposed_us < 0.05 * step.comm_gpu_us


def _recording(tmp_path: Path, trace: Path) -> Path:
    path = tmp_path / "run.sqlite"
    writer = RecordingWriter(path, {"command": ["python", "train.py"]})
    window = ProfileWindow(1, 0, 99, 10, 13, 9, 0.0, 1.0, str(trace), 1, "done", None)
    assert writer.add_profile_window(window, []) == 1
    ingest_window(writer, 1, str(trace))
    writer.close()
    return path


def test_ingest_and_read_back(tmp_path: Path) -> None:
    trace = write_gpu_trace(tmp_path / "t.json.gz", SCENARIOS["host-gaps"])
    with open_recording(_recording(tmp_path, trace)) as rec:
        (window,) = read_profiles(rec)
    assert window.gpu and window.label == "rank 0, steps 10-13"
    assert [s["step"] for s in window.steps] == [10, 11, 12, 13]
    assert [s["step"] for s in window.judged] == [10, 11, 12]
    assert window.typical("idle_host_s") == pytest.approx(50 * 52e-6, rel=0.02)
    assert window.ops[0]["name"] == "aten::mul"
    assert json.loads(window.ops[0]["input_dims"]) == [[256, 256], [256, 256]]
    assert window.kernels[0]["kind"] == "compute"


def test_recording_without_profile_tables_opens(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    RecordingWriter(path, {"command": ["x"]}).close()
    with open_recording(path) as rec:
        assert read_profiles(rec) == []


BAD_TRACES = {
    "cut": lambda p: p.write_bytes(gzip.compress(b'{"traceEvents": [{"ph": "X", "na')[:-9]),
    "truncated json": lambda p: p.write_bytes(gzip.compress(b'{"traceEvents": [{"ph": "X"}, {"ph')),
    "not json": lambda p: p.write_bytes(gzip.compress(b'{"traceEvents": [nonsense]}')),
    "not a trace": lambda p: p.write_text('{"hello": 1}'),
    "empty": lambda p: p.write_bytes(b""),
    "missing": lambda p: None,
}  # fmt: skip


@pytest.mark.parametrize("kind", list(BAD_TRACES))
def test_damaged_trace_marks_the_window_failed(tmp_path: Path, kind: str) -> None:
    trace = tmp_path / "bad.pt.trace.json.gz"
    BAD_TRACES[kind](trace)
    with pytest.raises(DamagedTrace) as err:
        analyse_trace(trace)
    assert str(trace) in str(err.value) and "\n" not in str(err.value)
    with open_recording(_recording(tmp_path, trace)) as rec:
        (window,) = read_profiles(rec)
    assert window.window["state"] == "failed" and window.window["reason"] == str(err.value)
    assert window.steps == [] and window.trace is None


def test_odd_events_are_skipped(tmp_path: Path) -> None:
    """Elements no profiler writes (numbers, strings, text times, negative durations, lists in
    args, ids past int64, bytes that are not UTF-8) are left out, not fatal."""
    trace = tmp_path / "odd.json"
    trace.write_bytes(
        b'{"traceEvents": [1, "x", [], {"ph": "X", "ts": "a", "dur": 1, "name": "n"},'
        b' {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1, "dur": -5},'
        b' {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "ts": 0, "dur": 50},'
        b' {"ph": "X", "cat": "cpu_op", "name": "aten::\xff", "ts": 2, "dur": 5,'
        b' "args": {"Input type": [["x"]], "Input Dims": {"a": 1}}},'
        b' {"ph": "X", "cat": "kernel", "name": "k", "ts": 3, "dur": 1,'
        b' "args": {"correlation": 99999999999999999999999, "stream": 7}}]}'
    )
    analysis = analyse_trace(trace)
    assert [s.number for s in analysis.steps] == [3] and analysis.steps[0].op_count == 1
    assert analysis.ops[0][0] == "aten::\ufffd"


def test_events_split_across_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Reads of 7 characters: every event and the step names straddle reads.
    import torchdoctor.recording.profiles as profiles

    trace = write_gpu_trace(tmp_path / "t.json.gz", Scenario(steps=3, kernels_per_step=3))
    whole = analyse_trace(trace)
    monkeypatch.setattr(profiles, "CHUNK_CHARS", 7)
    assert len(list(iter_events(trace))) == len(gpu_events(trace))
    assert analyse_trace(trace).steps == whole.steps


def test_bounded_memory_on_a_large_trace(tmp_path: Path) -> None:
    """~50 MB of trace JSON parsed in a child process: its peak RSS grows by < 64 MiB (the
    1 GB figure is benchmarks/profile_parse.py's)."""
    trace = write_gpu_trace(
        tmp_path / "big.json.gz", Scenario(steps=40, kernels_per_step=1500, sync_per_step=1)
    )
    size = sum(len(chunk) for chunk in _chunks(trace))
    assert size > 45e6
    code = textwrap.dedent(
        f"""
        import resource
        from torchdoctor.recording.profiles import analyse_trace
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        steps = analyse_trace({str(trace)!r}).steps
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(len(steps), (after - before) * 1024)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    steps, growth = out.stdout.split()
    assert int(steps) == 40
    assert int(growth) < 64 * 2**20, f"peak RSS grew {int(growth) / 2**20:.1f} MiB"


def _chunks(path: Path):
    with gzip.open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            yield chunk
