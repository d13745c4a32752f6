"""GPU-shaped torch.profiler traces, generated: the real Chrome-trace schema of a CUDA trace
(``cpu_op`` around ``cuda_runtime`` launches, ``kernel`` / ``gpu_memcpy`` events on a stream,
shared ``correlation`` ids, ``ac2g`` flows, ``ProfilerStep#N``, ``deviceProperties``) from a
model of a CPU thread feeding one GPU, so that each scenario's idle split, syncs, copies and
communication are known. No GPU here: these stand in for kineto's output (shared/reference/
profiler.md sections 1 and 6.4), written one event at a time so a 1 GB file costs no memory.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PID = 4242
TID = 4242
DEVICE = 0
COMPUTE_STREAM = 7
NCCL_STREAM = 20
T0 = 6_000_000_000.0  # us, as kineto's ts (the process clock)
BASE_NS = 1_790_000_000_000_000_000


@dataclass
class Scenario:
    steps: int = 4
    kernels_per_step: int = 50
    kernel_us: tuple[float, ...] = (40.0,)  # cycled over the step's kernels
    op_us: float = 12.0  # the aten op around each launch
    launch_us: float = 6.0  # cudaLaunchKernel
    cpu_gap_us: float = 3.0  # Python between two ops
    launch_latency_us: float = 4.0  # launch end -> kernel start, at least
    device_gap_us: float = 2.0  # between two kernels of a stream, at least
    sync_per_step: int = 0  # loss.item() at the end of the step: waits for the stream
    pageable_h2d_bytes: int = 0  # the batch copied at the step's start, pageable
    h2d_gbps: float = 3.0
    nccl_us: float = 0.0  # an all-reduce per step on its own stream
    nccl_overlapped: bool = False  # launched at mid-step (overlaps compute) or at the end
    op_name: str = "aten::mul"
    kernel_names: tuple[str, ...] = (
        "sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize128x128x8_stage3_warpsize2x2x1",
        "void at::native::vectorized_elementwise_kernel<4>(...)",
        "void cudnn::bn_fw_tr_1C11_kernel_NCHW<float, float, int, 512>(...)",
        "void at::native::reduce_kernel<512, 1>(...)",
    )  # cycled with kernel_us
    dtype: str = "float"
    dims: list[Any] = field(default_factory=lambda: [[256, 256], [256, 256]])


class TraceFile:
    """Writes a trace as torch does: a JSON object, pretty-printed, gzipped, one event at a
    time."""

    def __init__(self, path: Path, compute_major: int = 8) -> None:
        # Closed by close(): the file is written across many calls, as the profiler does.
        self.f = gzip.open(path, "wt", encoding="utf-8", compresslevel=1)  # noqa: SIM115
        props = [{"id": 0, "name": "NVIDIA H100", "computeMajor": compute_major, "numSms": 132}]
        self.f.write('{\n  "schemaVersion": 1,\n  "deviceProperties": ')
        self.f.write(json.dumps(props))
        self.f.write(f',\n  "baseTimeNanoseconds": {BASE_NS},\n  "traceEvents": [\n')
        self.first = True
        self.count = 0
        self.chars = 0  # of JSON text written: the trace's size uncompressed

    def event(self, ev: dict[str, Any]) -> None:
        text = json.dumps(ev, indent=2)
        if not self.first:
            text = ",\n" + text
        self.first = False
        self.f.write(text)
        self.count += 1
        self.chars += len(text)

    def close(self) -> None:
        self.f.write('\n  ],\n  "traceName": "synthetic"\n}\n')
        self.f.close()


class GpuModel:
    """One CPU thread launching onto one GPU; it writes the events and keeps the truth."""

    def __init__(self, out: TraceFile) -> None:
        self.out = out
        self.t = T0  # the CPU thread's clock
        self.free = {COMPUTE_STREAM: T0, NCCL_STREAM: T0}  # when each stream is free
        self.corr = 1000
        self.ext = 1
        self.pending: list[dict[str, Any]] = []  # GPU events, written after the step's CPU ones

    def _x(self, cat: str, name: str, ts: float, dur: float, **args: Any) -> dict[str, Any]:
        return {
            "ph": "X",
            "cat": cat,
            "name": name,
            "pid": PID,
            "tid": TID,
            "ts": round(ts, 3),
            "dur": round(dur, 3),
            "args": args,
        }

    def launch(
        self,
        sc: Scenario,
        gpu_cat: str,
        gpu_name: str,
        gpu_us: float,
        stream: int = COMPUTE_STREAM,
        op: str | None = None,
        runtime: str = "cudaLaunchKernel",
        gpu_args: dict[str, Any] | None = None,
    ) -> None:
        op_start = self.t
        launch_ts = op_start + (sc.op_us - sc.launch_us) / 2
        launch_end = launch_ts + sc.launch_us
        self.corr += 1
        self.ext += 1
        self.out.event(
            self._x(
                "cpu_op",
                op or sc.op_name,
                op_start,
                sc.op_us,
                **{"External id": self.ext, "Input Dims": sc.dims, "Input type": [sc.dtype] * 2},
            )
        )
        self.out.event(
            self._x(
                "cuda_runtime",
                runtime,
                launch_ts,
                sc.launch_us,
                correlation=self.corr,
                **{"External id": self.ext},
            )
        )
        start = max(launch_end + sc.launch_latency_us, self.free[stream] + sc.device_gap_us)
        self.free[stream] = start + gpu_us
        ev = {
            **self._x(gpu_cat, gpu_name, start, gpu_us),
            "pid": DEVICE,
            "tid": stream,
        }
        ev["args"] = {
            "device": DEVICE,
            "stream": stream,
            "correlation": self.corr,
            "External id": self.ext,
            **(gpu_args or {}),
        }
        self.pending.append(ev)
        self.t = op_start + sc.op_us + sc.cpu_gap_us

    def sync(self, sc: Scenario) -> None:
        """loss.item(): a 4-byte D2H copy, then cudaStreamSynchronize until the stream drains."""
        op_start = self.t
        self.launch(
            sc,
            "gpu_memcpy",
            "Memcpy DtoH (Device -> Pageable)",
            2.0,
            op="aten::_local_scalar_dense",
            runtime="cudaMemcpyAsync",
            gpu_args={"bytes": 4},
        )
        wait_start = self.t
        wait_end = max(wait_start + 2.0, self.free[COMPUTE_STREAM])
        self.corr += 1
        self.out.event(
            self._x("cuda_runtime", "cudaStreamSynchronize", wait_start, wait_end - wait_start)
        )
        self.out.event(self._x("cpu_op", "aten::item", op_start, wait_end - op_start + 1))
        self.t = wait_end + 1 + sc.cpu_gap_us

    def step(self, sc: Scenario, number: int) -> None:
        start = self.t
        if sc.pageable_h2d_bytes:
            us = sc.pageable_h2d_bytes / (sc.h2d_gbps * 1e3)
            self.launch(
                sc,
                "gpu_memcpy",
                "Memcpy HtoD (Pageable -> Device)",
                us,
                op="aten::copy_",
                runtime="cudaMemcpyAsync",
                gpu_args={"bytes": sc.pageable_h2d_bytes},
            )
        for i in range(sc.kernels_per_step):
            if sc.nccl_us and sc.nccl_overlapped and i == sc.kernels_per_step // 2:
                self.nccl(sc)
            name = sc.kernel_names[i % len(sc.kernel_names)]
            self.launch(sc, "kernel", name, sc.kernel_us[i % len(sc.kernel_us)])
        if sc.nccl_us and not sc.nccl_overlapped:
            self.nccl(sc)
        # The optimizer's kernels wait for the reduced gradients.
        self.free[COMPUTE_STREAM] = max(self.free[COMPUTE_STREAM], self.free[NCCL_STREAM])
        for _ in range(sc.sync_per_step):
            self.sync(sc)
        end = self.t
        self.out.event(
            self._x("user_annotation", f"ProfilerStep#{number}", start, end - start - 0.5)
        )
        for ev in self.pending:
            self.out.event(ev)
        self.pending.clear()

    def nccl(self, sc: Scenario) -> None:
        # DDP's reducer: the all-reduce waits for the gradients (the compute stream so far).
        self.free[NCCL_STREAM] = max(self.free[NCCL_STREAM], self.free[COMPUTE_STREAM])
        self.launch(
            sc,
            "kernel",
            "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)",
            sc.nccl_us,
            stream=NCCL_STREAM,
            op="nccl:all_reduce",
        )


def write_gpu_trace(path: Path, sc: Scenario, first_step: int = 10) -> Path:
    out = TraceFile(path)
    model = GpuModel(out)
    for n in range(sc.steps):
        model.step(sc, first_step + n)
    out.close()
    return path


def gpu_events(path: Path) -> list[dict[str, Any]]:
    """Every event of a (small) trace, for the brute-force oracle of the tests."""
    with gzip.open(path, "rt") as f:
        return json.load(f)["traceEvents"]


def profiled_recording(
    path: Path, trace: Path, steps: tuple[int, int], sites: list[tuple] = ()
) -> Path:
    """A recording holding one profile window over ``trace`` (as part A's recorder writes it:
    the window row, its sync sites ``(op, file, line, function, count, total_s)``), parsed by
    ingest_window."""
    from torchdoctor.recording.profiles import ingest_window
    from torchdoctor.recording.records import ProfileSyncSite, ProfileWindow
    from torchdoctor.recording.writer import RecordingWriter

    writer = RecordingWriter(path, {"command": ["python", "train.py"]})
    first, last = steps
    window = ProfileWindow(
        0, 0, 4242, first, last, first - 1, 0.0, 1.0, str(trace), 1, "done", None
    )
    window_id = writer.add_profile_window(window, [ProfileSyncSite(0, *s) for s in sites])
    ingest_window(writer, window_id, str(trace))
    writer.close()
    return path
