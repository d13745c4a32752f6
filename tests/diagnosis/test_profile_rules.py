"""Rules on profiled windows: real CPU traces of tiny loops with known answers (torch.profiler
in the test), and GPU-shaped generated traces with known idle splits."""

from __future__ import annotations

import inspect
import json
import re
import warnings
from pathlib import Path

import pytest

from tests.helpers.chrome_traces import Scenario, profiled_recording, write_gpu_trace
from torchdoctor.diagnosis.engine import diagnose
from torchdoctor.diagnosis.findings import Finding
from torchdoctor.recording.reader import open_recording

PROFILE_RULES = {
    "sync-points",
    "op-bound",
    "launch-bound",
    "python-overhead",
    "memcpy-bound",
    "comm-exposed",
}


def profile_findings(path: Path) -> dict[str, Finding]:
    with open_recording(path) as rec:
        found = [f for f in diagnose(rec) if f.id in PROFILE_RULES]
    assert len({f.id for f in found}) == len(found)
    return {f.id: f for f in found}


def evidence(finding: Finding, label: str):
    return next(e.value for e in finding.evidence if e.label.startswith(label))


# -- real CPU traces --------------------------------------------------------------------------
def profile_loop(tmp_path: Path, body, steps: int = 5) -> Path:
    """Run ``body(step)`` under torch.profiler (1 warm-up step, ``steps`` active), as the
    agent arms it; the gzipped trace's path."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    torch.manual_seed(0)
    # torch warns that a cycle's events are cleared after its export: one cycle here.
    warnings.filterwarnings("ignore", "Profiler clears events", UserWarning)
    trace = tmp_path / "rank0-steps1-5.pt.trace.json.gz"
    with profile(
        activities=[ProfilerActivity.CPU],
        schedule=schedule(wait=0, warmup=1, active=steps),
        record_shapes=True,
        on_trace_ready=lambda p: p.export_chrome_trace(str(trace)),
    ) as prof:
        for step in range(steps + 1):
            body(step)
            prof.step()
    return trace


def mlp_step():
    import torch
    from torch import nn

    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.AdamW(model.parameters())
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))

    def step(_: int):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return step


def test_item_and_print_every_step(tmp_path: Path, capsys) -> None:
    train = mlp_step()

    def body(step: int) -> None:
        loss = train(step)
        value = loss.item()  # the sync this test looks for
        print(loss.detach().reshape(1))  # and another: print of a tensor
        assert value > 0

    trace = profile_loop(tmp_path, body)
    capsys.readouterr()
    line = (
        inspect.getsource(body)
        .splitlines()
        .index("        value = loss.item()  # the sync this test looks for")
        + body.__code__.co_firstlineno
    )
    sites = [
        ("item", __file__, line, "body", 5, 0.0004),
        ("__repr__", __file__, line + 1, "body", 5, 0.002),
    ]
    found = profile_findings(profiled_recording(tmp_path / "r.sqlite", trace, (1, 5), sites))
    assert set(found) == {"sync-points"}, [(f.title, f.evidence) for f in found.values()]
    sync = found["sync-points"]
    # loss.item() is one; print(tensor) formats through item() per element and more; AdamW's
    # own item() on its CPU step counter is not the user's and is not counted.
    assert evidence(sync, "synchronisations per step") >= 2
    assert f"{__file__}:{line}" in sync.recommendation
    assert sync.settings["sync_sites"] == [f"{__file__}:{line + 1}", f"{__file__}:{line}"]
    assert sync.severity == "info" and "at most" in sync.expected_effect


def test_one_slow_matmul(tmp_path: Path) -> None:
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(512, 1024), torch.randn(1024, 512)
    small = torch.randn(16)

    def body(step: int) -> None:
        for _ in range(20):
            small.mul(2).add(1)
        torch.mm(a, b)

    found = profile_findings(
        profiled_recording(tmp_path / "r.sqlite", profile_loop(tmp_path, body), (1, 5))
    )
    assert set(found) == {"op-bound"}
    op = found["op-bound"]
    assert "aten::mm [512, 1024] x [1024, 512] float" in op.title
    assert evidence(op, "aten::mm") >= 50
    assert "bfloat16" in op.recommendation and "at most" in op.expected_effect


def test_thousands_of_tiny_ops(tmp_path: Path) -> None:
    import torch

    x = torch.zeros(4)

    def body(step: int) -> None:
        y = x
        for i in range(1500):
            y = y + i  # a Python loop over tiny tensors: one op per iteration

    found = profile_findings(
        profiled_recording(tmp_path / "r.sqlite", profile_loop(tmp_path, body, 3), (1, 3))
    )
    assert set(found) == {"python-overhead"}
    assert evidence(found["python-overhead"], "top-level ops under 20 us") >= 1000


def test_healthy_demo_loop_gets_none(tmp_path: Path) -> None:
    """examples/train.py's model and loop, its data from a DataLoader (num_workers=0: the
    Dataset's work runs inside the step, under the DataLoader's annotation)."""
    import torch
    from examples.train import make_model
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    torch.set_num_threads(1)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = TensorDataset(torch.randn(32 * 8, 3, 64, 64), torch.randint(0, 10, (32 * 8,)))
    batches = iter(DataLoader(data, batch_size=32))

    def body(step: int) -> None:
        x, y = next(batches)
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    found = profile_findings(
        profiled_recording(tmp_path / "r.sqlite", profile_loop(tmp_path, body), (1, 5))
    )
    assert found == {}


# -- GPU-shaped traces ------------------------------------------------------------------------
GPU = {
    "healthy": (Scenario(kernel_us=(200.0, 150.0, 90.0, 60.0)), set()),
    "launch-bound": (
        Scenario(kernel_us=(2.0,), op_us=5, launch_us=3, cpu_gap_us=0.5, launch_latency_us=1,
                 device_gap_us=8),
        {"launch-bound"},
    ),
    # Half the kernels "short" (3 us after a 5 us launch) and long launch delays, as HTA counts
    # on a saturated ResNet: the GPU is busy, the queue deep - not launch-bound; its hot
    # kernel (an elementwise one, half the busy time) is what to work on.
    "deep-queue": (
        Scenario(kernel_us=(3.0, 200.0), op_us=8, launch_us=5, cpu_gap_us=1), {"op-bound"}
    ),
    "host-gaps": (Scenario(kernel_us=(20.0, 25.0, 22.0, 18.0), cpu_gap_us=60), {"python-overhead"}),
    "sync": (Scenario(kernel_us=(200.0, 150.0, 90.0, 60.0), sync_per_step=1), {"sync-points"}),
    "pageable": (
        Scenario(kernel_us=(200.0, 150.0, 90.0, 60.0), pageable_h2d_bytes=8_000_000),
        {"memcpy-bound"},
    ),
    "nccl-exposed": (
        Scenario(kernel_us=(200.0, 150.0, 90.0, 60.0), nccl_us=3000), {"comm-exposed"}
    ),
    "nccl-overlapped": (
        Scenario(kernel_us=(200.0, 150.0, 90.0, 60.0), nccl_us=1000, nccl_overlapped=True),
        set(),
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(GPU))
def test_gpu_shaped_traces(tmp_path: Path, name: str) -> None:
    scenario, expected = GPU[name]
    trace = write_gpu_trace(tmp_path / "t.pt.trace.json.gz", scenario)
    found = profile_findings(profiled_recording(tmp_path / "r.sqlite", trace, (10, 13)))
    assert set(found) == expected


def test_launch_bound_figures_and_bound(tmp_path: Path) -> None:
    scenario = GPU["launch-bound"][0]
    trace = write_gpu_trace(tmp_path / "t.pt.trace.json.gz", scenario)
    finding = profile_findings(profiled_recording(tmp_path / "r.sqlite", trace, (10, 13)))[
        "launch-bound"
    ]
    assert evidence(finding, "kernels per step") == 50
    assert evidence(finding, "kernel wait") == pytest.approx(100.0, abs=1)
    assert evidence(finding, "short kernels") == 100.0
    # Gaps of 8 us between 50 kernels: the expected effect claims no more than that idle time.
    claimed = re.search(r"at most (\d+) µs per step", finding.expected_effect)
    assert claimed and 49 * 8 <= int(claimed.group(1)) <= 50 * 8


def test_sync_cost_is_its_wait(tmp_path: Path) -> None:
    trace = write_gpu_trace(tmp_path / "t.pt.trace.json.gz", GPU["sync"][0])
    sites = [("item", "/job/train.py", 42, "main", 3, 0.004)]
    finding = profile_findings(profiled_recording(tmp_path / "r.sqlite", trace, (10, 13), sites))[
        "sync-points"
    ]
    assert evidence(finding, "synchronisations per step") == 1
    assert "/job/train.py:42 (item)" in finding.recommendation
    assert finding.severity == "warning"  # the wait is most of the step


# -- show, --json, the report -----------------------------------------------------------------
def test_show_json_and_report(tmp_path: Path) -> None:
    import dataclasses
    import io

    from tests.helpers.schemas import assert_valid
    from torchdoctor.cli.json_output import versioned
    from torchdoctor.recording.summary import summarize
    from torchdoctor.report.html import write_report
    from torchdoctor.run.end_report import render_summary
    from torchdoctor.terminal import make_console

    trace = write_gpu_trace(tmp_path / "t.pt.trace.json.gz", GPU["sync"][0])
    path = profiled_recording(
        tmp_path / "r.sqlite", trace, (10, 13), [("item", "/job/train.py", 42, "main", 3, 0.004)]
    )
    with open_recording(path) as rec:
        summary = summarize(rec)
    assert_valid("show", json.loads(json.dumps(versioned("show", dataclasses.asdict(summary)))))
    (window,) = summary.profiles
    assert window["steps_judged"] == 3 and window["syncs_per_step"] == 1 and window["gpu"]
    out = io.StringIO()
    render_summary(summary, make_console(file=out, width=400))
    (line,) = [x for x in out.getvalue().splitlines() if x.startswith("profile (")]
    assert line.startswith("profile (rank 0, steps 10-13): 3 steps judged")
    assert "syncs 1/step" in line and "GPU busy" in line and "host wait" in line
    html, data = write_report(path)
    page = html.read_text()
    assert '<section id="profiles">' in page and 'href="#profiles"' in page
    assert "aten::mul" in page and "[256, 256]" in page and "profile-bars" in page
    assert any(f.id == "sync-points" for f in data.findings)


def test_failed_window_is_one_line_everywhere(tmp_path: Path) -> None:
    import io

    from torchdoctor.recording.summary import summarize
    from torchdoctor.report.html import write_report
    from torchdoctor.run.end_report import render_summary
    from torchdoctor.terminal import make_console

    trace = tmp_path / "cut.pt.trace.json.gz"
    trace.write_bytes(b"\x1f\x8b\x08\x00garbage")
    path = profiled_recording(tmp_path / "r.sqlite", trace, (10, 13))
    with open_recording(path) as rec:
        summary = summarize(rec)
        assert [f for f in diagnose(rec) if f.id in PROFILE_RULES] == []
    out = io.StringIO()
    render_summary(summary, make_console(file=out, width=400))
    (line,) = [x for x in out.getvalue().splitlines() if x.startswith("profile (")]
    assert line.startswith(f"profile (rank 0, steps 10-13): no figures ({trace}: ")
    assert "No figures" in write_report(path)[0].read_text()
